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

Periodic checkpoints are written in the background (`Checkpointer`, #17) where the host
has room for a copy of the state: the loop waits only while the state is copied to host
memory, and the rename that makes a checkpoint complete waits for every rank's write. The
last step's checkpoint and SIGTERM's are written synchronously.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from finetune_trainer import trained_with
from finetune_trainer.config import AsyncCheckpoints
from finetune_trainer.layout import (  # the layout is named once, in layout.py
    STATE_FILE,
    checkpoint_root,
    complete_checkpoints,
    latest_checkpoint,
)

SCHEDULER_FILE = "scheduler.pt"
OBJECTIVE_FILE = "objective-{rank}.pt"
"""Beside the model, per rank: what the objective carries across a restart
(`Objective.state_dict`; GRPO's generation round in progress), absent when nothing."""
MODEL_DIR = "model"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass
class TrainerState:
    """Counters that, with the seed, pin the data position (the next step to run), and
    early stopping's record."""

    step: int
    epoch: int
    step_in_epoch: int
    tokens_seen: int
    total_steps: int
    best_eval_loss: float | None = None
    """Early stopping's record (`hyperparameters.earlyStoppingPatience`): the best eval
    loss so far, the step it was evaluated at, and the evaluations since."""
    best_eval_step: int | None = None
    evals_since_best: int = 0


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the folder and the fix."""


def read_state(checkpoint: Path) -> TrainerState:
    return TrainerState(**json.loads((checkpoint / STATE_FILE).read_text()))


def save(strategy, scheduler, state: TrainerState, output_dir: Path, keep_last: int,
         settings: dict[str, Any] | None = None) -> Path:
    """Write a complete checkpoint taken after `state.step` steps before returning (the
    loop's saves go through a `Checkpointer`, which writes in the background)."""
    return Checkpointer(strategy, scheduler, output_dir, keep_last, settings).save(
        state, background=False)


@dataclass
class _Pending:
    """A checkpoint started and not yet complete: its model and optimizer state may still
    be being written by a background thread (`write`; None once written synchronously)."""

    state: TrainerState
    partial: Path
    final: Path
    began: float  # perf_counter when the model's save began
    write: Future | None = None
    staged: float = 0.0  # seconds the loop was held: staging, or the whole synchronous write
    written_at: float | None = None  # perf_counter when the background write ended


class Checkpointer:
    """The run's checkpoints, written while training goes on; collective: every rank makes
    the same calls in the same order.

    #17: synchronous saves stalled training for the whole write and could miss the
    eviction window. A periodic save now holds the loop only to stage the model and
    optimizer state in host memory (DCP's async_save under ddp and fsdp, a checkpoint
    engine of ours under DeepSpeed: deepspeed_saves.py) where the host has room for that
    copy (`staging_refused`); a thread writes them while the next steps train. The
    checkpoint is made complete (renamed, `trainer_state.json` written) only in `finish`,
    after every rank's write ended: at the first step boundary where every rank's has (the
    loop asks `writing` in its per-step agreement), else at the next save, at the end of
    training and before a SIGTERM exit (a crash between saves resumes from the newest one,
    not the one before it). So a checkpoint is still complete or absent, at most one is in
    flight, `keepLast` prunes only after the newer one is complete, and a failed write is a
    `CheckpointError` (raised when its write is waited for).
    """

    def __init__(self, strategy, scheduler, output_dir: Path, keep_last: int,
                 settings: dict[str, Any] | None = None,
                 say: Callable[[str], None] | None = None,
                 observe: Callable[[float], None] | None = None,
                 behind: AsyncCheckpoints = "auto", every: int | None = None,
                 objective_state: Callable[[], dict] | None = None) -> None:
        """`settings`: what it is trained with (`trained_with.record`), kept beside its
        state. `say`: where the line about each completed checkpoint goes; `observe`: gets
        the seconds each one took to write (staging and background write together).
        `behind`: `output.asyncCheckpoints`; `every`: `output.checkpointEverySteps`;
        `objective_state`: this rank's objective state at the step (`OBJECTIVE_FILE`)."""
        self.mode, self.every = behind, every
        self.objective_state = objective_state or dict
        self.strategy, self.scheduler = strategy, scheduler
        self.output_dir, self.keep_last, self.settings = output_dir, keep_last, settings
        self.say = say or (lambda text: None)
        self.observe = observe or (lambda seconds: None)
        self._pending: _Pending | None = None
        self._behind: bool | None = None  # whether saves go in the background, once decided

    def maybe_save(self, state: TrainerState, last: bool, stopping: bool,
                   best: bool = False) -> None:
        """The cadence: every `every` steps, after the last step, and on SIGTERM. The last
        two are written synchronously: on SIGTERM the pod has seconds left and this very
        step's checkpoint must be complete before it exits; after the last step no step is
        left to write behind, and the loop would wait for the whole write anyway, so staging
        a host copy first would only add its time and its memory (#22: a 1B full fine-tune's
        15 GB of weights and Adam moments, which tripled the run's peak host memory).
        `best`: this step's evaluation is the best so far under early stopping, whose
        export is of the best evaluation's weights (written behind, as a periodic one)."""
        if last or stopping or best or (self.every and state.step % self.every == 0):
            self.save(state, background=not (stopping or last))

    def save(self, state: TrainerState, *, background: bool = True) -> Path:
        """Start the checkpoint of `state.step` steps, after completing the one in flight.
        `background=False` (SIGTERM: the pod is about to go) completes it before returning,
        as does `output.asyncCheckpoints` off: a checkpoint that is written is made
        complete at once. Returns its folder, which exists once it is complete."""
        self.finish()
        rank = dist.get_rank()
        root = checkpoint_root(self.output_dir)
        name = f"step-{state.step:08d}"
        pending = _Pending(state, root / f"{name}.partial", root / name, time.perf_counter())
        partial = pending.partial
        if rank == 0:
            self._guarded(partial, lambda: _start(root, partial))
        dist.barrier()
        # the RNG and schedule as of this step, beside the model: small, written at once
        self._guarded(partial, lambda: torch.save(rng_state(), partial / f"rng-{rank}.pt"))
        if rank == 0:
            self._guarded(partial, lambda: torch.save(self.scheduler.state_dict(),
                                                      partial / SCHEDULER_FILE))
        if objective := self.objective_state():
            self._guarded(partial, lambda: torch.save(
                objective, partial / OBJECTIVE_FILE.format(rank=rank)))
        pending.began = time.perf_counter()
        if background and self._writes_behind():
            pending.write = self._guarded(
                partial, lambda: self.strategy.save_async(partial / MODEL_DIR))
        else:
            self._guarded(partial, lambda: self.strategy.save(partial / MODEL_DIR))
        pending.staged = time.perf_counter() - pending.began
        if pending.write is not None:
            pending.write.add_done_callback(
                lambda _: setattr(pending, "written_at", time.perf_counter()))
        self._pending = pending
        if pending.write is None:  # written already (SIGTERM's, or a synchronous one)
            self.finish()
        return pending.final

    def writing(self) -> bool:
        """This rank's part of the checkpoint in flight is still being written."""
        pending = self._pending
        return pending is not None and pending.write is not None and not pending.write.done()

    def finish(self) -> Path | None:
        """Collective: complete the checkpoint in flight, if one is. Waits for this rank's
        write (its failure raised here), then for every rank's (a barrier); then rank 0
        names it complete and prunes the oldest. Returns its folder."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        waited = time.perf_counter()
        if pending.write is not None:
            self._guarded(pending.partial, pending.write.result)
        waited = time.perf_counter() - waited
        dist.barrier()
        if dist.get_rank() == 0:
            self._complete(pending)
        dist.barrier()
        self._report(pending, waited)
        return pending.final

    def _writes_behind(self) -> bool:
        """Whether saves go in the background, decided at the first one, the same on every
        rank (one writing behind while another waits would pair their collectives wrong).

        A background save holds a host copy of the rank's checkpointed state until it is
        written (#22 had made the synchronous write stream it one tensor at a time), so it
        goes behind only where that copy is affordable (`staging_refused`), unless
        `output.asyncCheckpoints` says `on` or `off`."""
        if self._behind is not None:
            return self._behind
        if self.mode != "auto":
            self._behind = self.mode == "on"
            return self._behind
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        why_not = staging_refused(self.strategy.checkpoint_bytes(),
                                  self.strategy.device.type, local_ranks)
        votes = torch.tensor([0 if why_not else 1])
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.strategy.save_group())
        self._behind = bool(votes.item())
        if not self._behind:
            self.say("checkpoints are written synchronously: "
                     + (why_not or "another rank has no host memory to stage its part"))
        return self._behind

    @contextlib.contextmanager
    def writing_beside(self) -> Iterator[None]:
        """Around the loop's own writes to the output folder (its progress files) while a
        checkpoint is written behind them: a volume that fills up mid-checkpoint may refuse
        those first, and then the checkpoint's failure is the one to report (which
        checkpoint, the free space, where a rerun resumes from), as a synchronous save did."""
        try:
            yield
        except OSError as error:
            pending = self._pending
            if error.errno not in DISK_FULL or pending is None or pending.write is None:
                raise
            self._guarded(pending.partial, pending.write.result)  # its CheckpointError
            raise  # the checkpoint was written after all: the volume filled up since

    def _complete(self, pending: _Pending) -> None:
        """Rank 0, once every rank's part is written: the state file last, then the rename
        that makes the checkpoint complete, then (only now) the oldest may go."""
        partial, final = pending.partial, pending.final
        if self.settings is not None:
            self._guarded(partial, lambda: (partial / trained_with.FILE).write_text(
                json.dumps(self.settings, indent=2)))
        self._guarded(partial, lambda: _write_state(partial, pending.state))
        if final.exists():  # a rerun of the same step: the new one replaces it whole
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(final.parent)
        for old in prunable(complete_checkpoints(self.output_dir), self.keep_last,
                            pending.state.best_eval_step):
            shutil.rmtree(old, ignore_errors=True)

    def _report(self, pending: _Pending, waited: float) -> None:
        """One line per checkpoint: how long the loop was held, and how long the write
        took behind it (the measure of #17)."""
        ended = pending.written_at or time.perf_counter()
        self.observe(ended - pending.began)
        if pending.write is None:
            self.say(f"checkpoint {pending.final}: written in {pending.staged:.3f} s while "
                     "training waited")
            return
        held = f"; training waited {waited:.3f} s more for it" if waited >= 0.001 else ""
        self.say(f"checkpoint {pending.final}: staged in {pending.staged:.3f} s, written in "
                 f"{ended - pending.began - pending.staged:.3f} s in the background{held}")

    def _guarded(self, partial: Path, write: Callable[[], Any]) -> Any:
        """`write()`, a storage failure turned into a CheckpointError naming the folder."""
        try:
            return write()
        # torch reports a full disk as a RuntimeError ("unexpected pos"), DCP as a
        # CheckpointException (a BaseException) carrying each rank's error
        except (OSError, RuntimeError, CheckpointException) as error:
            if peer_failure(error):  # a rank died mid-save: the gang restart handles it
                raise
            raise CheckpointError(write_failure(self.output_dir, partial, error)) from error


def prunable(complete: list[Path], keep_last: int, best_step: int | None) -> list[Path]:
    """The complete checkpoints (oldest first) that `keepLast` lets go: all but the newest
    `keep_last`, and never the best evaluation's under early stopping (`best_step`), which
    the export loads back."""
    best = None if best_step is None else f"step-{best_step:08d}"
    return [old for old in complete[:-keep_last] if old.name != best]


def staging_refused(staged: int, device_type: str, local_ranks: int) -> str | None:
    """Why a background save's host copy of `staged` bytes (per rank, `local_ranks` on this
    host at once) is not affordable, or None. It must fit in half the host memory left (the
    pod's cgroup limit included). On CPU workers the state lives in host memory already, so
    the copy is pure growth: allowed only under a twentieth of the process's resident set,
    within the tenth over a bare training loop that #22 holds the trainer to (LoRA's
    adapters pass; a full fine-tune's weights and Adam moments do not)."""
    free = host_memory_free()
    if free is not None and staged * local_ranks > free // 2:
        return (f"staging {_size(staged)} per rank on {local_ranks} rank(s) would take more "
                f"than half of the {_size(free)} of host memory free")
    if device_type == "cpu":
        resident = _resident_bytes()
        if resident is not None and staged * 20 > resident:
            return (f"on CPU workers a background save would copy the state it saves "
                    f"({_size(staged)}) in host memory, more than a twentieth of the "
                    f"{_size(resident)} this process holds")
    return None


def host_memory_free() -> int | None:
    """Host memory still free to this process: the kernel's MemAvailable, or less where the
    container's cgroup (v2 or v1) limit leaves less. None where neither can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = Path("/proc/meminfo").read_text().splitlines()
        found.append(int(next(ln for ln in lines if ln.startswith("MemAvailable:")).split()[1])
                     * 1024)
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        with contextlib.suppress(OSError, ValueError):
            cgroup = Path("/sys/fs/cgroup")
            found.append(int((cgroup / limit).read_text()) - int((cgroup / usage).read_text()))
            break  # "max" (no limit) raises ValueError and falls through to v1
    return max(0, min(found)) if found else None


def _resident_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


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
    strategy.load(checkpoint / MODEL_DIR)
    configured = list(scheduler.base_lrs)
    scheduler.load_state_dict(torch.load(checkpoint / SCHEDULER_FILE, weights_only=True))
    keep_learning_rate(scheduler, configured)
    rng = checkpoint / f"rng-{dist.get_rank()}.pt"
    if rng.exists():  # absent when the world size changed: dropout then differs, nothing else
        set_rng_state(torch.load(rng, weights_only=False))
    return read_state(checkpoint)


def objective_state(checkpoint: Path) -> dict:
    """This rank's objective state in `checkpoint` (empty when none was saved, or when
    the world size changed and this rank saved none)."""
    saved = checkpoint / OBJECTIVE_FILE.format(rank=dist.get_rank())
    return torch.load(saved, weights_only=True) if saved.exists() else {}


def keep_learning_rate(scheduler, configured: list[float]) -> None:
    """This run's peak learning rate (`hyperparameters.learningRate`), not the checkpoint's:
    a changed learning rate resumes (trained_with leaves it out), and takes effect from the
    first step resumed, at the point of the schedule the run has reached. The schedule's
    state holds its peak rates; loaded as they were, the old rate came back."""
    if list(scheduler.base_lrs) == configured:
        return
    scheduler.base_lrs = configured
    rates = [base * factor(scheduler.last_epoch)
             for base, factor in zip(configured, scheduler.lr_lambdas, strict=True)]
    for group, base, rate in zip(scheduler.optimizer.param_groups, configured, rates,
                                 strict=True):
        group["initial_lr"], group["lr"] = base, rate
    scheduler._last_lr = rates  # what get_last_lr() reports (the progress records' rate)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
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
