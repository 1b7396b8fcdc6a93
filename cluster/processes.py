"""Processes the cluster's scripts start and stop, also from another process than the one that
started them (pid files): whether one is alive, and how one is stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def terminate(pid: int, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        # a zombie child of ours counts as gone
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.split(") ", 1)[1][0] != "Z"
    return True
