"""How a worker ends, as every reader of it spells it: the exit codes (the trainer, its
launcher, `finetune run`, the operator's backends) and where the termination message goes.
A leaf: it imports nothing, so the modules that raise, record and report (errors, tracking,
record) all read it without reading each other."""

from __future__ import annotations

import re

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NETWORK = 3
EXIT_OTHER_CHECKPOINTS = 4
EXIT_SETUP = 5
"""The worker could not set itself up in this image (`setup_failure`): an import that fails,
an op that DeepSpeed or torch cannot build or load. The same on every rank and every attempt
until the image changes: restarted once at most (the operator, `finetune run`)."""
STOPPED = 143  # 128 + SIGTERM: what Kubernetes and torchrun expect after SIGTERM
NOT_RESTARTED = (EXIT_BAD_INPUT, EXIT_OTHER_CHECKPOINTS)
"""Refusals no attempt would change: the model or the data, another training's
checkpoints or model in the output folder. Every launcher ends the job on them at once."""

TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LIMIT = 4000
"""The most of a termination message written (the kubelet keeps 4096 bytes)."""
TERMINATION_LOG_ENV = "FINETUNE_TERMINATION_LOG"
"""The container's `terminationMessagePath`, which the operator's pod spec sets beside it
(the kubelet's default, TERMINATION_LOG, where it is unset)."""

LOST_PEER = re.compile(r"closed by peer|reset by peer|Broken pipe|remote worker|"
                       r"NCCL communicator was aborted|ProcessGroupNCCL.*[Ww]atchdog")
"""gloo's and NCCL's words when another rank stopped answering (torch 2.13: "Connection
closed by peer ... This is typically caused by a remote worker crashing"): such a rank
failed because another one went, and that one's own failure says why (the launcher and the
operator both name it first)."""
