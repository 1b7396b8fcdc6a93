"""Rank 0's TensorBoard event files, read back with TensorBoard's own event reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from finetune_trainer.layout import TENSORBOARD_DIR
from finetune_trainer.progress import Reporter
from finetune_trainer.tensorboard_log import tensorboard_tracker


def scalars(output: Path) -> dict[str, dict[int, float]]:
    """tag → {step: value}, as TensorBoard loads the folder (the latest value per step)."""
    events = EventAccumulator(str(output / TENSORBOARD_DIR))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


def test_each_record_and_evaluation_is_a_scalar_at_its_step(tmp_path):
    reporter = Reporter(tmp_path, total_steps=20, start_step=0, enabled=True,
                        trackers=(tensorboard_tracker(tmp_path),))
    reporter.step_done(500)
    reporter.report(10, 0.5, 2.5, 1e-4, grad_norm=1.5)
    reporter.evaluated(10, 2.75)
    reporter.step_done(500)
    reporter.report(20, 1.0, float("nan"), 5e-5, grad_norm=0.5)  # a NaN is left out
    reporter.finish("Succeeded")
    seen = scalars(tmp_path)
    assert seen["train/loss"] == {10: 2.5}
    assert seen["train/learning_rate"] == pytest.approx({10: 1e-4, 20: 5e-5})  # float32
    assert seen["train/grad_norm"] == {10: 1.5, 20: 0.5}
    assert set(seen["train/tokens_per_second"]) == {10, 20}
    assert seen["eval/loss"] == {10: 2.75}
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["evalLoss"] == 2.75 and progress["gradNorm"] == 0.5  # carried on


def test_a_resumed_run_replaces_what_the_killed_attempt_wrote_after_its_checkpoint(tmp_path):
    first = Reporter(tmp_path, 30, 0, True, trackers=(tensorboard_tracker(tmp_path),))
    for step in (10, 20, 30):
        first.report(step, 0.0, 3.0, 1e-4)
    first.finish("Stopped")
    resumed = Reporter(tmp_path, 30, 10, True, trackers=(tensorboard_tracker(tmp_path, 10),))
    for step in (20, 30):
        resumed.report(step, 0.0, 2.0, 1e-4)
    resumed.finish("Succeeded")
    assert scalars(tmp_path)["train/loss"] == {10: 3.0, 20: 2.0, 30: 2.0}


def test_a_writer_that_fails_costs_the_charts_once_and_never_the_run(tmp_path, capsys):
    tracker = tensorboard_tracker(tmp_path)

    def full_volume(*args, **kwargs):
        raise OSError(28, "No space left on device")

    tracker.writer.add_scalar = full_volume
    reporter = Reporter(tmp_path, 30, 0, True, trackers=(tracker,))
    reporter.report(10, 0.0, 3.0, 1e-4)
    reporter.report(20, 0.0, 2.0, 1e-4)
    reporter.finish("Succeeded")
    assert capsys.readouterr().out.count("TensorBoard event files are no longer written") == 1
    assert json.loads((tmp_path / "progress.json").read_text())["phase"] == "Succeeded"


def test_dpo_rewards_are_charted_under_trls_names(tmp_path):
    reporter = Reporter(tmp_path, total_steps=10, start_step=0, enabled=True,
                        trackers=(tensorboard_tracker(tmp_path),))
    reporter.step_done(300)
    reporter.report(5, 0.5, 0.61, 1e-4, objective_metrics={
        "rewards/chosen": 0.25, "rewards/rejected": -0.5, "rewards/margins": 0.75,
        "rewards/accuracies": 1.0})
    reporter.finish("Succeeded")
    seen = scalars(tmp_path)
    assert {tag: values[5] for tag, values in seen.items() if "rewards" in tag} == {
        "train/rewards/chosen": 0.25, "train/rewards/rejected": -0.5,
        "train/rewards/margins": 0.75, "train/rewards/accuracies": 1.0}
