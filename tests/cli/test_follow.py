"""`finetune status` and `finetune logs`: the view built from what was read, and the real
commands, in a terminal (tmux) during a real `finetune run` and with a kubeconfig against
the real API server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from finetune_operator.api import Progress
from finetune_operator.follow import (
    NotARun,
    OnItsCluster,
    elsewhere,
    log_to_read,
    mark_failed,
    namespaces_holding,
    newest_pod,
    not_started,
    output_folder,
    progress_bar,
    render,
    view_of_job,
    view_of_output,
    view_of_sweep,
)
from finetune_operator.kube import KubeError, default_namespace
from finetune_operator.local import lock as run_lock
from finetune_trainer.layout import LOCAL_CONFIG, RUN_LOCK
from finetune_trainer.record import ProgressRecord
from tests.conftest import REPO
from tests.support import waits
from tests.trainer.test_training import manifest

FINETUNE = [sys.executable, "-m", "finetune_operator.cli"]
INDEX = "batch.kubernetes.io/job-completion-index"


def test_the_bar_shows_step_total_loss_throughput_and_eta():
    bar = progress_bar(Progress(step=30, total_steps=120, loss=1.23456, eval_loss=1.5,
                                tokens_per_second=5120.4, eta_seconds=725), width=20)
    assert bar == ("[#####...............] 30/120  25% | loss 1.2346 | eval 1.5000 | "
                   "5,120 tok/s | eta 0:12:05")
    assert progress_bar(None).endswith("no step yet")
    assert progress_bar(Progress(step=0)).endswith("no step yet")  # failed before a step
    assert progress_bar(Progress(step=0, total_steps=40)).startswith("[....")
    stopped = progress_bar(Progress(step=74, total_steps=100, eta_seconds=0), running=False)
    assert "eta" not in stopped  # a stopped or finished run's last record: a stale eta


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
    # within one second (timestamps have no more), in the order the API server stored them
    same = [{"type": "Warning" if v > 2 else "Normal", "reason": f"S{v}", "message": "",
             "lastTimestamp": "2026-11-23T10:01:00Z", "metadata": {"resourceVersion": str(v)}}
            for v in (12, 3, 11, 2)]
    assert [line.split()[1] for line in render(view_of_job(obj, same))
            if line.split()[0] in ("Normal", "Warning")] == ["S2", "S3", "S11", "S12"]


def test_a_job_no_operator_has_seen_is_said_so():
    """#51, item 3: a FineTuneJob without any status (no operator installed, stopped, or
    watching other namespaces) said so, not "Unknown ... no step yet"."""
    lines = render(view_of_job({"metadata": {"name": "demo"}}, []))
    assert lines[0].startswith("demo  Unknown  no operator has acted on it yet — is one "
                               "running, and watching this namespace?"), lines
    assert "no step yet" not in "\n".join(lines)


def test_a_sweep_shows_a_line_per_trial_and_the_best():
    trial = {"number": 0, "name": "lr-0", "params": {"hyperparameters.learningRate": 3e-4,
                                                      "method.lora.r": 8},
             "output": "pvc://out/lr/lr-0"}
    obj = {"metadata": {"name": "lr"}, "spec": {"maxTrials": 4, "objective": {
        "metric": "evalLoss"}}, "status": {
        "phase": "Running", "trialCount": 2, "runningTrials": 1, "trials": [
            {**trial, "phase": "Succeeded", "step": 40, "objective": 1.23456},
            {**trial, "number": 1, "name": "lr-1", "phase": "Stopped", "step": 20,
             "objective": 2.5, "message": "median stopping at step 20"}],
        "best": {**trial, "objective": 1.23456}}}
    lines = render(view_of_sweep(obj, []))
    assert lines[0] == "lr  Running"
    assert lines[1:4] == [
        "  trials: 2 of 4, 1 running",
        "    lr-0  Succeeded  step     40  evalLoss  1.2346  "
        "hyperparameters.learningRate=0.0003, method.lora.r=8",
        "    lr-1  Stopped    step     20  evalLoss  2.5000  "
        "hyperparameters.learningRate=0.0003, method.lora.r=8  (median stopping at step 20)"]
    assert lines[4] == ("  best: lr-0 evalLoss 1.2346 (hyperparameters.learningRate=0.0003, "
                        "method.lora.r=8), model in pvc://out/lr/lr-0")
    assert not view_of_sweep(obj, []).finished


def test_the_newest_pod_of_a_node_rank_is_the_current_one():
    def pod(name, index, created):
        return {"metadata": {"name": name, "creationTimestamp": created,
                             "annotations": {INDEX: str(index)}}}

    pods = [pod("a", 0, "2026-11-23T10:00:00Z"), pod("b", 1, "2026-11-23T10:00:00Z"),
            pod("c", 0, "2026-11-23T10:05:00Z")]
    assert newest_pod(pods, 0, INDEX)["metadata"]["name"] == "c"
    assert newest_pod(pods, 2, INDEX) is None


def test_a_pod_that_has_not_started_says_what_it_waits_for():
    def pod(phase, conditions=(), containers=()):
        return {"status": {"phase": phase, "conditions": list(conditions),
                           "containerStatuses": list(containers)}}

    unscheduled = pod("Pending", [{"type": "PodScheduled", "status": "False",
                                   "reason": "Unschedulable",
                                   "message": "0/5 nodes are available: 5 Insufficient "
                                              "nvidia.com/gpu."}])
    assert not_started(unscheduled, "trainer") == (
        "not on a node: Unschedulable: 0/5 nodes are available: 5 Insufficient nvidia.com/gpu.")
    pulling = pod("Pending", containers=[{"name": "trainer", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}])
    assert not_started(pulling, "trainer") == "waiting: ImagePullBackOff (Back-off pulling image)"
    assert not_started(pod("Pending"), "trainer") == "Pending"
    running = pod("Running", containers=[{"name": "trainer", "state": {"running": {}}}])
    assert not_started(running, "trainer") is None
    ended = pod("Failed", containers=[{"name": "trainer", "state": {"terminated": {}}}])
    assert not_started(ended, "trainer") is None
    assert not_started(pod("Succeeded"), "trainer") is None


def test_before_the_trainer_starts_the_log_to_read_is_an_init_containers():
    """resume-check and fetch-model run first, in the trainer's image: one that cannot start
    is the reason (not the trainer's PodInitializing); one that runs or failed has the log
    that says what happens (the model's download, a refusal)."""
    def pod(phase, *inits, trainer=None):
        return {"status": {"phase": phase, "initContainerStatuses": [
            {"name": name, "state": state} for name, state in inits],
            "containerStatuses": [{"name": "trainer", "state": trainer or {
                "waiting": {"reason": "PodInitializing"}}}]}}

    done, running = {"terminated": {"exitCode": 0}}, {"running": {}}
    pulling = pod("Pending", ("resume-check", {"waiting": {
        "reason": "ErrImagePull", "message": "failed to pull image"}}),
        ("fetch-model", {"waiting": {"reason": "PodInitializing"}}))
    assert not_started(pulling, "trainer") == (
        "init container resume-check waiting: ErrImagePull (failed to pull image)")
    assert log_to_read(pulling, "trainer") == (None, not_started(pulling, "trainer"))
    fetching = pod("Pending", ("resume-check", done), ("fetch-model", running))
    assert log_to_read(fetching, "trainer") == ("fetch-model", None)
    assert log_to_read(fetching, "trainer", ["fetch-model"]) == (None, "waiting: PodInitializing")
    refused = pod("Failed", ("resume-check", {"terminated": {"exitCode": 4}}),
                  ("fetch-model", {"waiting": {"reason": "PodInitializing"}}))
    assert log_to_read(refused, "trainer") == ("resume-check", None)
    training = pod("Running", ("resume-check", done), ("fetch-model", done), trainer=running)
    assert log_to_read(training, "trainer") == ("trainer", None)


def test_a_local_run_is_found_from_its_manifest_and_a_failure_ends_the_watch(tmp_path,
                                                                             monkeypatch):
    job = manifest(tmp_path / "model", Path("out"))
    job["spec"]["output"]["uri"] = "./out"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    name, folder = output_folder(str(tmp_path / "job.yaml"))
    assert (name, folder) == (job["metadata"]["name"], tmp_path / "out")
    view = view_of_output(name, folder)  # `status --watch` started beside `finetune run`
    assert (view.phase, view.message) == ("Pending", "no `finetune run` has written here yet")
    folder.mkdir()
    (folder / "progress.json").write_text(json.dumps(ProgressRecord(
        step=3, totalSteps=6, loss=1.0).as_json()))
    assert not view_of_output(name, folder).finished
    (tmp_path / "notes.txt").write_text("not a manifest: a job of that name is asked for")
    monkeypatch.chdir(tmp_path)
    assert output_folder("notes.txt") is None
    with pytest.raises(NotARun, match="not a valid FineTuneJob manifest"):  # a path: no name
        output_folder(str(tmp_path / "notes.txt"))
    mark_failed(folder)
    view = view_of_output(name, folder)
    assert view.finished and view.phase == "Failed" and view.progress.step == 3


def test_an_output_folder_is_named_by_its_job_not_by_the_folder(tmp_path):
    folder = tmp_path / "output"
    folder.mkdir()
    assert output_folder(str(folder)) == ("output", folder)  # not written by `finetune run`
    (folder / LOCAL_CONFIG).parent.mkdir()
    (folder / LOCAL_CONFIG).write_text(yaml.safe_dump({"job": {"name": "tiny-cpu-lora"}}))
    assert output_folder(str(folder)) == ("tiny-cpu-lora", folder)


def test_a_run_that_ended_before_its_first_step_reads_stopped_not_pending(tmp_path):
    """Ctrl-C while the model loads, or a preflight that failed: the folder has the run's
    lock file, nobody holds it, and no progress.json. It read `Pending` forever."""
    (tmp_path / RUN_LOCK).parent.mkdir(parents=True)
    (tmp_path / RUN_LOCK).write_text("")
    view = view_of_output("demo", tmp_path)
    assert view.phase == "Stopped"
    assert "ended before its first step" in view.message
    held = run_lock.hold(tmp_path)  # a run loading its model right now
    try:
        assert view_of_output("demo", tmp_path).phase == "Pending"
    finally:
        os.close(held)


@pytest.mark.process
def test_status_as_json_is_the_look_a_script_reads(tmp_path):
    """`-o json`: one line, the phase and the progress by status.progress's names, and the
    same exit code as the text (1 for a failed run)."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / LOCAL_CONFIG).parent.mkdir()
    (folder / LOCAL_CONFIG).write_text(yaml.safe_dump({"job": {"name": "tiny"}}))
    (folder / "progress.json").write_text(json.dumps(ProgressRecord(
        step=3, totalSteps=6, loss=1.5, phase="Failed").as_json()))
    result = subprocess.run([*FINETUNE, "status", str(folder), "-o", "json"],
                            capture_output=True, text=True, timeout=waits.seconds_left())
    assert result.returncode == 1, result.stderr
    (line,) = result.stdout.splitlines()
    look = json.loads(line)
    assert (look["name"], look["phase"], look["where"]) == ("tiny", "Failed", str(folder))
    assert look["progress"]["step"] == 3 and look["progress"]["totalSteps"] == 6
    assert look["progress"]["loss"] == 1.5 and "eta" not in line
    assert look["conditions"] == [] and look["events"] == []


def test_a_run_that_says_running_with_no_finetune_run_holding_its_folder_was_stopped(
        tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "progress.json").write_text(json.dumps(ProgressRecord(
        step=3, totalSteps=6, loss=1.0).as_json()))
    assert view_of_output("j", folder).phase == "Running"  # no lock file: an older run
    lock = run_lock.hold(folder)
    try:
        assert run_lock.holder(folder).startswith(f"pid {os.getpid()} since ")
        assert view_of_output("j", folder).phase == "Running"
        with pytest.raises(run_lock.FolderInUse, match=f"another `finetune run` "
                                                       f"\\(pid {os.getpid()} since "):
            run_lock.hold(folder)
    finally:
        os.close(lock)
    view = view_of_output("j", folder)
    assert (view.phase, view.finished, view.progress.step) == ("Stopped", True, 3)
    assert "resumes from the newest checkpoint" in view.message
    os.close(run_lock.hold(folder))  # free again: the next run takes it


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


@pytest.mark.process
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_status_watch_in_a_terminal_follows_a_real_run_to_succeeded(tiny_model_dir, tmp_path):
    # 90 steps of a tiny model take a few seconds: long enough for several redraws on a
    # loaded machine (30 showed only two: 17 and 30)
    job = manifest(tiny_model_dir, Path("out"), steps=90, checkpoint_every=1000)
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
        deadline = time.monotonic() + waits.seconds_left()
        while (time.monotonic() < deadline and "EXIT=" not in screen
               and run.poll() in (None, 0)):
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                    capture_output=True, text=True).stdout
            steps |= {int(s) for s in re.findall(r"\] (\d+)/90", screen)}
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        output = run.communicate(timeout=waits.seconds_left())[0]
    assert run.returncode == 0, output[-3000:]
    assert "EXIT=0" in screen, screen
    assert len(steps) >= 3 and max(steps) == 90, f"the bar showed steps {sorted(steps)}"
    final = [line for line in screen.splitlines() if line.strip()]
    assert final[0].startswith(f"{job['metadata']['name']}  Succeeded"), screen
    assert screen.count("Succeeded") == 1, "redrawn in place, not scrolled"
    logs = subprocess.run([*FINETUNE, "logs", str(path)], capture_output=True, text=True)
    assert logs.returncode == 0 and "step 90/90" in logs.stdout


@pytest.mark.process
def test_a_second_run_on_the_folder_is_refused_and_a_killed_one_reads_stopped(
        tiny_model_dir, tmp_path):
    """Two `finetune run`s of one manifest: the second is refused before it touches the
    folder, naming the first. Then the first is killed with SIGKILL, torchrun and workers
    too (nothing can mark progress.json): `finetune status` says Stopped, not Running, and
    the same command resumes from its checkpoint."""
    job = manifest(tiny_model_dir, Path("out"), steps=400, checkpoint_every=2)
    job["spec"]["output"]["uri"] = "./out"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    first = subprocess.Popen([*FINETUNE, "run", str(path)], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    progress = tmp_path / "out" / "progress.json"
    deadline = time.monotonic() + waits.seconds_left()
    while first.poll() is None and time.monotonic() < deadline and not (
            progress.is_file() and list((tmp_path / "out" / "checkpoints").glob("step-*"))):
        time.sleep(0.2)
    try:
        second = subprocess.run([*FINETUNE, "run", str(path)], cwd=tmp_path,
                                capture_output=True, text=True, timeout=waits.seconds_left())
        assert second.returncode == 2, second.stdout + second.stderr
        assert (f"spec.output.uri: {tmp_path / 'out'} is being written by another `finetune "
                f"run` (pid {first.pid} since ") in second.stderr
        assert "starting" not in second.stdout  # refused before any process started
        torchrun = subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True,
                                  text=True).stdout.split()
        for pid in torchrun:  # its own session: the workers go with it
            os.killpg(int(pid), signal.SIGKILL)
    finally:
        first.kill()
        first.communicate(timeout=60)
    deadline = time.monotonic() + waits.seconds_left()  # the workers notice their session's end
    while (status := subprocess.run([*FINETUNE, "status", str(path)], capture_output=True,
                                    text=True)).stdout.split()[1:2] != ["Stopped"]:
        assert time.monotonic() < deadline, status.stdout
        time.sleep(0.5)
    assert json.loads(progress.read_text())["phase"] == "Running"  # as the kill left it
    assert "no `finetune run` is writing here" in status.stdout
    assert status.returncode == 1  # #51, item 3: a script's check sees the run did not end
    newest = max(int(p.name.removeprefix("step-")) for p in
                 (tmp_path / "out" / "checkpoints").glob("step-????????"))
    job["spec"]["hyperparameters"]["maxSteps"] = newest + 2  # resumed, then soon done
    path.write_text(yaml.safe_dump(job))
    again = subprocess.run([*FINETUNE, "run", str(path)], cwd=tmp_path, capture_output=True,
                           text=True, timeout=waits.seconds_left())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"step-{newest:08d} (step {newest}/{newest + 2})" in again.stdout


@pytest.mark.asyncio
async def test_status_and_logs_with_a_kubeconfig_against_the_real_api_server(
        control_plane_testbed):
    testbed = control_plane_testbed
    kubeconfig = str(testbed.installation.plane.admin_kubeconfig)
    cluster = ["-n", testbed.namespace, "--kubeconfig", kubeconfig]

    def finetune(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*FINETUNE, *args], capture_output=True, text=True,
                              timeout=waits.seconds_left())

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
    # the manifest that was applied names the job as well, as `kubectl get -f` does; its
    # own namespace where no -n is given
    applied = Path(testbed.installation.plane.folder) / "demo.yaml"
    applied.write_text(yaml.safe_dump(testbed.manifest()))
    by_file = await asyncio.to_thread(finetune, "status", str(applied), "--kubeconfig",
                                      kubeconfig)
    assert by_file.returncode == 0 and by_file.stdout.startswith("demo  Running"), \
        by_file.stderr
    as_json = await asyncio.to_thread(finetune, "status", "demo", "-o", "json", *cluster)
    look = json.loads(as_json.stdout)
    assert (look["phase"], look["progress"]["step"], look["progress"]["totalSteps"]) == (
        "Running", 40, 100), as_json.stdout
    assert {"type": "Running", "status": "True", "reason": "WorkersRunning"}.items() <= next(
        c for c in look["conditions"] if c["type"] == "Running").items()
    assert any(e["reason"] == "Running" for e in look["events"])

    # KWOK's pods have no kubelet to serve a log: the command finds rank 0's pod and says
    # what the API server answered
    logs = await asyncio.to_thread(finetune, "logs", "demo", *cluster)
    assert logs.returncode == 1 and "read the log of pod demo-0" in logs.stderr, logs.stderr
    assert "could not get it from the node's kubelet" in logs.stderr
    missing = await asyncio.to_thread(finetune, "logs", "demo", "--rank", "5", *cluster)
    assert "has no pod of node rank 5 (phase Running; its node ranks are 0 to 1: " \
           "spec.resources.nodes)" in missing.stderr, missing.stderr
    # a token the API server refuses: what to do, as the operator says it
    wrong = json.loads(Path(kubeconfig).read_text())
    wrong["users"][0]["user"] = {"token": "expired"}
    stale = Path(testbed.installation.plane.folder) / "stale.kubeconfig"
    stale.write_text(json.dumps(wrong))
    refused = await asyncio.to_thread(finetune, "status", "demo", "-n", testbed.namespace,
                                      "--kubeconfig", str(stale))
    assert refused.returncode == 1 and "401 Unauthorized — the token is expired or wrong" \
        in refused.stderr and "kubectl create token" in refused.stderr, refused.stderr

    watch = await asyncio.create_subprocess_exec(
        *FINETUNE, "status", "demo", "--watch", "--interval", "0.3", *cluster,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    await testbed.finish("demo")
    out, err = await asyncio.wait_for(watch.communicate(), timeout=waits.seconds_left())
    assert watch.returncode == 0, err.decode()
    blocks = out.decode().split("demo  ")
    assert blocks[-1].startswith("Succeeded"), out.decode()[-2000:]
    absent = await asyncio.to_thread(finetune, "status", "nope", *cluster)
    assert absent.returncode == 1 and "no FineTuneJob or FineTuneSweep nope" in absent.stderr
    assert "`kubectl get ftj,ftsweep -n " in absent.stderr  # in no namespace at all
    # asked in another namespace (as with no -n, the kubeconfig's): said where it is
    for command in ("status", "logs"):
        elsewhere = await asyncio.to_thread(finetune, command, "demo", "-n", "default",
                                            "--kubeconfig", kubeconfig)
        assert elsewhere.returncode == 1 and elsewhere.stderr.rstrip().endswith(
            f"demo in namespace default — it is in namespace {testbed.namespace}: add -n "
            f"{testbed.namespace}"), elsewhere.stderr


class NamesAcrossNamespaces:
    """A cluster's answer to a list of one name across all namespaces, or its refusal."""

    def __init__(self, answer: dict[str, list[str]] | KubeError):
        self.answer = answer

    async def list(self, kind: str, namespace: str | None = None, *,
                   fields: str | None = None) -> list[dict]:
        assert namespace is None and fields == "metadata.name=demo"
        if isinstance(self.answer, KubeError):
            raise self.answer
        return [{"metadata": {"name": "demo", "namespace": ns}}
                for ns in self.answer.get(kind, [])]


def test_a_name_in_other_namespaces_is_said_where_unless_listing_them_is_refused():
    """A user whose role is one namespace's may not list across them (403): the line stays
    as it was, without a word about the refusal."""
    def said(answer, kinds=("FineTuneJob", "FineTuneSweep")) -> str:
        return elsewhere(asyncio.run(namespaces_holding(
            NamesAcrossNamespaces(answer), kinds, "demo", "default")))

    assert said({"FineTuneJob": ["ml-team"]}) == " — it is in namespace ml-team: add -n ml-team"
    assert said({"FineTuneJob": ["b"], "FineTuneSweep": ["a", "default"]}) == (
        " — it is in namespaces a, b: add -n and one of them")
    assert said({"FineTuneSweep": ["a"]}, kinds=("FineTuneJob",)) == ""
    assert said({}) == ""
    assert said(KubeError("list finetunejobs", 403, "Forbidden")) == ""
    with pytest.raises(KubeError):
        said(KubeError("list finetunejobs", 500, "Internal Server Error"))


@pytest.mark.process
@pytest.mark.parametrize("command", ["status", "logs"])
def test_a_job_name_without_a_cluster_points_at_the_local_way_too(tmp_path, command):
    """Someone who just used `finetune run` types the job's name: no kubeconfig works, and
    the line says how to name a local run as well."""
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    result = subprocess.run([*FINETUNE, command, "tiny-cpu-lora"], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=waits.seconds_left())
    assert result.returncode == 1
    assert "set KUBECONFIG to a kubeconfig that works with kubectl" in result.stderr
    assert result.stderr.rstrip().endswith(
        f"or, for a `finetune run` on this machine, name its manifest or output folder "
        f"(`finetune {command} job.yaml`)")


def test_a_path_that_names_no_run_is_said_so_and_no_cluster_is_asked(tmp_path):
    """A typo in a folder or manifest name, or a manifest that does not parse: the line
    said the kubeconfig's problem instead. A bare name is still a FineTuneJob's."""
    with pytest.raises(NotARun, match="no such file or folder"):
        output_folder(str(tmp_path / "nothere"))
    with pytest.raises(NotARun, match="no such file or folder"):
        output_folder("job.yaml")
    (tmp_path / "typo.yaml").write_text("kind: FineTuneJob\nspec: {modle: {}}\n")
    with pytest.raises(NotARun, match=r"not a valid FineTuneJob manifest — `finetune validate"):
        output_folder(str(tmp_path / "typo.yaml"))
    job = manifest(tmp_path / "model", Path("out"))
    job["spec"]["output"]["uri"] = "out"  # neither ./out nor a scheme: it raised UriError
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump(job))
    with pytest.raises(NotARun, match=r"not a valid FineTuneJob manifest — `finetune validate"):
        output_folder(str(tmp_path / "bare.yaml"))
    assert output_folder("llama-8b-full") is None
    model = tmp_path / "model"  # a folder with things in it, none a run's: --watch waited
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(NotARun, match="not a `finetune run` output folder"):
        view_of_output("model", model)


def test_a_cluster_jobs_manifest_names_the_cluster_command_not_a_local_folder():
    """Example 02's `finetune status`: its pvc:// output was read as a local path
    (`where: .../examples/pvc:/checkpoints/...`, Pending for ever). Its folder is on a cluster:
    said so, with the command that asks it."""
    with pytest.raises(OnItsCluster, match=(
            r"FineTuneJob ml-team/llama-8b-full writes pvc://checkpoints/llama-8b-full, which "
            r"is not on this machine — add `-n ml-team` to ask its cluster")):
        output_folder(str(REPO / "examples/02-aks-fsdp-full-8b.yaml"))


@pytest.mark.process
def test_a_sweeps_manifest_is_said_to_run_on_a_cluster_not_to_be_invalid(tmp_path):
    """`finetune status sweep.yaml` said `not a valid FineTuneJob manifest` of a sweep
    `finetune validate` passes; `logs` said the same."""
    sweep = str(REPO / "examples/07-sweep-lora-lr.yaml")
    meta = yaml.safe_load(Path(sweep).read_text())["metadata"]
    for command in ("status", "logs"):
        result = subprocess.run([*FINETUNE, command, sweep], capture_output=True, text=True,
                                timeout=waits.seconds_left())
        assert result.returncode == 1, result.stderr
        assert f"FineTuneSweep {meta['namespace']}/{meta['name']} runs on a cluster only " \
               f"(`finetune run` takes a FineTuneJob) — add `-n {meta['namespace']}` to ask " \
               "its cluster" in result.stderr, result.stderr
        assert "not a valid" not in result.stderr
    # with its cluster named: a sweep's status is asked of it, and it has no log of its own
    logs = subprocess.run([*FINETUNE, "logs", sweep, "-n", meta["namespace"]],
                          capture_output=True, text=True, timeout=waits.seconds_left())
    assert logs.returncode == 1 and logs.stderr == (
        f"finetune logs: {sweep} is a FineTuneSweep, whose trials are FineTuneJobs with logs "
        f"of their own — `finetune status {meta['name']} -n {meta['namespace']}` lists them\n")


@pytest.mark.process
def test_a_local_runs_folder_or_manifest_is_read_here_whatever_cluster_is_named(tmp_path):
    """A NAME with a `/` or a manifest's suffix is this machine's, as the guide says: with
    `-n` or `--kubeconfig` it was asked of a cluster (`no usable Kubernetes credentials`),
    though named by path. Read here, said that those flags were not used; `--rank` past the
    one node of a `finetune run` is refused, not ignored."""
    job = manifest(tmp_path / "model", Path("out"))
    job["spec"]["output"]["uri"] = "./out"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    folder = tmp_path / "out"
    (folder / LOCAL_CONFIG).parent.mkdir(parents=True)
    name = job["metadata"]["name"]
    (folder / LOCAL_CONFIG).write_text(yaml.safe_dump({"job": {"name": name}}))
    (folder / "progress.json").write_text(json.dumps(ProgressRecord(
        step=3, totalSteps=6, loss=1.5, phase="Succeeded").as_json()))
    (folder / "logs").mkdir()
    (folder / "logs/run.log").write_text("step 3/6 | loss 1.5\n")
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}

    def finetune(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*FINETUNE, *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=waits.seconds_left())

    for named in ("job.yaml", "out/", str(folder)):
        shown = finetune("status", named, "-n", "other")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"{name}  Succeeded"), shown.stdout
        assert shown.stderr == (f"finetune status: {named} is a `finetune run` on this machine: "
                                "read here, -n not used\n")
    logs = finetune("logs", "job.yaml", "--kubeconfig", str(tmp_path / "none"))
    assert logs.returncode == 0 and logs.stdout == "step 3/6 | loss 1.5\n", logs.stderr
    assert "--kubeconfig not used" in logs.stderr
    ranked = finetune("logs", "job.yaml", "--rank", "5")
    assert ranked.returncode == 2 and ranked.stdout == ""
    assert "Invalid value for --rank: 5: a `finetune run` is one node, rank 0" in \
        ranked.stderr, ranked.stderr
    # a bare name with -n is the cluster's, even where a folder of that name is here
    asked = finetune("status", "out", "-n", "other")
    assert asked.returncode == 1 and "no usable Kubernetes credentials" in asked.stderr, \
        asked.stderr
