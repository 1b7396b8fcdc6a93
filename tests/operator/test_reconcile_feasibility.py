"""Admission by the planner's verdict: the reconciler stays pure, the verdict is handed in."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from types import SimpleNamespace

from finetune_operator.api import FineTuneJobStatus
from finetune_operator.controller.reconcilers import feasibility
from finetune_operator.planner import ModelConfigs
from finetune_operator.reconcile import Feasibility, Observation, condition, reconcile
from finetune_operator.validation import parse_job
from tests.conftest import minimal_job

T0 = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
TOO_BIG = Feasibility(False, "needs 1315.2 GiB per GPU with ddp on 1 GPU, more than "
                             "Standard_NC24ads_A100_v4 (A100-80GB-PCIe, 80.0 GiB): weights ...")


def job(status=None, **spec):
    parsed = parse_job(minimal_job(**spec))
    parsed.status = status
    return parsed


def test_a_job_that_does_not_fit_is_not_launched_and_says_why():
    d = reconcile(job(), Observation(), T0, feasibility=TOO_BIG)
    assert [a.kind for a in d.actions] == []
    feasible = condition(d.status, "Feasible")
    assert feasible.status == "False" and feasible.reason == "DoesNotFit"
    assert "1315.2 GiB" in feasible.message and "skipFeasibilityCheck" in feasible.message
    assert d.status.phase == "Pending" and "Feasible" in d.status.message
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "Infeasible")]
    again = reconcile(job(d.status), Observation(), T0, feasibility=TOO_BIG)
    assert again.events == [] and again.actions == []  # no event storm on every look


def test_a_job_that_fits_launches_with_feasible_true():
    d = reconcile(job(), Observation(), T0, feasibility=Feasibility(True, "31.4 GiB of 80.0"))
    assert [a.kind for a in d.actions] == ["launch"]
    assert condition(d.status, "Feasible").status == "True"


def test_an_unknown_verdict_launches_with_feasible_unknown():
    d = reconcile(job(), Observation(), T0, feasibility=Feasibility(None, "no config.json"))
    assert [a.kind for a in d.actions] == ["launch"]
    assert condition(d.status, "Feasible").status == "Unknown"


def test_the_opt_out_launches_and_keeps_the_verdict_visible():
    d = reconcile(job(resources={"skipFeasibilityCheck": True}), Observation(), T0,
                  feasibility=TOO_BIG)
    assert [a.kind for a in d.actions] == ["launch"]
    feasible = condition(d.status, "Feasible")
    assert feasible.status == "False" and feasible.reason == "CheckSkipped"


def test_fixing_the_spec_launches_it():
    refused = reconcile(job(), Observation(), T0, feasibility=TOO_BIG).status
    d = reconcile(job(refused), Observation(), T0, feasibility=Feasibility(True, "fits now"))
    assert [a.kind for a in d.actions] == ["launch"]
    assert condition(d.status, "Feasible").status == "True"


def test_after_launch_the_verdict_is_not_consulted():
    status = FineTuneJobStatus(phase="Running", launched_spec={"model": "x"}, launch_time=T0,
                               start_time=T0)
    d = reconcile(job(status), Observation(exists=True, running=True), T0,
                  feasibility=TOO_BIG)
    assert condition(d.status, "Feasible") is None


def _plan(**spec):
    runtime = SimpleNamespace(model_configs=ModelConfigs())  # offline: the built-in table
    return asyncio.run(feasibility(runtime, job(**spec), []))


def test_the_controller_plans_from_the_table_before_launch():
    impossible = _plan(model={"uri": "hf://meta-llama/Llama-3.1-70B"}, method={"type": "full"},
                       strategy={"type": "ddp"},
                       resources={"gpusPerNode": 1, "gpuType": "A100-80GB"})
    assert impossible.fits is False and "weights" in impossible.message
    fine = _plan(model={"uri": "hf://Qwen/Qwen2.5-0.5B"},
                 resources={"gpusPerNode": 1, "gpuType": "A100-80GB"})
    assert fine.fits is True
    assert _plan(model={"uri": "pvc://models/mine"}).fits is None
    runtime = SimpleNamespace(model_configs=ModelConfigs())
    launched = job(FineTuneJobStatus(launched_spec={"model": "x"}))
    assert asyncio.run(feasibility(runtime, launched, [])) is None
    assert asyncio.run(feasibility(runtime, job(), ["spec.x: bad — fix"])) is None


def test_a_model_path_the_operator_cannot_read_is_said_to_be_the_trainer_images():
    """The path is inside the trainer image: `here`, the operator's pod, told the user
    nothing; a job of CPU workers has no GPU memory to check, whatever its config."""
    on_gpus = _plan(model={"uri": "/opt/finetune-demo/tiny-llama"},
                    resources={"gpusPerNode": 1, "gpuType": "H100"})
    assert on_gpus.fits is None
    assert on_gpus.message == (
        "no config.json for /opt/finetune-demo/tiny-llama: the operator cannot read it (a "
        "path inside the trainer image, not the operator's pod); run `finetune plan` where "
        "the model is, or use a model the built-in table knows")
    on_cpus = _plan(model={"uri": "/opt/finetune-demo/tiny-llama"}, method={"type": "lora"},
                    resources={"gpusPerNode": 0}, strategy={"type": "ddp", "precision": "fp32"})
    assert on_cpus.fits is None
    assert on_cpus.message == "CPU workers: the planner checks GPU memory only"
    known = _plan(model={"uri": "hf://Qwen/Qwen2.5-0.5B"}, method={"type": "lora"},
                  resources={"gpusPerNode": 0}, strategy={"type": "ddp", "precision": "fp32"})
    assert known.fits is None and known.message.startswith("CPU workers: about ")


def test_the_verdict_is_about_the_passes_the_workers_run():
    """64 sequences of 4096 tokens a step do not fit one 80 GB GPU in one pass, even
    recomputing every layer; in the smaller passes the planner records for the workers
    they do, so the job launches (and the record says how it runs)."""
    spec = dict(model={"uri": "hf://meta-llama/Llama-3.1-8B"},
                dataset={"uri": "pvc://data/train.jsonl", "maxSeqLength": 4096},
                resources={"gpusPerNode": 1, "gpuType": "H100"}, strategy={"type": "ddp"})
    sized = _plan(**spec, hyperparameters={"maxSteps": 10, "batchSizePerDevice": 64})
    assert sized.fits is True
    assert sized.plan.micro_batch_size is not None and sized.plan.micro_batch_size < 64
    assert 64 % sized.plan.micro_batch_size == 0
    whole = _plan(**spec, hyperparameters={"maxSteps": 10, "batchSizePerDevice": 64,
                                           "microBatchSize": 64})
    assert whole.fits is False and whole.plan.micro_batch_size == 64
