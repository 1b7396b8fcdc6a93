"""How a worker ends: its exit codes, and the one line that says why, left where torchrun's
launcher (`finetune_trainer.launch`) and the kubelet read it. No torch import: the pods'
init containers use it too."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NETWORK = 3
EXIT_OTHER_CHECKPOINTS = 4
STOPPED = 143  # 128 + SIGTERM: what Kubernetes and torchrun expect after SIGTERM
NOT_RESTARTED = (EXIT_BAD_INPUT, EXIT_OTHER_CHECKPOINTS)
"""Refusals no attempt would change: the model or the data, another training's
checkpoints or model in the output folder. Every launcher ends the job on them at once."""

TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_ENV = "FINETUNE_TERMINATION_LOG"
"""The container's `terminationMessagePath`, which the operator's pod spec sets beside it
(the kubelet's default, TERMINATION_LOG, where it is unset)."""


def termination_message(text: str) -> None:
    """Where the kubelet reads how a container ended (`terminationMessagePath`): a
    failure's reason, or a finished run's final record, so the FineTuneJob's status says
    it in full; nothing happens outside a pod (no such file)."""
    path = Path(os.environ.get(TERMINATION_LOG_ENV) or TERMINATION_LOG)
    if path.exists():
        with contextlib.suppress(OSError):
            path.write_text(text[:4000])


def record_failure(text: str, code: int = EXIT_FAILED) -> None:
    """This worker's reason, where what started it reads it: the error file torchrun's
    agent gave it (TORCHELASTIC_ERROR_FILE, the plain-message form its ProcessFailure
    reads), from which the launcher names the first failed rank; inside Azure ML, which
    starts the workers itself, the job's run (`tracking.record_failure`)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps({"message": text, "timestamp": int(time.time())}))
    from finetune_trainer import tracking

    tracking.record_failure(text, code)


def failed(text: str, code: int, *, termination: bool = False) -> int:
    """Say why this process fails, on stderr and where it is read; `code`, to return."""
    print(f"finetune-train: {text}", file=sys.stderr, flush=True)
    record_failure(text, code)
    if termination:
        termination_message(text)
    return code
