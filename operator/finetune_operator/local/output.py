"""`finetune run` and the output folder: what `--fresh` sets aside (renamed, never deleted),
a run with nothing left to do, and the line an interrupted run ends with."""

from __future__ import annotations

import time
from pathlib import Path

from finetune_operator.follow import read_progress
from finetune_trainer.config import TrainerConfig
from finetune_trainer.layout import (
    CHECKPOINTS,
    FINAL_DIR,
    HISTORY_FILE,
    MERGED_DIR,
    PROGRESS_FILE,
    REFERENCE_FILE,
    TENSORBOARD_DIR,
    latest_checkpoint,
    step_of,
)

START_OVER = ("point spec.output.uri at a new folder, or start over with `finetune run "
              "--fresh` (the earlier run's checkpoints and model are moved aside, not "
              "deleted)")


EARLIER_RUN = (CHECKPOINTS, FINAL_DIR, MERGED_DIR, TENSORBOARD_DIR, PROGRESS_FILE, HISTORY_FILE,
               REFERENCE_FILE)
"""What `--fresh` moves aside: the earlier run's checkpoints, exports, history and DPO
reference (the model cache, the logs and the lock stay: a fresh run reuses or appends to
them)."""


def set_earlier_run_aside(output_dir: Path) -> tuple[Path, list[str]] | None:
    """`finetune run --fresh`: the earlier run's outputs (EARLIER_RUN), renamed into
    `before-<time>/` in the output folder (renames on one filesystem: nothing is deleted or
    copied, and the new run's export cannot overwrite the old one); with the names moved.
    None when there is nothing to move."""
    found = [name for name in EARLIER_RUN if (output_dir / name).exists()]
    if not found:
        return None
    aside = output_dir / f"before-{time.strftime('%Y%m%dT%H%M%S')}"
    aside.mkdir()
    for name in found:
        (output_dir / name).rename(aside / name)
    return aside, found


def already_done(output_dir: Path, config: TrainerConfig) -> str | None:
    """The line a run that has nothing left to do ends with: the folder's run succeeded at
    the config's maxSteps and its model is there. (An epochs-long run's total is known only
    once the data is read: it runs again, resuming at its last step.)"""
    max_steps, final = config.hyperparameters.max_steps, output_dir / FINAL_DIR
    record = read_progress(output_dir) if max_steps is not None else None
    if record is None or record.phase != "Succeeded" or record.step != max_steps or (
            not final.is_dir()):
        return None
    return (f"already done: {max_steps}/{max_steps} steps, the model is in {final} — raise "
            "hyperparameters.maxSteps to train on from the last checkpoint, or --fresh to "
            "start over")


def stopped_message(output_dir: Path) -> str:
    """The one line `finetune run` ends with after Ctrl-C or SIGTERM."""
    latest = latest_checkpoint(output_dir)
    if latest is None:
        return "interrupted before the first checkpoint; run the same command to start again"
    return (f"interrupted; checkpoint at step {step_of(latest)} in {latest.parent}; run the "
            "same command to resume")
