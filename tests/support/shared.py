"""Results made once per test session and read by every pytest-xdist worker: the tiny model,
and a training run that several tests only read (each asserts its own property of the same
run). The first test to ask makes it; a test on another worker that asks meanwhile waits for
it instead of making it again. A failed making is not handed out: its folder stays for a
look until the next test that asks, which makes it again (and fails with its own error)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


class Shared:
    """Folders under `root`, one per key, each made once."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def get(self, key: str, make: Callable[[Path], object], name: str = "made") -> Path:
        """The folder made for `key` by `make(folder)`, made now if no test made it yet."""
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        folder = self.root / f"{name}-{digest}"
        done = self.root / f"{name}-{digest}.done"
        with open(self.root / f"{name}-{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker making it: wait for it
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # a failed attempt's leftovers
                folder.mkdir()
                make(folder)
                done.touch()
        return folder


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> Shared:
    """Under pytest-xdist each worker's temporary folder sits in the session's, which they
    share: the results go there."""
    base = tmp_path_factory.getbasetemp()
    return Shared((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared")
