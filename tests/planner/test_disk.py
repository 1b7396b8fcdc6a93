"""The output volume (#17): the hub model's copy fetched once, the checkpoints kept and the
one being written, the exported model. What a run really writes is compared with this in
tests/trainer/test_training.py."""

from __future__ import annotations

import pytest

from finetune_operator.planner import plan_job
from finetune_operator.planner.disk import stored_bytes_per_param
from finetune_operator.planner.known_models import KNOWN_MODELS
from finetune_operator.planner.report import table
from finetune_operator.planner.sources import ModelConfig
from finetune_operator.validation import parse_job
from tests.conftest import minimal_job

GiB = 1024**3
LLAMA_8B = ModelConfig(config=KNOWN_MODELS["meta-llama/Llama-3.1-8B"], source="test")


def plan(uri="hf://meta-llama/Llama-3.1-8B", strategy="fsdp", method="lora",
         spec=None, **output):
    job = parse_job(minimal_job(
        model={"uri": uri}, method={"type": method},
        strategy={"type": strategy}, resources={"gpuType": "H100", "gpusPerNode": 8},
        output={"uri": "pvc://ckpt/run", **output},
        **(spec or {})))
    return job, plan_job(job, LLAMA_8B, strategy)


def test_a_hub_model_is_counted_once_as_its_files_store_it():
    _, hub = plan()
    _, claim = plan(uri="pvc://models/llama-8b")
    params = hub.total_params
    assert hub.disk_breakdown["modelCache"] == 2 * params  # bf16 files
    assert claim.disk_breakdown["modelCache"] == 0  # read where it is
    assert hub.disk_bytes - claim.disk_bytes == 2 * params


def test_lora_checkpoints_hold_the_adapters_not_the_base():
    _, lora = plan(keepLast=2)
    _, more = plan(keepLast=5)
    per_checkpoint = 12 * lora.trainable_params  # fp32 weight and two Adam moments
    assert lora.disk_breakdown["checkpoints"] == 3 * per_checkpoint  # kept + one being written
    assert more.disk_breakdown["checkpoints"] == 6 * per_checkpoint
    _, early = plan(keepLast=2, spec={
        "dataset": {"uri": "pvc://data/train.jsonl", "evalFraction": 0.1},
        "hyperparameters": {"maxSteps": 10, "evalEverySteps": 5, "earlyStoppingPatience": 2}})
    assert early.disk_breakdown["checkpoints"] == 4 * per_checkpoint  # and the best one
    assert lora.disk_breakdown["finalModel"] == 4 * lora.trainable_params


def test_a_full_fine_tune_needs_room_for_its_checkpoints_and_zero_2_adds_its_module():
    _, fsdp = plan(method="full")
    _, zero2 = plan(method="full", strategy="zero2")
    _, zero3 = plan(method="full", strategy="zero3")
    params = fsdp.total_params
    assert fsdp.disk_breakdown["checkpoints"] == 3 * 12 * params
    assert zero2.disk_breakdown["checkpoints"] == 3 * (12 + 2) * params  # the bf16 module
    assert zero3.disk_breakdown["checkpoints"] == 3 * 12 * params  # partitions only
    assert fsdp.disk_breakdown["finalModel"] == 4 * params
    assert zero3.disk_breakdown["finalModel"] == 2 * params  # DeepSpeed exports its module


def test_a_merged_adapter_adds_the_model_in_fp32():
    _, plain = plan()
    _, merged = plan(mergeAdapter=True)
    assert merged.disk_breakdown["finalModel"] - plain.disk_breakdown["finalModel"] == (
        4 * plain.total_params)


def test_finetune_plan_prints_the_output_volume():
    job, result = plan(method="full")
    line = next(x for x in table(job, result).splitlines() if x.startswith("output volume"))
    assert line == (f"output volume: {result.disk_bytes / GiB:.1f} GiB (the model's copy "
                    f"{2 * result.total_params / GiB:.1f} GiB, checkpoints "
                    f"{result.disk_breakdown['checkpoints'] / GiB:.1f} GiB, the final model "
                    f"{4 * result.total_params / GiB:.1f} GiB)")


@pytest.mark.parametrize(("config", "stored"), [
    ({"torch_dtype": "float32"}, 4), ({"dtype": "bfloat16"}, 2), ({"torch_dtype": "float16"}, 2),
    ({}, 2)])
def test_the_files_dtype_comes_from_the_config(config, stored):
    assert stored_bytes_per_param(config) == stored
