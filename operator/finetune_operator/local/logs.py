"""`finetune run`'s output: every line of torchrun and the workers kept in the output
folder's run log (what `finetune logs` reads), and the terminal's copy filtered of the
progress bars and of the traceback of a stop the user asked for."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

NOISE = re.compile(
    r"^(Loading weights|Generating \w+ split|Writing model shards|Map( \(num_proc=\d+\))?:|"
    r"\*{20,}|Setting OMP_NUM_THREADS environment variable|"
    r"stopped by SIGTERM (after step|before the first step)|"  # said once, by `finetune run`
    r"W\d{4} .*(Received \d+ death signal|closing signal SIGTERM)|"
    r"E\d{4} .*\] failed \(exitcode: -?\d+\) local_rank: \d+)")
"""Lines of the workers and of torchrun that a plain `finetune run` does not show
(`--verbose` shows everything): progress bars of loading and data preparation,
torchrun's thread banner, its log of the stop `finetune run` itself asked for, and its
log of a worker's exit code (the launcher's `finetune-train:` line names the rank, the
code and the worker's words, and `training failed (exit N)` follows)."""


_TRACEBACK = "Traceback (most recent call last)"

_FAILURE = "finetune-train: "
"""How a worker's and the launcher's one-line reasons open (`errors.failed`): each rank says
the same refusal of the data, and the launcher says the first failed rank's again."""


_CHAINED = ("During handling of the above exception", "The above exception was the direct")


class QuietLog:
    """Filters one output stream of torchrun line by line. Drops `NOISE`, a `finetune-train:`
    line already shown (the same reason from another rank, or the launcher's copy of it),
    and the traceback torchrun's agent prints when `finetune run` forwards Ctrl-C or
    SIGTERM to it (SignalException); every other traceback passes whole."""

    def __init__(self, stopping: Callable[[], bool]) -> None:
        self.stopping = stopping
        self.traceback: list[str] | None = None
        self.held: list[str] = []
        """The signal traceback dropped last: shown after all if an exception chained to
        it is not one (a second Ctrl-C raises one while the agent handles the first)."""
        self.dropped = False
        self.blanks: list[str] = []
        self.reasons: set[str] = set()

    def feed(self, line: str) -> list[str]:
        if self.traceback is not None:
            self.traceback.append(line)
            if line[:1].isspace() or not line.strip() or line.startswith(_TRACEBACK):
                return []
            block, self.traceback = self.traceback, None  # the exception's own line
            if self.stopping() and "SignalException" in line:
                self.held, self.dropped = block, True
                return []
            held, self.held, self.dropped = self.held, [], False
            blanks, self.blanks = self.blanks, []
            if held and block[0].startswith(_CHAINED):
                return [*held, "\n", *block]
            return [*blanks, *block]
        if line.startswith((_TRACEBACK, *_CHAINED)):
            self.traceback = [line]
            return []
        # a progress bar's carriage returns leave empty lines before and behind it
        if not line.strip():
            if not self.dropped:
                self.blanks.append(line)
            return []
        blanks, self.blanks = self.blanks, []
        self.dropped = NOISE.match(line) is not None or line in self.reasons
        if line.startswith(_FAILURE):
            self.reasons.add(line)
        return [] if self.dropped else [*blanks, line]

    def flush(self) -> list[str]:
        block, self.traceback = self.traceback or [], None
        blanks, self.blanks = self.blanks, []
        return blanks + block


class RunLog:
    """Every line torchrun and the workers wrote, filtered or not, in the output folder
    (`logs/run.log`, appended to by each run): what `finetune logs` reads. A volume that
    refuses the log (full, read-only) costs the log, said once, never the run or its
    terminal output."""

    def __init__(self, path: Path):
        self.lock = threading.Lock()
        self.handle: TextIO | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = path.open("a", encoding="utf-8", errors="replace")
        except OSError as error:
            self._give_up(path, error)
        self.path = path

    def begin(self, what: str) -> None:
        """A line that starts a run's part of the log (each run appends to it), closed."""
        self.write(f"=== {what}, {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC ===\n")
        self.close()

    def write(self, line: str) -> None:
        with self.lock:
            if self.handle is None:
                return
            try:
                self.handle.write(line)
                self.handle.flush()
            except OSError as error:
                self._give_up(self.path, error)

    def close(self) -> None:
        with self.lock:
            handle, self.handle = self.handle, None
            if handle is not None:
                with contextlib.suppress(OSError):  # every line was flushed as written
                    handle.close()

    def _give_up(self, path: Path, error: OSError) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()
        sys.stderr.write(f"finetune run: {path} is no longer written ({error.strerror}); "
                         "the terminal keeps every line\n")


def _relay(source: TextIO, target: TextIO, log: QuietLog | None, keep: RunLog) -> None:
    for line in source:
        keep.write(line)
        for kept in (log.feed(line) if log is not None else [line]):
            target.write(kept)
            target.flush()
    for kept in (log.flush() if log is not None else []):
        target.write(kept)
    target.flush()


def start_relays(child: subprocess.Popen, keep: RunLog,
            stopping: Callable[[], bool] | None) -> list[threading.Thread]:
    """Threads copying the child's stdout and stderr to ours and to `keep`, through a
    QuietLog each unless `stopping` is None (verbose)."""
    relays = [threading.Thread(target=_relay, args=(
        stream, target, None if stopping is None else QuietLog(stopping), keep), daemon=True)
        for stream, target in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
    for relay in relays:
        relay.start()
    return relays
