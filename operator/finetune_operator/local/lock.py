"""Which `finetune run` writes an output folder: an advisory lock (flock) on
logs/run.lock, taken by the run and inherited by its torchrun, so that a second run on the
same folder is refused and `finetune status` can tell a run that is going from one that
was killed (the kernel lets go of the lock when the processes end, kill -9 included)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from finetune_trainer.layout import RUN_LOCK


class FolderInUse(Exception):
    """Another `finetune run` is writing the output folder."""


def hold(output_dir: Path) -> int | None:
    """The output folder for this run alone until it ends: an exclusive flock on
    logs/run.lock, whose descriptor (returned) torchrun inherits, so the lock lasts while
    either process lives and goes when both end, however they end (the kernel lets go).
    Two runs writing one folder would interleave their checkpoints: the second is refused
    (FolderInUse, naming the first). None where the folder takes no lock file."""
    path = output_dir / RUN_LOCK
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only or full volume: the run says so itself, as it did
        return None
    if not _locked(fd):
        held_by = _who(fd)
        os.close(fd)
        raise FolderInUse(f"{output_dir} is being written by another `finetune run` "
                          f"({held_by})")
    with contextlib.suppress(OSError):  # who holds it is a courtesy
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    return fd


def holder(output_dir: Path) -> str | None:
    """Who is writing the output folder (pid and start), or None: no `finetune run` holds
    it now, or none ever ran here with the lock (an older version)."""
    try:
        fd = os.open(output_dir / RUN_LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _who(fd)
    else:
        return None
    finally:
        os.close(fd)


def ran_here(output_dir: Path) -> bool:
    """Whether a `finetune run` that takes the lock ever wrote this folder."""
    return (output_dir / RUN_LOCK).is_file()


def _locked(fd: int, tries: int = 5) -> bool:
    """The exclusive lock, tried a few times: a `finetune status` looking at the folder
    holds a shared one for an instant."""
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < tries:
                time.sleep(0.1)
    return False


def _who(fd: int) -> str:
    return os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
