"""`finetune validate --data`: a job's model and data read on this machine as each worker
reads them before it trains (the trainer's `--preflight`: the tokenizer, every record, the
objective's rules), in one process of its own, on no GPU, writing nothing. What an upload
to a hosted fine-tuning service checks before it accepts a training file; here without
starting a run."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from finetune_operator.api import FineTuneJob
from finetune_operator.local.config import local_config, write_config
from finetune_operator.local.processes import worker_env
from finetune_operator.validation import InvalidJobError, Problem
from finetune_trainer.exits import EXIT_BAD_INPUT, EXIT_SETUP

_SAID = "preflight: "
_REFUSED = "finetune-train: "


@dataclass(frozen=True)
class DataCheck:
    said: tuple[str, ...] = ()
    """What the check found (`57 training records (16 sequences), 7 eval records (3
    sequences); ...`), when it passed."""
    problems: tuple[Problem, ...] = ()
    """Why the model or the data cannot be trained on, or why they could not be read here."""


def check_data(job: FineTuneJob, base_dir: Path) -> DataCheck:
    """The trainer's own checks of `job`'s model and data, their paths opened as `finetune
    run` opens them (relative ones from `base_dir`, the manifest's folder)."""
    try:
        config, _ = local_config(job, base_dir)
    except InvalidJobError as error:  # a claim or Azure ML: on the cluster only
        return DataCheck(problems=tuple(
            Problem(p.path, p.message, "--data reads what this machine can open; the workers "
                    "check the rest when they start", severity="warning")
            for p in error.problems))
    with tempfile.TemporaryDirectory(prefix="finetune-data-check-") as scratch:
        path = write_config(config, Path(scratch))  # as `finetune run` writes it
        done = subprocess.run(
            [sys.executable, "-m", "finetune_trainer", "--config", str(path), "--base-dir",
             str(base_dir), "--preflight"], capture_output=True, text=True, errors="replace",
            env=worker_env(1, verbose=False, on_gpus=False), check=False)
    if done.returncode == 0:
        return DataCheck(said=tuple(line.removeprefix(_SAID)
                                    for line in done.stdout.splitlines()
                                    if line.startswith(_SAID)))
    return DataCheck(problems=(refusal(done.returncode, done.stderr),))


def refusal(code: int, stderr: str) -> Problem:
    """The trainer's one-line reason (`WHERE: what — fix`) as a problem; for a failure that
    is not a refusal of the input, what the check could not do and its last words."""
    reasons = [line.removeprefix(_REFUSED) for line in stderr.splitlines()
               if line.startswith(_REFUSED)]
    last = reasons[-1] if reasons else next(
        (line for line in reversed(stderr.splitlines()) if line.strip()), f"exit {code}")
    if code == EXIT_BAD_INPUT and reasons:
        said, dash, fix = last.rpartition(" — ")
        if not dash:
            said, fix = last, "fix the model or the data it names"
        where, colon, what = said.partition(": ")
        return Problem(where, what, fix) if colon else Problem("spec", said, fix)
    if code == EXIT_SETUP:
        return Problem("--data", f"the trainer cannot start here: {last}",
                       "install the trainer's packages beside the operator's "
                       "(pip install 'finetune-operator[trainer]')")
    return Problem("--data", f"the check failed (exit {code}): {last}",
                   "`finetune run` of the job shows the trainer's whole traceback")
