"""The `finetune` command: one module per command group, each thin (parse the options, call
the module that decides, print). `main` is defined in `group` and the command modules are
imported here, after it, only so that they register on it."""

from finetune_operator.cli import export, logs, operate, plan, run, status, validate
from finetune_operator.cli.group import EXIT_INVALID, main

__all__ = ["EXIT_INVALID", "export", "logs", "main", "operate", "plan", "run", "status",
           "validate"]
