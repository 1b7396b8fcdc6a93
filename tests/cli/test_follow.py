"""`finetune status` and `finetune logs`: the view built from what was read, and the real
commands, in a terminal (tmux) during a real `finetune run` and with a kubeconfig against
the real API server."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from finetune_operator.api import Progress
from finetune_operator.follow import (
    mark_failed,
    newest_pod,
    output_folder,
    progress_bar,
    render,
    view_of_job,
    view_of_output,
)
from finetune_operator.kube import default_namespace
from finetune_trainer.record import ProgressRecord
from tests.trainer.test_training import manifest

FINETUNE = [sys.executable, "-m", "finetune_operator.cli"]
INDEX = "batch.kubernetes.io/job-completion-index"


def test_the_bar_shows_step_total_loss_throughput_and_eta():
    bar = progress_bar(Progress(step=30, total_steps=120, loss=1.23456, eval_loss=1.5,
                                tokens_per_second=5120.4, eta_seconds=725), width=20)
    assert bar == ("[#####...............] 30/120  25% | loss 1.2346 | eval 1.5000 | "
                   "5,120 tok/s | eta 0:12:05")
    assert progress_bar(None).endswith("no step yet")


def test_a_job_from_the_api_server_with_its_last_events():
    obj = {"metadata": {"name": "demo"}, "status": {
        "phase": "Restarting", "message": "worker 1 failed", "restarts": 1,
        "progress": {"step": 10, "totalSteps": 40, "loss": 2.0},
        "backendRef": {"kind": "Job", "name": "demo"},
        "conditions": [{"type": "Validated", "status": "True", "reason": "Valid",
                        "message": "ok", "lastTransitionTime": "2026-11-23T10:00:00Z"}]}}
    events = [{"type": "Normal", "reason": f"R{i}", "message": f"m{i}",
               "lastTimestamp": f"2026-11-23T10:00:{i:02d}Z"} for i in range(8)]
    lines = render(view_of_job(obj, events))
    assert lines[0] == "demo  Restarting  worker 1 failed"
    assert "10/40" in lines[1] and "restarts: 1" in lines[2] and "where: Job demo" in lines[3]
    assert any(line.split()[:3] == ["Validated", "True", "Valid"] for line in lines)
    shown = [line.split()[1] for line in lines if line.strip().startswith("Normal")]
    assert shown == ["R3", "R4", "R5", "R6", "R7"]  # the last five, oldest first


def test_the_newest_pod_of_a_node_rank_is_the_current_one():
    def pod(name, index, created):
        return {"metadata": {"name": name, "creationTimestamp": created,
                             "annotations": {INDEX: str(index)}}}

    pods = [pod("a", 0, "2026-11-23T10:00:00Z"), pod("b", 1, "2026-11-23T10:00:00Z"),
            pod("c", 0, "2026-11-23T10:05:00Z")]
    assert newest_pod(pods, 0, INDEX)["metadata"]["name"] == "c"
    assert newest_pod(pods, 2, INDEX) is None


def test_a_local_run_is_found_from_its_manifest_and_a_failure_ends_the_watch(tmp_path):
    job = manifest(tmp_path / "model", Path("out"))
    job["spec"]["output"]["uri"] = "./out"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    name, folder = output_folder(str(tmp_path / "job.yaml"))
    assert (name, folder) == (job["metadata"]["name"], tmp_path / "out")
    assert view_of_output(name, folder).phase == "Pending"
    folder.mkdir()
    (folder / "progress.json").write_text(json.dumps(ProgressRecord(
        step=3, totalSteps=6, loss=1.0).as_json()))
    assert not view_of_output(name, folder).finished
    (tmp_path / "notes.txt").write_text("not a manifest: a job of that name is asked for")
    assert output_folder(str(tmp_path / "notes.txt")) is None
    mark_failed(folder)
    view = view_of_output(name, folder)
    assert view.finished and view.phase == "Failed" and view.progress.step == 3


def test_the_namespace_is_the_kubeconfig_contexts(tmp_path):
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "work",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "work", "context": {"cluster": "c", "user": "u",
                                                  "namespace": "team-a"}},
                     {"name": "other", "context": {"cluster": "c", "user": "u"}}]}))
    assert default_namespace(str(kubeconfig)) == "team-a"
    assert default_namespace(str(tmp_path / "missing")) == "default"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_status_watch_in_a_terminal_follows_a_real_run_to_succeeded(tiny_model_dir, tmp_path):
    job = manifest(tiny_model_dir, Path("out"), steps=30, checkpoint_every=1000)
    job["spec"]["output"]["uri"] = "./out"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run = subprocess.Popen([*FINETUNE, "run", str(path)], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    session = f"finetune-status-{tmp_path.name}"
    watch = " ".join([*FINETUNE, "status", str(path), "--watch", "--interval", "0.3"])
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "140", "-y", "30",
                    f"{watch}; echo EXIT=$?; sleep 60"], check=True)
    steps, screen = set(), ""
    try:
        deadline = time.monotonic() + 360
        while (time.monotonic() < deadline and "EXIT=" not in screen
               and run.poll() in (None, 0)):
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                    capture_output=True, text=True).stdout
            steps |= {int(s) for s in re.findall(r"\] (\d+)/30", screen)}
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        output = run.communicate(timeout=120)[0]
    assert run.returncode == 0, output[-3000:]
    assert "EXIT=0" in screen, screen
    assert len(steps) >= 3 and max(steps) == 30, f"the bar showed steps {sorted(steps)}"
    final = [line for line in screen.splitlines() if line.strip()]
    assert final[0].startswith(f"{job['metadata']['name']}  Succeeded"), screen
    assert screen.count("Succeeded") == 1, "redrawn in place, not scrolled"
    logs = subprocess.run([*FINETUNE, "logs", str(path)], capture_output=True, text=True)
    assert logs.returncode == 0 and "step 30/30" in logs.stdout


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_status_and_logs_with_a_kubeconfig_against_the_real_api_server(
        control_plane_testbed):
    testbed = control_plane_testbed
    kubeconfig = str(testbed.installation.plane.admin_kubeconfig)
    cluster = ["-n", testbed.namespace, "--kubeconfig", kubeconfig]

    def finetune(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*FINETUNE, *args], capture_output=True, text=True, timeout=120)

    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    await testbed.report_progress("demo")
    await testbed.until(lambda: testbed.status().get("progress", {}).get("step") == 40,
                        "progress in status")
    shown = await asyncio.to_thread(finetune, "status", "demo", *cluster)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("demo  Running")
    assert "40/100" in shown.stdout and "loss 1.2500" in shown.stdout
    assert re.search(r"Running +True +WorkersRunning", shown.stdout), shown.stdout
    assert re.search(r"Normal +Running +training", shown.stdout), shown.stdout  # an event

    # KWOK's pods have no kubelet to serve a log: the command finds rank 0's pod and says
    # what the API server answered
    logs = await asyncio.to_thread(finetune, "logs", "demo", *cluster)
    assert logs.returncode == 1 and "read the log of pod demo-0" in logs.stderr, logs.stderr
    missing = await asyncio.to_thread(finetune, "logs", "demo", "--rank", "5", *cluster)
    assert "has no pod of node rank 5" in missing.stderr

    watch = await asyncio.create_subprocess_exec(
        *FINETUNE, "status", "demo", "--watch", "--interval", "0.3", *cluster,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    await testbed.finish("demo")
    out, err = await asyncio.wait_for(watch.communicate(), timeout=120)
    assert watch.returncode == 0, err.decode()
    blocks = out.decode().split("demo  ")
    assert blocks[-1].startswith("Succeeded"), out.decode()[-2000:]
    absent = await asyncio.to_thread(finetune, "status", "nope", *cluster)
    assert absent.returncode == 1 and "no FineTuneJob nope" in absent.stderr
