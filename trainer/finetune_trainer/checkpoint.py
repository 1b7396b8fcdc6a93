"""Checkpoints: complete or absent, newest first, `keepLast` of them.

A checkpoint is written by every rank into `step-NNNNNNNN.partial/`, then rank 0 writes
`trainer_state.json` and renames the folder to `step-NNNNNNNN/` (an atomic rename on one
filesystem). A folder without that name or that file is never loaded, so a crash or a
SIGKILL mid-write leaves the previous checkpoint as the newest. The output folder must
be shared by all nodes (a ReadWriteMany PVC or a datastore mount).

Older checkpoints are deleted (`keepLast`) only after the new one is renamed complete, so
a write that fails (a full volume) leaves every earlier checkpoint as it was; the failure
is a `CheckpointError` naming the folder, the free space and the checkpoint a rerun
resumes from. Leftover `.partial` folders are removed when the next checkpoint starts.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from finetune_trainer import trained_with
from finetune_trainer.layout import (  # the layout is named once, in layout.py
    STATE_FILE,
    checkpoint_root,
    complete_checkpoints,
    latest_checkpoint,
)

SCHEDULER_FILE = "scheduler.pt"
MODEL_DIR = "model"


@dataclass
class TrainerState:
    """Counters that, with the seed, pin the data position: the next step to run."""

    step: int
    epoch: int
    step_in_epoch: int
    tokens_seen: int
    total_steps: int


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the folder and the fix."""


def read_state(checkpoint: Path) -> TrainerState:
    return TrainerState(**json.loads((checkpoint / STATE_FILE).read_text()))


def save(strategy, scheduler, state: TrainerState, output_dir: Path, keep_last: int,
         settings: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint taken after `state.step` steps; collective: every rank calls it.
    `settings`: what it is trained with (`trained_with.record`), kept beside its state."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    rank = dist.get_rank()
    root = checkpoint_root(output_dir)
    final = root / f"step-{state.step:08d}"
    partial = root / f"step-{state.step:08d}.partial"

    def writing(write) -> None:
        try:
            write()
        # torch reports a full disk as a RuntimeError ("unexpected pos"), DCP as a
        # CheckpointException (a BaseException) carrying each rank's error
        except (OSError, RuntimeError, CheckpointException) as error:
            if peer_failure(error):  # a rank died mid-save: the gang restart handles it
                raise
            raise CheckpointError(write_failure(output_dir, partial, error)) from error

    if rank == 0:
        writing(lambda: _start(root, partial))
    dist.barrier()
    writing(lambda: strategy.save(partial / MODEL_DIR))
    writing(lambda: torch.save(rng_state(), partial / f"rng-{rank}.pt"))
    if rank == 0:
        writing(lambda: torch.save(scheduler.state_dict(), partial / SCHEDULER_FILE))
    dist.barrier()
    if rank == 0:
        if settings is not None:
            writing(lambda: (partial / trained_with.FILE).write_text(
                json.dumps(settings, indent=2)))
        writing(lambda: _write_state(partial, state))
        if final.exists():  # a rerun of the same step: the new one replaces it whole
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(root)
        # only now, with a newer checkpoint complete, may the oldest go
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _start(root: Path, partial: Path) -> None:
    for stale in root.glob("step-*.partial"):  # left by a failed write or a killed run
        shutil.rmtree(stale, ignore_errors=True)
    partial.mkdir(parents=True)


def _write_state(partial: Path, state: TrainerState) -> None:
    tmp = partial / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    os.replace(tmp, partial / STATE_FILE)


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted", "ProcessGroupNCCL", "gloo", "Timed out")
"""What a collective raises when another rank stopped answering (gloo's and NCCL's own
words): not the storage's fault, and not worth a message about the output folder."""


def peer_failure(error: BaseException) -> bool:
    """The save failed because another rank died or hung, not because of the output folder
    (#25, item 6): a torch.distributed error, or DCP's per-rank failures all of that kind."""
    import torch.distributed as dist

    failures = getattr(error, "_failures", None)  # DCP: {rank: (exception, traceback)}
    if failures:
        return all(peer_failure(cause) for cause, _trace in failures.values())
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and not isinstance(error, OSError) and any(
        words in str(error) for words in PEER_GONE)


def write_failure(output_dir: Path, partial: Path, error: BaseException) -> str:
    """What to tell a user whose checkpoint could not be written: where, why (the first
    rank's error), how much space is left, the fix, and where a rerun resumes from."""
    failures = getattr(error, "_failures", None)  # DCP: {rank: (exception, traceback)}
    if failures:
        rank, (cause, _trace) = sorted(failures.items(), key=lambda item: item[0])[0]
        reason = f"rank {rank}: {cause}"
    else:
        reason = str(error) or type(error).__name__
    latest = latest_checkpoint(output_dir)
    resume = (f"it resumes from {latest.name}, which is complete and untouched" if latest
              else "it starts from step 0 (no checkpoint is complete yet)")
    try:
        free = shutil.disk_usage(output_dir).free
    except OSError:
        free = None
    needed = _folder_size(latest) if latest else 0
    if free is not None and free <= max(needed, 1 << 20):
        problem = (f"the output volume is full ({_size(free)} free; a checkpoint takes "
                   f"{_size(needed)})" if needed else
                   f"the output volume is full ({_size(free)} free)")
        fix = "free space there or point spec.output.uri at a larger volume"
    else:
        problem = ("the output folder refused the write" if free is None else
                   f"the output folder refused the write ({_size(free)} free)")
        fix = "check that every worker can write there and that its volume has room"
    return (f"{output_dir}: writing checkpoint {partial.name} failed ({reason}); {problem} — "
            f"{fix}, then run the job again: {resume}")


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


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
