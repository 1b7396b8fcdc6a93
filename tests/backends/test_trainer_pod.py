"""The kubernetes backend's worker pod, run on this machine: its init containers and its
trainer container's own command, args and environment (the volumes as local folders), with
a tiny model on CPU. What the pod ends with is what the Job's pod failure policy and the
operator read, so both are asked here about the real exit code and termination message.
(KWOK's pods, in the control-plane tests, only play them.)"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator import naming
from finetune_operator.backends.kubernetes import states, workers
from finetune_operator.reasons import FailedReason
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import parse_job
from finetune_trainer import exits
from tests.support import waits

pytestmark = pytest.mark.process

SETTINGS = OperatorSettings()


def job(model: Path, data: Path, **hyperparameters: Any) -> dict[str, Any]:
    """One node of two CPU workers: the kind end-to-end job's shape, the model and data
    in the image (here: on this machine)."""
    return {
        "apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneJob",
        "metadata": {"name": "pod-here", "namespace": "ml", "uid": "0f3c-pod-here"},
        "spec": {
            "model": {"uri": str(model)},
            "dataset": {"uri": str(data), "format": "chat", "maxSeqLength": 128},
            "method": {"type": "lora", "lora": {"r": 4, "alpha": 8}},
            "strategy": {"type": "ddp", "precision": "fp32", "gradientCheckpointing": False},
            "hyperparameters": {"batchSizePerDevice": 2, "learningRate": 1.0e-3,
                                "logEverySteps": 1, **hyperparameters},
            "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2,
                          "cpu": 1, "memory": "2Gi"},
            "output": {"uri": "pvc://checkpoints/pod-here", "checkpointEverySteps": 1000},
        },
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PodHere:
    """The rendered pod's containers as processes here: each volume mount a folder under
    `where`, the ConfigMap's files in its mount, the env as the kubelet sets it (field
    references: node rank 0; rank 0's Service name: this machine), `$(VAR)` in the
    command and args expanded as the kubelet does, `python` this interpreter."""

    def __init__(self, doc: dict[str, Any], where: Path):
        objects = {o["kind"]: o for o in workers.render(parse_job(doc), SETTINGS)}
        self.pod = objects["Job"]["spec"]["template"]["spec"]
        self.policy = objects["Job"]["spec"]["podFailurePolicy"]["rules"]
        trainer = self.pod["containers"][0]
        # /dev/shm and /tmp as this machine has them (the tests' own files are under /tmp)
        self.folders = {m["mountPath"]: where / m["name"] for m in trainer["volumeMounts"]
                        if m["mountPath"] not in ("/dev/shm", "/tmp")}
        for folder in self.folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        config_mount = next(m["mountPath"] for m in trainer["volumeMounts"]
                            if m["name"] == "trainer-config")
        for key, text in objects["ConfigMap"]["data"].items():
            (self.folders[config_mount] / key).write_text(self.here(text))
        config = yaml.safe_load(objects["ConfigMap"]["data"][naming.TRAINER_CONFIG_KEY])
        self.output = Path(self.here(config["output"]["uri"]))
        self.log = where / "trainer.log"
        self.termination_log = where / "termination-log"
        """The container's terminationMessagePath, a file here as the kubelet makes it."""
        self.started: list[subprocess.Popen] = []

    def here(self, text: str) -> str:
        for mount, folder in self.folders.items():
            text = text.replace(mount, str(folder))
        return text

    def command(self, container: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        env = {**os.environ, "PET_NODE_RANK": "0", "NODE_NAME": "node-0"}
        for variable in container["env"]:
            if "value" in variable:
                env[variable["name"]] = self.here(variable["value"])
        self.termination_log.write_text("")  # each container gets its own, empty
        if env.get(exits.TERMINATION_LOG_ENV) == container["terminationMessagePath"]:
            env[exits.TERMINATION_LOG_ENV] = str(self.termination_log)
        if "PET_MASTER_ADDR" in env:
            env.update(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(free_port()))
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], part)
                for part in [*container["command"], *container.get("args", [])]]
        return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]], env

    def init_containers(self) -> None:
        for container in self.pod.get("initContainers", []):
            argv, env = self.command(container)
            done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=waits.seconds_left())
            assert done.returncode == 0, (container["name"], done.stderr[-3000:])

    def start_trainer(self) -> subprocess.Popen:
        argv, env = self.command(self.pod["containers"][0])
        with self.log.open("w") as log:
            self.started.append(subprocess.Popen(argv, env=env, stdout=log,
                                                 stderr=subprocess.STDOUT,
                                                 start_new_session=True))
        return self.started[-1]

    def close(self) -> None:
        """Whatever still runs (a failed test): the launcher's whole session."""
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=60)

    def terminated(self, code: int) -> dict[str, Any]:
        """Rank 0's pod as the kubelet reports it once the trainer ended with `code`: its
        termination message is what the container wrote to its terminationMessagePath, or
        on an error with nothing written (FallbackToLogsOnError) its log's last lines."""
        message = self.termination_log.read_text()
        if not message and code:
            message = "\n".join(self.log.read_text().splitlines()[-80:])[-2048:]
        return {"metadata": {"name": "pod-here-0-x",
                             "annotations": {workers.COMPLETION_INDEX_KEY: "0"}},
                "status": {"phase": "Failed" if code else "Succeeded", "containerStatuses": [{
                    "name": workers.TRAINER_CONTAINER,
                    "state": {"terminated": {"exitCode": code,
                                             "reason": "Error" if code else "Completed",
                                             "message": message}}}]}}

    def rule_for(self, code: int) -> str:
        """The Job controller's action for the trainer container's exit code: the first
        rule whose onExitCodes matches (container named or any), else Count."""
        for rule in self.policy:
            match = rule.get("onExitCodes")
            if match and match.get("containerName") in (None, workers.TRAINER_CONTAINER) and (
                    (code in match["values"]) == (match["operator"] == "In")):
                return rule["action"]
        return "Count"


@pytest.fixture()
def pod_here(tmp_path):
    pods: list[PodHere] = []

    def make(doc: dict[str, Any]) -> PodHere:
        pods.append(PodHere(doc, tmp_path / "pod"))
        return pods[-1]

    yield make
    for pod in pods:
        pod.close()


def step_reached(output: Path) -> int:
    try:
        return json.loads((output / "progress.json").read_text()).get("step") or 0
    except (OSError, ValueError):
        return 0


def test_bad_data_ends_the_pod_once_with_the_line_that_names_it(tiny_model_dir, tmp_path,
                                                                pod_here):
    """A dataset line that is not JSON: the workers refuse it (2); torchrun alone ended with
    1 and a banner of `=` as the last line, so the gang was restarted backoffLimit times
    and the FineTuneJob's message was `exited 1 (Error): =====`."""
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n')
    pod = pod_here(job(tiny_model_dir, data, maxSteps=4))
    pod.init_containers()
    trainer = pod.start_trainer()
    code = trainer.wait(timeout=waits.seconds_left())
    said = pod.log.read_text()
    assert code == workers.BAD_INPUT_EXIT_CODE, said[-3000:]
    last = said.strip().splitlines()[-1]
    assert last.startswith(f"finetune-train: {data}:2: is not valid JSON"), said[-3000:]
    assert pod.rule_for(code) == "FailJob"
    failure = states.pod_failure(pod.terminated(code))
    assert failure.kind == "refused" and failure.reason == FailedReason.INPUT_REFUSED
    assert failure.message.startswith(f"{data}:2: is not valid JSON")


def test_a_run_that_stops_early_leaves_its_final_record_for_the_status(tiny_model_dir,
                                                                        pod_here):
    """earlyStoppingPatience in the real pod command: rank 0's final record is its
    termination message, the operator's one way to learn the stopping step's figures and
    why training ended there once the trainer (and its /progress) has gone."""
    data = Path(__file__).resolve().parents[2] / "examples/data/tiny-chat.jsonl"
    doc = job(tiny_model_dir, data, maxSteps=20, evalEverySteps=1, earlyStoppingPatience=1,
              earlyStoppingThreshold=100.0)
    doc["spec"]["dataset"]["evalFraction"] = 0.2
    pod = pod_here(doc)
    pod.init_containers()
    code = pod.start_trainer().wait(timeout=waits.seconds_left())
    assert code == 0, pod.log.read_text()[-3000:]
    rank0 = pod.terminated(code)
    progress = states.final_progress([rank0])
    assert progress is not None, rank0
    assert progress.step == 2 and progress.total_steps == 20 and progress.eval_loss > 0
    assert progress.stopped_early.startswith(
        "stopped early at step 2 of 20: 1 evaluation did not improve on the best eval loss")
    assert progress.stopped_early in pod.log.read_text()  # what the log said
    workload = {"metadata": {"name": "pod-here", "uid": "u"},
                "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    seen = states.observe(workload, [rank0], nodes=1)
    assert seen.succeeded and seen.progress == progress


def sigterm_after(pod: PodHere, trainer: subprocess.Popen, step: int) -> int:
    """SIGTERM once the run has passed `step`; the step it checkpointed and stopped after."""
    deadline = time.monotonic() + waits.seconds_left()
    while step_reached(pod.output) < step:
        assert trainer.poll() is None, pod.log.read_text()[-3000:]
        assert time.monotonic() < deadline, pod.log.read_text()[-3000:]
        time.sleep(0.2)
    trainer.send_signal(signal.SIGTERM)
    code = trainer.wait(timeout=waits.seconds_left())
    assert code == workers.STOPPED_EXIT_CODE, pod.log.read_text()[-3000:]
    stopped_at = re.search(r"stopped by SIGTERM after step (\d+)", pod.log.read_text())
    assert stopped_at, pod.log.read_text()[-3000:]
    return int(stopped_at[1])


def test_sigterm_ends_the_pod_143_and_a_job_re_created_on_fewer_workers_resumes(
        tiny_model_dir, pod_here):
    """What the kubelet does on a suspension, a Kueue preemption or a drain: SIGTERM to the
    container's first process. torchrun alone ended with 1, so the rule that keeps a
    suspended Job alive (143: Ignore) never matched a real pod, and the stop was charged
    to the restart budget as a worker failure.

    Then the spot pool shrank: the FineTuneJob is re-created with 1 worker of twice the
    accumulation (the same global batch) and the same output. Its pod's resume check
    lets it through and its workers resume from the 2 workers' checkpoint."""
    data = Path(__file__).resolve().parents[2] / "examples/data/tiny-chat.jsonl"
    two = job(tiny_model_dir, data, maxSteps=400)
    pod = pod_here(two)
    pod.init_containers()
    stopped = sigterm_after(pod, pod.start_trainer(), 2)  # ended 143
    assert (pod.output / "checkpoints" / f"step-{stopped:08d}").is_dir()
    assert pod.rule_for(workers.STOPPED_EXIT_CODE) == "Ignore"
    assert states.pod_failure(pod.terminated(workers.STOPPED_EXIT_CODE)).kind == "stopped"

    one = json.loads(json.dumps(two))
    one["spec"]["resources"]["processesPerNode"] = 1
    one["spec"]["hyperparameters"]["gradientAccumulationSteps"] = 2
    pod = pod_here(one)  # the same volumes
    pod.init_containers()  # the resume check among them
    sigterm_after(pod, trainer := pod.start_trainer(), stopped + 1)
    said = pod.log.read_text()
    assert f"step-{stopped:08d}" in said and "resuming from" in said, said[-3000:]
    assert "on 1 process" in said and trainer.returncode == workers.STOPPED_EXIT_CODE


def test_an_op_that_cannot_build_ends_the_pod_5_with_the_builds_own_line(
        tiny_model_dir, tmp_path, pod_here):
    """ZeRO on CPU workers compiles DeepSpeed's shm op on first use: in an image without a C++
    compiler (here: CXX naming none, and an empty op cache) every rank failed, exit 1, and
    the status quoted the compiler's command line (`[1/3] c++ -MMD -MF shm.o.d ...`). Now
    the trainer ends 5 (errors.setup_failure) with the build's own error line, the Job's
    policy fails it, and the operator marks it for one restart at most."""
    data = Path(__file__).resolve().parents[2] / "examples/data/tiny-chat.jsonl"
    doc = job(tiny_model_dir, data, maxSteps=4)
    doc["spec"]["strategy"]["type"] = "zero2"
    doc["spec"]["kubernetes"] = {"env": [
        {"name": "CXX", "value": "c++-missing"},
        {"name": "TORCH_EXTENSIONS_DIR", "value": str(tmp_path / "no-ops-built")}]}
    pod = pod_here(doc)
    pod.init_containers()
    code = pod.start_trainer().wait(timeout=waits.seconds_left())
    said = pod.log.read_text()
    assert code == workers.SETUP_EXIT_CODE, said[-3000:]
    last = said.strip().splitlines()[-1]
    assert last.startswith("finetune-train: op 'deepspeed_shm_comm' could not be built in "
                           "this image: /bin/sh: 1: c++-missing: not found"), said[-3000:]
    assert pod.rule_for(code) == "FailJob"
    failure = states.pod_failure(pod.terminated(code))
    assert failure.kind == "worker" and failure.setup
    assert "c++-missing: not found" in failure.message and "-MMD" not in failure.message
