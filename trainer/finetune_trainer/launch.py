"""`python -m finetune_trainer.launch [torchrun's arguments]`: torchrun, ending as its workers did.

torchrun reports every worker failure as its own exit 1 and a SIGTERM to itself as exit 1
too, after a traceback and a banner whose last line is `=====`. A pod's exit code and its
termination message (the line a FineTuneJob's status quotes) are then the same for a bad
dataset, a CUDA crash and a preemption checkpointed in time, and the Job's pod failure
policy can tell none of them apart. This launcher runs torchrun's own `run` (its flags,
the PET_* environment defaults) and ends with:

- the failed worker's own exit code where no restart can help (2 bad input, 4 checkpoints
  of other settings), 3 for the collective preflight and 5 for what this image cannot set
  up (an import, an op that cannot be built); 1 for anything else;
- 128 + the signal when it was stopped by one (143 for SIGTERM), as a plain process would;
- one line naming the first failed rank and why (the worker's message from its error
  file, `errors.record_failure`), on stderr and in the termination message.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from finetune_trainer import errors, exits

PASSED_ON = (*exits.NOT_RESTARTED, exits.EXIT_NETWORK, exits.EXIT_SETUP)
"""Worker exit codes the launcher ends with itself: each means the same on every rank and
every attempt. Others (a crash, a kill) become 1."""


def failure_line(rank: int, exitcode: int, message: object) -> str:
    """What one failed worker said, for a person: its own message for the exit codes that
    name the input, else the rank, how it ended and its message."""
    text = _summary(str(_message(message) or ""))  # torch's ErrorHandler nests it
    if text.startswith(("To enable traceback", "Signal ")):  # torch's, where the worker said
        text = ""                                             # nothing (no error file)
    if exitcode < 0:
        name = _signal_name(-exitcode)
        if text:
            return f"rank {rank} was ended by {name}: {text}"
        hint = (" (the kernel's out-of-memory killer sends it when the host runs out of "
                "memory)" if name == "SIGKILL" else "")
        return f"rank {rank} was ended by {name}{hint}"
    if exitcode in PASSED_ON and text:
        return text
    if not text:
        return f"rank {rank} exited {exitcode} (its log above says why)"
    return f"rank {rank} exited {exitcode}: {text}"


def _summary(message: str) -> str:
    """The line of a worker's message that says what happened: torch's collective errors
    run on for lines of C++ and Python frames (`collectives.py(140): <lambda>`), and the
    operator quotes the termination message's last line."""
    lines = [line.strip() for line in message.strip().splitlines()]
    said = [line for line in lines if line and line != "Traceback (most recent call last):"
            and not line.startswith(("File \"", "frame #", "Exception raised from"))]
    return said[0] if said else ""


def first_cause(failures: dict[int, Any]) -> int:
    """The rank whose failure the launcher names: torch's `get_first_failure` takes the
    earliest error file by the second, and a rank that lost its peer (gloo's "Connection
    closed by peer") often writes in the same second as the peer it lost, or before the
    agent sees that one's kill. A rank's own failure outranks one torchrun ended itself
    (SIGTERM to the others once one failed), a lost connection, and a load of an op another
    rank failed to build; then the earliest, then the first torchrun saw (its order)."""
    def order(rank: int) -> tuple[bool, bool, bool, float]:
        failure = failures[rank]  # torch's ProcessFailure
        said = _summary(str(_message(failure.message)))
        return (failure.exitcode == -signal.SIGTERM, exits.LOST_PEER.search(said) is not None,
                _NOT_BUILT_HERE.search(said) is not None, failure.timestamp)

    return min(failures, key=order)


_NOT_BUILT_HERE = re.compile(r"cannot open shared object file")
"""torch's JIT build runs on one rank while the others wait for its lock and then load what
it built: where the build failed, they fail loading a library that is not there, and the
builder's own line says why."""


def _message(message: object) -> object:
    return message.get("message", "") if isinstance(message, dict) else message


def stale_build_locks(root: Path) -> list[Path]:
    """The lock files under `root` (torch's extensions folder) that no process holds open.

    torch's JIT build of an op (DeepSpeed's shm op on CPU workers) creates `NAME/lock` and
    holds it open while it compiles; every other process that needs the op waits, without
    end and without a word, while the file exists. A build killed midway (SIGKILL, a run
    or pod stopped while it compiled) leaves the file, and every later run on the machine
    would wait forever. A lock no process holds open, seen twice a moment apart (a build
    that just finished closes it before removing it), is such a leftover."""
    def unheld() -> set[Path]:
        locks = {lock.resolve() for pattern in ("*/lock", "*/*/lock")
                 for lock in root.glob(pattern)}
        return locks - _open_files() if locks else set()

    first = unheld()
    if not first:
        return []
    time.sleep(0.5)
    return sorted(first & unheld())


def _open_files() -> set[Path]:
    """The files this machine's processes (those this user may look into) hold open."""
    held = set()
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fds.iterdir():
                held.add(Path(os.readlink(fd)))
        except OSError:  # gone meanwhile, or another user's
            continue
    return held


def clear_stale_build_locks() -> None:
    """Remove the leftover build locks (`stale_build_locks`) of this machine's extensions
    folder, saying so: the op is then built again, where it would have waited forever."""
    # torch's: never at this module's import (main loads torch with the collector off)
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    if not root.is_dir() or not Path("/proc/self/fd").is_dir():
        return
    for lock in stale_build_locks(root):
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            print(f"finetune-train: removed {lock}, left by a build of the op that was "
                  "stopped midway (no process holds it): the op is built again",
                  file=sys.stderr, flush=True)


def exit_code(exitcode: int) -> int:
    return exitcode if exitcode in PASSED_ON else exits.EXIT_FAILED


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def main(argv: list[str] | None = None) -> int:
    gc.disable()  # while torch imports: see finetune_trainer.__main__._import_training_stack
    # torch, here with the collector off; never at this module's import
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    gc.freeze()
    gc.enable()

    args = parse_args(sys.argv[1:] if argv is None else argv)
    clear_stale_build_locks()
    try:
        run(args)
    except ChildFailedError as error:
        rank = first_cause(error.failures)
        failure = error.failures[rank]
        line = failure_line(rank, failure.exitcode, failure.message)
        print(f"finetune-train: {line}", file=sys.stderr, flush=True)
        errors.termination_message(line)
        return exit_code(failure.exitcode)
    except SignalException as error:
        return 128 + int(error.sigval)
    finally:
        # The training stack leaves ~2,000 modules and millions of objects that the
        # interpreter's teardown would sweep for about a second per process (each worker, the
        # preflight): frozen, the collector skips them and the OS takes the memory back.
        # Exit handlers and the module teardown still run.
        gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
