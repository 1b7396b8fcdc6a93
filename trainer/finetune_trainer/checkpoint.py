"""Checkpoints: complete or absent, newest first, `keepLast` of them.

A checkpoint is written by every rank into `step-NNNNNNNN.partial/`, then rank 0 writes
`trainer_state.json` and renames the folder to `step-NNNNNNNN/` (an atomic rename on one
filesystem). A folder without that name or that file is never loaded, so a crash or a
SIGKILL mid-write leaves the previous checkpoint as the newest. The output folder must
be shared by all nodes (a ReadWriteMany PVC or a datastore mount).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
MODEL_DIR = "model"
_NAME = re.compile(r"^step-(\d{8})$")


@dataclass
class TrainerState:
    """Counters that, with the seed, pin the data position: the next step to run."""

    step: int
    epoch: int
    step_in_epoch: int
    tokens_seen: int
    total_steps: int


class CheckpointError(RuntimeError):
    pass


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / CHECKPOINTS


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(output_dir: Path) -> Path | None:
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None


def read_state(checkpoint: Path) -> TrainerState:
    return TrainerState(**json.loads((checkpoint / STATE_FILE).read_text()))


def save(strategy, scheduler, state: TrainerState, output_dir: Path, keep_last: int) -> Path:
    """Write a checkpoint taken after `state.step` steps; collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    root = checkpoint_root(output_dir)
    final = root / f"step-{state.step:08d}"
    partial = root / f"step-{state.step:08d}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    try:
        strategy.save(partial / MODEL_DIR)
        torch.save(rng_state(), partial / f"rng-{rank}.pt")
        if rank == 0:
            torch.save(scheduler.state_dict(), partial / SCHEDULER_FILE)
    except (OSError, RuntimeError) as error:  # torch reports a full disk as RuntimeError
        raise CheckpointError(f"{partial}: writing the checkpoint failed ({error}) — free "
                              "space on the output volume; earlier checkpoints are intact"
                              ) from error
    dist.barrier()
    if rank == 0:
        tmp = partial / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=2))
        os.replace(tmp, partial / STATE_FILE)
        if final.exists():  # a rerun of the same step: the new one replaces it whole
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(root)
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(strategy, scheduler, checkpoint: Path) -> TrainerState:
    import torch
    import torch.distributed as dist

    strategy.load(checkpoint / MODEL_DIR)
    scheduler.load_state_dict(torch.load(checkpoint / SCHEDULER_FILE, weights_only=True))
    rng = checkpoint / f"rng-{dist.get_rank()}.pt"
    if rng.exists():  # absent when the world size changed: dropout then differs, nothing else
        set_rng_state(torch.load(rng, weights_only=False))
    return read_state(checkpoint)


def rng_state() -> dict:
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
