"""Where a run keeps its checkpoints in the output folder, and which of them are complete.
Torch-free: `finetune run` and the operator read it as well as the trainer."""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
"""Written last into a checkpoint: a folder without it is not complete."""
_NAME = re.compile(r"^step-(\d{8})$")


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / CHECKPOINTS


def step_of(checkpoint: Path) -> int:
    return int(_NAME.match(checkpoint.name).group(1))


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=step_of)


def latest_checkpoint(output_dir: Path) -> Path | None:
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None
