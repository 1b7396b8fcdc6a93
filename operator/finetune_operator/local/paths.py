"""The model, data and output paths a job names on this machine: which of them this machine
lacks or cannot use, said before anything starts or is written.

`finetune validate` warns of them (an absolute path may exist only in the job's image; a
relative one means this machine, so one not here is an error) and `finetune run` refuses
them. Apart from `local.config` (which brings the planner) so that `validate` reads them
without loading the planner.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from finetune_operator.validation import Problem, short_repr
from finetune_trainer import layout
from finetune_trainer.uris import DATA_FILE_BUILDERS, data_file_builder

if TYPE_CHECKING:
    from finetune_operator.api import FineTuneJob

SHOWN_WHOLE = 256
"""A path in a message is whole up to this many characters: one cut short cannot be copied
into the fix."""


def shown(path: Path) -> str:
    """A path in a message: whole up to SHOWN_WHOLE characters, quoted when it holds a line
    break or escapes, cut when it is longer."""
    text = str(path)
    return text if text.isprintable() and len(text) <= SHOWN_WHOLE else short_repr(text)


def local_path_problems(job: FineTuneJob, base_dir: Path, runs_here: bool = False
                        ) -> list[Problem]:
    """The model and dataset paths this machine can look at and does not have (or has as a
    folder that is no saved model, an empty data file). Errors for relative ones: they mean
    this machine (only `finetune run` reads them), so one not here is wrong wherever it is
    checked; warnings for absolute ones (they may exist only in the job's image), errors
    too where the job `runs_here` (`finetune run`): found before anything starts or is
    written."""
    problems = []
    demo = Path(layout.DEMO_MODEL).parts
    for is_model, location in (True, job.spec.model.location), (False,
                                                                job.spec.dataset.location):
        scheme = location.scheme
        if scheme not in ("path", "relative"):
            continue
        where = base_dir / location.raw if scheme == "relative" else Path(location.raw)
        try:
            why, fix = unusable(where, is_model)
        except OSError as error:  # a name too long for this filesystem, a loop of links
            why, fix = f"cannot be looked at on this machine ({error.strerror})", None
        if why is None:
            continue
        if fix is None and is_model and Path(os.path.normpath(where)).parts[
                -len(demo):] == demo:  # examples 01 and 08, before `make demo` built it
            fix = ("run `make demo` first: it builds the tiny model these examples use "
                   f"({layout.DEMO_MODEL})")
        if fix is None:
            fix = "fix the path (relative paths start at the manifest's folder)"
            if runs_here:
                fix += ": `finetune run` reads it on this machine"
        if not runs_here and scheme == "path":
            fix += "; ignore this if it is right where the job runs (inside its image)"
        problems.append(Problem(location.field, f"{shown(where)} {why}", fix, severity=(
            "error" if runs_here or scheme == "relative" else "warning")))
    output = job.spec.output.location
    if runs_here and output.scheme in ("path", "relative"):
        where = base_dir / output.raw if output.scheme == "relative" else Path(output.raw)
        if why := unwritable(where):
            problems.append(Problem(output.field, f"{shown(where)} {why}",
                                    "point spec.output.uri at a folder this user can write "
                                    "(it is created if missing)"))
    return problems


def unusable(where: Path, is_model: bool) -> tuple[str | None, str | None]:
    """(what is wrong, its fix or None for the path's) of a local model or data path."""
    saved_model = ("point it at a folder written by save_pretrained (config.json and the "
                   "weights)")
    if not where.exists():
        return "does not exist on this machine", None
    if not os.access(where, os.R_OK | (os.X_OK if where.is_dir() else 0)):
        return ("cannot be read by this user (permission denied)",
                "make it readable (chmod), or name another path")
    if is_model and not where.is_dir():
        return "is a file, not a model folder", saved_model
    if is_model and not (where / "config.json").is_file():
        if (where / "adapter_config.json").is_file():  # a LoRA job's export: SFT before DPO
            return layout.LORA_ADAPTER
        return "holds no config.json, so it is not a saved model", saved_model
    if is_model and not layout.holds_any(where, layout.SAVED_WEIGHTS):
        return (f"holds config.json but no weights ({', '.join(layout.SAVED_WEIGHTS)})",
                saved_model)
    if is_model and not layout.holds_any(where, layout.TOKENIZER_FILES):
        return (f"{layout.NO_TOKENIZER}, which the trainer reads from the model's folder",
                "save the model's tokenizer into it as well: "
                "tokenizer.save_pretrained(<the folder>)")
    if not is_model and where.is_file() and where.stat().st_size == 0:
        return "is empty", "write at least one record to it, or name another file"
    if not is_model:
        kinds = ", ".join(DATA_FILE_BUILDERS)
        if where.is_file() and data_file_builder(where.name) is None:
            return (f"has an extension the trainer does not read ({where.suffix or 'none'})",
                    f"save it as one of {kinds}")
        if where.is_dir() and not any(data_file_builder(f.name) for f in where.rglob("*")):
            return f"holds no data file ({kinds})", "point it at a data file or a folder of them"
    return None, None


def unwritable(where: Path) -> str | None:
    """Why `finetune run` could not write its output folder here, or None."""
    try:
        if where.exists() and not where.is_dir():
            return "is a file, not a folder"
        parent = where
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            return f"cannot be created: {shown(parent)} is a file"
        if not os.access(parent, os.W_OK | os.X_OK):
            return ("cannot be written by this user" if parent == where else
                    f"cannot be created: {shown(parent)} is not writable by this user")
    except OSError as error:
        return f"cannot be looked at on this machine ({error.strerror})"
    return None
