"""How a worker ends: the one line that says why, left where torchrun's launcher
(`finetune_trainer.launch`) and the kubelet read it (the exit codes: exits.py). No torch
import: the pods' init containers use it too."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

from finetune_trainer import tracking
from finetune_trainer.exits import (
    EXIT_FAILED,
    TERMINATION_LIMIT,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
)


def termination_message(text: str) -> None:
    """Where the kubelet reads how a container ended (`terminationMessagePath`): a
    failure's reason, or a finished run's final record, so the FineTuneJob's status says
    it in full; nothing happens outside a pod (no such file)."""
    path = Path(os.environ.get(TERMINATION_LOG_ENV) or TERMINATION_LOG)
    if path.exists():
        with contextlib.suppress(OSError):
            path.write_text(text[:TERMINATION_LIMIT])


def record_failure(text: str, code: int = EXIT_FAILED) -> None:
    """This worker's reason, where what started it reads it: the error file torchrun's
    agent gave it (TORCHELASTIC_ERROR_FILE, the plain-message form its ProcessFailure
    reads), from which the launcher names the first failed rank; inside Azure ML, which
    starts the workers itself, the job's run (`tracking.record_failure`)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps({"message": text, "timestamp": int(time.time())}))
    tracking.record_failure(text, code)


def failed(text: str, code: int, *, termination: bool = False) -> int:
    """Say why this process fails, on stderr and where it is read; `code`, to return."""
    print(f"finetune-train: {text}", file=sys.stderr, flush=True)
    record_failure(text, code)
    if termination:
        termination_message(text)
    return code


OP_BUILDERS = ("torch.utils.cpp_extension", "deepspeed.ops.op_builder")
"""The modules that compile and load C++/CUDA ops on first use (DeepSpeed's builders call
torch's): an error raised inside one is the op's, whichever op it is."""

_STEP = re.compile(r"^\[\d+/\d+\] ")
"""ninja's line before each command it runs (`[1/3] c++ -MMD ...`)."""
_BUILD_NOISE = re.compile(r"^(FAILED: |ninja: )")
_SAID = re.compile(r"error|not found|no such file|cannot|undefined", re.IGNORECASE)
_EXTENSION = re.compile(r"^Error building extension '([^']+)':?\s*")


def setup_failure(error: BaseException) -> str | None:
    """The one line that says what this image cannot do, when `error` is one (an
    ImportError, an op that cannot be built or loaded: EXIT_SETUP); None for anything
    else. For a failed build, the build's own error line (`/bin/sh: 1: c++: not found`, a
    compiler's `fatal error: ...`), not the start of the compiler's command line that the
    exception's message opens with."""
    chain = _chain(error)
    built_by = next((e for e in chain if _raised_in(e, OP_BUILDERS)), None)
    if built_by is not None:
        return _build_line(built_by)
    imported = next((e for e in chain if isinstance(e, ImportError)), None)
    if imported is not None:
        return f"{type(imported).__name__}: {imported} (an import this image cannot do)"
    return None


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _raised_in(error: BaseException, modules: tuple[str, ...]) -> bool:
    """A frame of `error`'s traceback runs code of one of `modules` (as imported here)."""
    files = set()
    for name in modules:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            files.add(str(Path(path).parent if path.endswith("__init__.py") else path))
    if not files:
        return False
    return any(frame.filename == f or frame.filename.startswith(f + os.sep)
               for frame in traceback.extract_tb(error.__traceback__) for f in files)


def _build_line(error: BaseException) -> str:
    """`op 'NAME' could not be built in this image: LINE (...)` for torch's `Error building
    extension 'NAME': <the build's output>`, LINE the output's first line that says what went
    wrong: neither a command ninja ran (nor its echo after `FAILED:`) nor ninja's own words.
    Any other error of the builders (DeepSpeed's `Unable to JIT load the async_io op ...`):
    its first line."""
    lines = [line.strip() for line in str(error).splitlines()] or [type(error).__name__]
    named = _EXTENSION.match(lines[0])
    if named is None:
        return f"{type(error).__name__}: {lines[0]} (an op this image cannot build or load)"
    output = [lines[0][named.end():], *lines[1:]]
    commands = {_STEP.sub("", line) for line in output if _STEP.match(line)}
    said = [line for line in output if line and not _STEP.match(line)
            and not _BUILD_NOISE.match(line) and line not in commands]
    line = next((s for s in said if _SAID.search(s)), said[0] if said else "no output")
    return (f"op {named[1]!r} could not be built in this image: {line} (DeepSpeed builds "
            "its ops on first use: prebuild it into the image, or use one that can build it)")
