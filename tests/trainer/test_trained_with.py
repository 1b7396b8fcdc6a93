"""A checkpoint remembers what it was trained with; a run with other settings is refused
before it starts, naming the fields, instead of failing to load it on every restart."""

from __future__ import annotations

import json

from finetune_trainer import trained_with
from finetune_trainer.config import TrainerConfig
from finetune_trainer.layout import STATE_FILE


def config(**changes) -> TrainerConfig:
    base = {"job": {"name": "demo"}, "model": {"uri": "/models/tiny"},
            "dataset": {"uri": "/data/train.jsonl"}, "method": {"type": "lora",
                                                                "lora": {"r": 8}},
            "strategy": {"type": "ddp"}, "hyperparameters": {"maxSteps": 10},
            "output": {"uri": "/out"}}
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = base
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return TrainerConfig.model_validate(base)


def checkpoint(output, step: int, settings: dict | None) -> None:
    folder = output / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text("{}")
    if settings is not None:
        (folder / trained_with.FILE).write_text(json.dumps(settings))


def test_the_record_names_spec_fields_and_leaves_out_what_may_change():
    record = trained_with.record(config())
    assert record["method.lora.r"] == 8 and record["strategy.type"] == "ddp"
    assert record["method.lora.targetModules"] == ["all-linear"]
    unrecorded = config(**{"hyperparameters.maxSteps": 500,
                           "hyperparameters.learningRate": 1e-3,
                           "output.checkpointEverySteps": 7, "output.keepLast": 5,
                           "hyperparameters.microBatchSize": 2})  # the same steps
    assert trained_with.record(unrecorded) == record
    assert trained_with.record(config(**{"method.type": "full", "method.lora": None}))[
        "method.lora.r"] is None


def test_a_changed_rank_is_refused_naming_it_and_the_fix(tmp_path):
    checkpoint(tmp_path, 3, trained_with.record(config()))
    checkpoint(tmp_path, 6, trained_with.record(config()))
    line = trained_with.refusal(tmp_path, config(**{"method.lora.r": 16,
                                                    "strategy.precision": "fp32"}),
                                "use a new folder")
    assert line == (f"{tmp_path} holds checkpoints trained with other settings "
                    "(method.lora.r: 8 → 16; strategy.precision: bf16 → fp32; newest "
                    "step-00000006), which this job cannot resume from — use a new folder")
    assert "\n" not in line


def test_resuming_with_the_same_settings_or_no_record_is_allowed(tmp_path):
    assert trained_with.refusal(tmp_path, config(), "x") is None  # nothing there yet
    checkpoint(tmp_path, 2, trained_with.record(config()))
    assert trained_with.refusal(tmp_path, config(**{"hyperparameters.maxSteps": 99}),
                                "x") is None
    checkpoint(tmp_path, 4, None)  # written before records existed: nothing to hold against
    assert trained_with.refusal(tmp_path, config(**{"method.lora.r": 2}), "x") is None


def test_an_incomplete_newer_checkpoint_is_not_the_one_compared(tmp_path):
    checkpoint(tmp_path, 2, trained_with.record(config()))
    partial = tmp_path / "checkpoints" / "step-00000004.partial"
    partial.mkdir()
    (partial / trained_with.FILE).write_text(json.dumps(
        trained_with.record(config(**{"method.lora.r": 16}))))
    assert trained_with.refusal(tmp_path, config(), "x") is None


def test_ddp_and_fsdp_resume_on_other_workers_that_keep_the_global_batch(tmp_path):
    """A step is one global batch however the workers split it, and DCP reshards: 2
    workers of 4 sequences resume on 1 of 4 x 2 passes (`finetune run --nproc 1`) or on 4
    of 2. Another global batch would move the data position: refused."""
    for strategy in ("ddp", "fsdp"):
        where = tmp_path / strategy
        two = {"strategy.type": strategy, "workers": 2,
               "hyperparameters.batchSizePerDevice": 4}
        checkpoint(where, 3, trained_with.record(config(**two)))
        one = {**two, "workers": 1, "hyperparameters.gradientAccumulationSteps": 2}
        assert trained_with.refusal(where, config(**one), "x") is None
        four = {**two, "workers": 4, "hyperparameters.batchSizePerDevice": 2}
        assert trained_with.refusal(where, config(**four), "x") is None
        line = trained_with.refusal(where, config(**{**two, "workers": 4}), "x")
        assert f"{trained_with.GLOBAL_BATCH}: 8 → 16" in line, line


def test_a_zero_checkpoint_resumes_only_on_as_many_workers(tmp_path):
    """ZeRO partitions the optimizer state by worker, and DeepSpeed loads it on as many:
    another count would fail the load on every restart. Refused, saying how many."""
    two = {"strategy.type": "zero2", "workers": 2}
    checkpoint(tmp_path, 3, trained_with.record(config(**two)))
    line = trained_with.refusal(tmp_path, config(**{
        **two, "workers": 1, "hyperparameters.gradientAccumulationSteps": 2}),
        "use a new folder")
    assert f"({trained_with.WORKERS}: 2 → 1; newest step-00000003)" in line, line
    assert line.endswith("ZeRO checkpoints resume only on as many workers as wrote them: "
                         "run it on 2 workers again, or use a new folder"), line


def test_a_checkpoint_that_recorded_each_workers_batch_is_compared_as_such(tmp_path):
    """Written before the worker count was known to the record: its per-worker batch and
    accumulation are held against the job's, as they were."""
    checkpoint(tmp_path, 3, trained_with.record(config()))  # no workers: per-worker keys
    assert "hyperparameters.gradientAccumulationSteps" in trained_with.read(
        tmp_path / "checkpoints" / "step-00000003")
    assert trained_with.refusal(tmp_path, config(workers=2), "x") is None
    line = trained_with.refusal(tmp_path, config(**{
        "workers": 1, "hyperparameters.gradientAccumulationSteps": 2}), "x")
    assert "hyperparameters.gradientAccumulationSteps: 1 → 2" in line, line
