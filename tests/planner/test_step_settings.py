"""Unset gradientCheckpointing and compile: decided once by the planner from its memory
estimate and the run's length, printed by `finetune plan`, handed to the workers."""

from __future__ import annotations

import pytest

from finetune_operator.api import FineTuneJob
from finetune_operator.planner import choose_step_settings
from finetune_operator.planner.render import plan_with_notes, table
from finetune_operator.trainer_config import build_trainer_config
from tests.conftest import minimal_job

LLAMA_8B = "meta-llama/Llama-3.1-8B"  # in the planner's built-in table: no hub needed
H100_X8 = "Standard_ND96isr_H100_v5"  # 80 GB
T4 = "Standard_NC4as_T4_v3"  # 16 GB


def job(method: str = "lora", *, gpu_type: str | None = H100_X8, batch: int = 1,
        seq: int = 2048, steps: int | None = 20_000, strategy: dict | None = None,
        gpus: int = 8) -> FineTuneJob:
    hyper = {"batchSizePerDevice": batch}
    hyper.update({"maxSteps": steps} if steps else {"epochs": 1})
    resources = {"gpusPerNode": gpus}
    if gpu_type:
        resources["gpuType"] = gpu_type
    manifest = minimal_job(model={"uri": f"hf://{LLAMA_8B}"}, method={"type": method},
                           dataset={"uri": "pvc://data/train.jsonl", "maxSeqLength": seq},
                           hyperparameters=hyper, resources=resources,
                           strategy={"type": "ddp", **(strategy or {})})
    return FineTuneJob.model_validate(manifest)


def settings(j: FineTuneJob, strategy: str = "ddp"):
    return choose_step_settings(j, None, strategy)


def test_checkpointing_off_when_the_activations_fit():
    chosen = settings(job(batch=1, seq=2048))
    assert chosen.gradient_checkpointing is False
    assert "gradientCheckpointing unset → off" in chosen.notes[0]
    assert "fits with 10% headroom" in chosen.notes[0]


def test_selective_then_full_as_the_activations_grow():
    levels = []
    for batch in (1, 4, 16):
        chosen = settings(job(batch=batch, seq=4096))
        levels.append("off" if not chosen.gradient_checkpointing else chosen.checkpoint_policy)
    assert levels[0] == "off"
    assert levels[-1] == "full"
    order = ["off", "selective", "full"]
    assert [order.index(level) for level in levels] == sorted(order.index(x) for x in levels)


def test_full_checkpointing_where_the_planner_cannot_tell():
    no_gpu_type = settings(job(gpu_type=None))
    assert no_gpu_type.gradient_checkpointing is True
    assert no_gpu_type.checkpoint_policy == "full"
    assert "gpuType is not set" in no_gpu_type.notes[0]
    cpu = settings(job(gpu_type=None, gpus=0))
    assert cpu.gradient_checkpointing is True and cpu.compile is False
    assert "CPU workers" in cpu.notes[0]


def test_set_fields_are_kept_and_not_explained():
    chosen = settings(job(strategy={"gradientCheckpointing": True,
                                    "gradientCheckpointingPolicy": "selective",
                                    "compile": False}))
    assert (chosen.gradient_checkpointing, chosen.checkpoint_policy, chosen.compile) == (
        True, "selective", False)
    assert chosen.notes == []


@pytest.mark.parametrize(("steps", "expected"), [(20_000, True), (20, False), (None, True)])
def test_compile_when_the_run_is_long_enough_to_pay_for_it(steps, expected):
    chosen = settings(job(steps=steps))
    assert chosen.compile is expected
    assert f"compile unset → {'on' if expected else 'off'}" in chosen.notes[-1]


@pytest.mark.parametrize(("method", "strategy", "why"), [
    ("qlora", "ddp", "4-bit layers are not compiled"),
    ("full", "zero3", "DeepSpeed's own engine")])
def test_no_compile_where_it_is_not_supported(method, strategy, why):
    chosen = settings(job(method=method), strategy)
    assert chosen.compile is False
    assert why in chosen.notes[-1]


def test_the_workers_get_the_choice_and_the_plan_prints_it():
    j = job(batch=1, seq=2048)
    config = build_trainer_config(j)
    assert config.strategy.gradient_checkpointing is False
    assert config.strategy.compile is True
    plan = plan_with_notes(j, None)
    printed = table(j, plan)
    assert "checkpointing off, compile on" in printed.splitlines()[0]
    assert "note: gradientCheckpointing unset → off" in printed


def test_a_short_t4_job_keeps_full_checkpointing_and_no_compile():
    chosen = settings(job(gpu_type=T4, gpus=1, batch=4, seq=4096, steps=50, method="qlora"))
    assert chosen.gradient_checkpointing is True and chosen.compile is False
