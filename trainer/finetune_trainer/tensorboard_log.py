"""Rank 0's progress as TensorBoard event files under `<output>/tensorboard`, so
`tensorboard --logdir <output>` works locally, on a mounted volume and in Azure ML Studio.

Written through torch's own SummaryWriter (the `tensorboard` package writes the files); a
run without that package, or a writer that fails (a full volume), loses the charts and
says so once, never the training run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from finetune_trainer.layout import TENSORBOARD_DIR
from finetune_trainer.record import ProgressRecord

TRAIN_SCALARS: dict[str, str] = {
    "loss": "train/loss",
    "learning_rate": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_second": "train/tokens_per_second",
    "mfu": "train/mfu",
    "step_seconds": "train/step_seconds",
}
"""Record field → TensorBoard tag."""
EVAL_LOSS = "eval/loss"
EVAL_PREFIX = "eval_"


class TensorBoardTracker:
    """A Reporter's tracker: each published record becomes scalars at its step."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.broken = False

    def log(self, record: ProgressRecord) -> None:
        values = [(tag, getattr(record, field)) for field, tag in TRAIN_SCALARS.items()]
        # the objective's, TRL's names under train/ (train/rewards/margins, train/reward,
        # ...), as its users chart them
        values += [(f"train/{name}", value)
                   for name, value in (record.objective_metrics or {}).items()
                   if not name.startswith(EVAL_PREFIX)]  # written once, at their evaluation
        self._write(values, record.step)

    def evaluated(self, step: int, loss: float | None, figures: dict[str, float]) -> None:
        """eval/loss and each `eval_<name>` figure as eval/<name> (TRL's tags)."""
        self._write([(EVAL_LOSS, loss), *((f"eval/{name.removeprefix(EVAL_PREFIX)}", value)
                                          for name, value in figures.items())], step)

    def finish(self, final: ProgressRecord) -> None:
        if not self.broken:
            try:
                self.writer.close()
            except Exception as error:
                self._give_up(error)

    def _write(self, scalars: list[tuple[str, float | None]], step: int) -> None:
        if self.broken:
            return
        try:
            for tag, value in scalars:
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(tag, value, step)
            self.writer.flush()  # readable while the run goes on, and after a kill
        except Exception as error:
            self._give_up(error)

    def _give_up(self, error: Exception) -> None:
        self.broken = True
        print(f"TensorBoard event files are no longer written: {error}", flush=True)


def tensorboard_tracker(output_dir: Path, start_step: int = 0) -> TensorBoardTracker | None:
    """A tracker writing into `output_dir`/tensorboard, or None (saying why) where the
    tensorboard package is missing. A resumed run (`start_step` > 0) purges what an earlier
    attempt wrote after its checkpoint, so each step has one value."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs tensorboard: may be missing
    except ImportError:
        print("TensorBoard event files are not written: the tensorboard package is not "
              "installed (pip install tensorboard), or set spec.output.tensorboard: false",
              flush=True)
        return None
    return TensorBoardTracker(SummaryWriter(log_dir=str(output_dir / TENSORBOARD_DIR),
                                            purge_step=start_step + 1 if start_step else None))
