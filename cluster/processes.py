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


def processes_naming(folder: Path, binaries: Path) -> list[int]:
    """Processes of a program in `binaries` whose command line names `folder` (their state,
    config or data in it): a user's `tail -f` of a log there is not one of them."""
    needle, programs = str(folder.resolve()).encode(), str(binaries).encode() + b"/"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                command = (entry / "cmdline").read_bytes()
                if (command.startswith(programs) and needle in command
                        and alive(int(entry.name))):
                    found.append(int(entry.name))
    return found
