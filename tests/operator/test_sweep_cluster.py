"""A FineTuneSweep on the real control plane: the operator makes the trials as FineTuneJobs,
follows their progress (rank 0's /progress, served per pod as the trainer serves it),
stops the ones median stopping rejects, names the best, and survives a SIGKILL mid-sweep
without making any trial twice."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from typing import Any

import pytest

from finetune_operator.sweep import check_sweep
from finetune_trainer.progress import ProgressServer
from finetune_trainer.record import ProgressRecord
from tests.support import waits
from tests.support.cluster_testbed import ControlPlaneTestbed

SWEEPS = "finetune.dev/v1alpha1/finetunesweeps"


def eval_loss(lr: float, step: int) -> float:
    """A made-up objective: best at lr = 1e-4, and better with more steps."""
    return 1.0 + abs(math.log10(lr) + 4) + (0.5 if step < 40 else 0.0)


class Trials:
    """Plays each trial's workers: rank 0 reports step 20, then step 40, then the pods end."""

    def __init__(self, bed: ControlPlaneTestbed):
        self.bed = bed
        self.stage: dict[str, int] = {}
        self.servers: dict[str, ProgressServer] = {}

    def _serve(self, name: str, lr: float, step: int) -> None:
        self.servers[name].publish(ProgressRecord(
            step=step, totalSteps=40, epoch=step / 40, loss=2.0, learningRate=lr,
            tokensPerSecond=1000.0, evalLoss=eval_loss(lr, step)))

    def _progress_step(self, name: str) -> int | None:
        return (self.bed.status(name).get("progress") or {}).get("step")

    def end(self, name: str) -> None:
        """The trial ended: its pod's IP may be given to the next pod (KWOK reuses them)."""
        if name in self.servers:
            self.servers.pop(name).close()

    async def play(self, trial: dict[str, Any]) -> None:
        name, lr = trial["name"], trial["params"]["hyperparameters.learningRate"]
        stage = self.stage.get(name, 0)
        if stage == 0:
            pods = self.bed.running_pods(name)
            ip = pods[0]["status"].get("podIP") if pods else None
            if ip:
                self.servers[name] = ProgressServer(self.bed.progress_port, host=ip)
                self._serve(name, lr, 20)
                self.stage[name] = 1
        elif stage == 1 and self._progress_step(name) == 20:
            self._serve(name, lr, 40)
            self.stage[name] = 2
        elif stage == 2 and self._progress_step(name) == 40:
            await self.bed.finish(name)
            self.stage[name] = 3


@pytest.mark.asyncio
async def test_a_random_sweep_stops_a_trial_early_names_the_best_and_survives_a_restart(
        control_plane_testbed):
    bed: ControlPlaneTestbed = control_plane_testbed
    template = bed.manifest("template", resources={"nodes": 1, "gpusPerNode": 1},
                            dataset={"uri": "pvc://data/train.jsonl",
                                     "evalFraction": 0.1})["spec"]
    sweep = {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneSweep",
             "metadata": {"name": "lr", "namespace": bed.namespace},
             "spec": {"template": template, "sampling": "random", "seed": 11,
                      "maxTrials": 6, "parallelTrials": 3,
                      "searchSpace": {"hyperparameters.learningRate": {
                          "type": "logUniform", "min": 1e-6, "max": 1e-2}},
                      "earlyTermination": {"policy": "median", "delaySteps": 20}}}
    await bed.apply(sweep)
    trials, restarted = Trials(bed), False
    started = asyncio.get_running_loop().time()
    deadline = started + waits.seconds_left()
    try:
        while True:
            status = (bed.get(SWEEPS, "lr") or {}).get("status") or {}
            if status.get("phase") in ("Succeeded", "Failed"):
                break
            assert asyncio.get_running_loop().time() < deadline, json.dumps(status)[-3000:]
            for trial in status.get("trials", []):
                if trial["phase"] not in ("Succeeded", "Failed", "Stopped"):
                    await trials.play(trial)
                else:
                    trials.end(trial["name"])
            if not restarted and status.get("trialCount", 0) >= 3:  # mid-sweep, trials running
                await bed.kill_operator()
                await bed.start_operator()
                restarted = True
            await asyncio.sleep(0.5)
    finally:
        for name in list(trials.servers):
            trials.end(name)
    print(f"sweep of 6 trials took {asyncio.get_running_loop().time() - started:.0f} s")
    assert status["phase"] == "Succeeded", status.get("message")
    names = [t["name"] for t in status["trials"]]
    assert names == [f"lr-{n}" for n in range(6)] and status["trialCount"] == 6
    # each trial's FineTuneJob was created once, across the restart; none beyond maxTrials
    assert [bed.created("finetunejobs", n) for n in names] == [1] * 6
    assert bed.create_attempts("finetunejobs", "lr-6") == 0
    stopped = [t for t in status["trials"] if t["phase"] == "Stopped"]
    assert stopped and all("median stopping at step" in t["message"] for t in stopped)
    for trial in stopped:  # stopped trials' FineTuneJobs are deleted
        await bed.until(lambda t=trial: bed.ftj(t["name"]) is None, f"{trial['name']} deleted")
    done = [t for t in status["trials"] if t["phase"] == "Succeeded"]
    best = min(done, key=lambda t: t["objective"])
    assert status["best"]["name"] == best["name"]
    assert status["best"]["output"] == f"{template['output']['uri']}/{best['name']}"
    best_loss = eval_loss(best["params"]["hyperparameters.learningRate"], 40)
    assert status["best"]["objective"] == float(f"{best_loss:.4g}")  # as kubectl shows it
    assert all(t["curve"][-1]["step"] == 40 for t in done)
    shown = bed.installation.kubectl("get", "ftsweep", "lr", "-n", bed.namespace).stdout
    assert "Succeeded" in shown and best["name"] in shown.split()
    assert "SweepSucceeded" in bed.event_reasons()
    # finetune status, logged in with a kubeconfig as a user is: the trials and the best
    told = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "status", "lr", "-n",
                           bed.namespace, "--kubeconfig",
                           str(bed.installation.plane.admin_kubeconfig)],
                          capture_output=True, text=True, timeout=waits.seconds_left())
    assert told.returncode == 0, told.stderr
    lines = told.stdout.splitlines()
    assert lines[0].startswith("lr  Succeeded") and lines[1] == "  trials: 6 of 6, 0 running"
    assert [line.split()[:2] for line in lines[2:8]] == [[t["name"], t["phase"]]
                                                         for t in status["trials"]]
    assert f"  best: {best['name']} evalLoss {best['objective']:.4f} " in told.stdout


@pytest.mark.asyncio
async def test_a_sweep_the_api_server_refuses_names_the_field(control_plane_testbed):
    bed: ControlPlaneTestbed = control_plane_testbed
    template = bed.manifest("template")["spec"]
    template["resources"]["nodes"] = 0
    sweep = {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneSweep",
             "metadata": {"name": "bad", "namespace": bed.namespace},
             "spec": {"template": template, "searchSpace": {"hyperparameters.learningRate": {
                 "type": "choice", "values": [1e-4]}}, "objective": {"metric": "loss"}}}
    result = bed.installation.kubectl("apply", "-f", "-", input=json.dumps(sweep), check=False)
    assert result.returncode != 0
    assert "spec.template.resources.nodes" in result.stderr
    # a value of the wrong type in the template: refused by the schema, and by validate
    # (which parsed the sweep and took "10" for 10)
    template["resources"]["nodes"] = 1
    template["hyperparameters"]["maxSteps"] = "10"
    result = bed.installation.kubectl("apply", "-f", "-", input=json.dumps(sweep), check=False)
    assert result.returncode != 0
    assert "spec.template.hyperparameters.maxSteps: Invalid value: \"string\"" in result.stderr
    assert [p.path for p in check_sweep(sweep)[1] if p.severity == "error"] == [
        "spec.template.hyperparameters.maxSteps"]


@pytest.mark.asyncio
async def test_an_edit_starts_a_sweep_refused_as_invalid_and_is_said_to_change_an_ended_one_not(
        control_plane_testbed):
    """The helper's walkthrough: a sweep the operator refused (a searched value no trial
    may have, which the CRD cannot see) kept its refusal after the edit that fixed it, and
    an edit of an ended sweep was ignored without a word."""
    bed: ControlPlaneTestbed = control_plane_testbed
    template = bed.manifest("template", resources={"nodes": 1, "gpusPerNode": 1})["spec"]
    sweep = {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneSweep",
             "metadata": {"name": "fixed", "namespace": bed.namespace},
             "spec": {"template": template, "maxTrials": 1, "objective": {"metric": "loss"},
                      "searchSpace": {"method.lora.r": {"type": "choice", "values": [8, 0]}}}}
    await bed.apply(sweep)

    def status() -> dict[str, Any]:
        return (bed.get(SWEEPS, "fixed") or {}).get("status") or {}

    await bed.until(lambda: status().get("phase") == "Failed", "refused")
    assert "the value 0 makes spec.template.method.lora.r invalid" in status()["message"]
    kubectl = bed.installation.kubectl
    edit = {"spec": {"searchSpace": {"method.lora.r": {"values": [8]}}}}
    kubectl("patch", "ftsweep", "fixed", "-n", bed.namespace, "--type=merge", "-p",
            json.dumps(edit))
    await bed.until(lambda: status().get("trialCount") == 1, "the trial made after the edit")
    await bed.until(lambda: bed.running_pods("fixed-0"), "the trial's workers")
    await bed.finish("fixed-0")  # no loss reported: the sweep ends Failed, with its trial
    await bed.until(lambda: status().get("phase") == "Failed" and status().get("trials"),
                    "ended")
    kubectl("patch", "ftsweep", "fixed", "-n", bed.namespace, "--type=merge", "-p",
            json.dumps({"spec": {"maxTrials": 2}}))

    def said() -> list[str]:
        listed = json.loads(kubectl("get", "events", "-n", bed.namespace, "-o", "json").stdout)
        return [e["message"] for e in listed["items"] if e.get("reason") == "SpecChangeIgnored"
                and e["involvedObject"]["name"] == "fixed"]

    await bed.until(said, "the edit of an ended sweep said to change nothing")
    assert said()[0].startswith("the sweep has ended (Failed): a change of its spec starts "
                                "nothing"), said()
    assert status()["trialCount"] == 1
