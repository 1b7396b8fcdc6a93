"""GRPO's rewards: the verifiable ones the trainer ships, a user's own `module:function`, and
the checks that stop a run on a bad one with its name and the fix.

Every reward is called as TRL calls its reward functions, keyword arguments only:
`prompts`, `completions` (text, or for chat prompts `[{"role": "assistant", "content":
...}]`), `completion_ids`, and each other column of the data as a list, one entry per
completion. It returns a float per completion, or None where it does not apply (counted as
no reward in the weighted sum, as TRL's NaN). Torch-free.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_trainer.data_files import DataError
from finetune_trainer.objectives.grpo.settings import RewardConfig


class RewardError(DataError):
    """A reward that cannot score a step's completions: the run stops (bad input, not
    restarted), its checkpoints kept."""

    def __init__(self, name: str, problem: str, fix: str) -> None:
        super().__init__(f"spec.objective.grpo.rewards {name}", problem, fix)
        self.name = name


_NOT_USERS = tuple(dict.fromkeys(os.path.join(folder, "") for folder in (
    str(Path(__file__).parents[2]), *(sysconfig.get_paths()[k] for k in (
        "stdlib", "platstdlib", "purelib", "platlib")))))
"""Where no user's code lives: the trainer's package, the standard library, the installed
packages (a reward module installed there is still found by its own file)."""


def users_line(error: BaseException, own_file: str | None = None) -> str | None:
    """`file:line` in the user's code where `error` arose, where its fix is: a SyntaxError's
    own place, else the deepest frame of its traceback in `own_file` (the reward's module)
    or in any file outside the trainer, the standard library and the installed packages
    (not numpy's line the user's call failed in). None where no frame is the user's."""
    if isinstance(error, SyntaxError) and error.filename and not error.filename.startswith(
            "<"):
        return f"{error.filename}:{error.lineno}"
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename == own_file or not frame.filename.startswith(("<", *_NOT_USERS)):
            return f"{frame.filename}:{frame.lineno}"
    return None


def completion_text(completion: Any) -> str:
    """A completion as text: chat completions are a list holding the assistant's message."""
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion)
    return str(completion)


def exact_match(completions, column: str, pattern: str | None, **columns) -> list[float]:
    """1 where the completion's answer equals the record's `column`, both stripped."""
    found = re.compile(pattern, re.DOTALL) if pattern else None
    out = []
    for completion, answer in zip(completions, _column(columns, column), strict=True):
        text = completion_text(completion)
        if found is not None:
            matches = list(found.finditer(text))
            text = (matches[-1].group(1) if found.groups else matches[-1].group(0)) if (
                matches) else None
        out.append(float(text is not None and text.strip() == str(answer).strip()))
    return out


def format_match(completions, pattern: str, **_) -> list[float]:
    """1 where the whole completion matches `pattern`."""
    whole = re.compile(pattern, re.DOTALL)
    return [float(whole.fullmatch(completion_text(c)) is not None) for c in completions]


def math_equal(completions, column: str, **columns) -> list[float | None]:
    """1 where the completion's last answer is mathematically the record's `column`
    (math-verify: numbers, fractions, sets, LaTeX), else 0; None where the reference answer
    itself cannot be read."""
    from math_verify import parse, verify  # its parsers: only jobs with this reward load it

    out: list[float | None] = []
    for completion, answer in zip(completions, _column(columns, column), strict=True):
        gold = parse(str(answer))
        if not gold:
            out.append(None)
            continue
        out.append(float(verify(gold, parse(completion_text(completion)))))
    return out


def length_penalty(completion_ids, max_length: int, window: int, **_) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to `max_length - window` tokens, then linearly
    down to -1 at `max_length`."""
    free = max_length - window
    return [min(0.0, (free - len(ids)) / window) for ids in completion_ids]


def _column(columns: dict[str, list], column: str) -> list:
    if column not in columns:
        raise RewardError(column, f"the data has no column {column!r} (its columns: "
                          f"{', '.join(sorted(columns)) or 'prompt only'})",
                          "name the answers' column in the reward's `column`")
    return columns[column]


@dataclass(frozen=True)
class Reward:
    """One configured reward, ready to call."""

    name: str
    weight: float
    function: Callable[..., Sequence[float | None]]
    settings: dict[str, Any]
    """Keyword arguments of a built-in beside TRL's (`column`, `pattern`, ...)."""

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]],
              columns: dict[str, list]) -> list[float]:
        """One float per completion (NaN where it returned None); a reward that raises,
        answers for another number of completions, or returns NaN or a non-number stops
        the run here, named."""
        try:
            values = self.function(prompts=prompts, completions=completions,
                                   completion_ids=completion_ids, **columns, **self.settings)
        except RewardError:
            raise
        except Exception as error:
            where = users_line(error, getattr(getattr(self.function, "__code__", None),
                                              "co_filename", None))
            raise RewardError(self.name, f"raised {type(error).__name__}: {error}"
                              + (f" at {where}" if where else ""),
                              (f"fix {where}, so that it returns" if where else "make it "
                               "return") + " a float (or None) for every completion; it is "
                              "called as TRL calls reward functions, with keyword arguments "
                              "prompts, completions, completion_ids and one per data "
                              "column") from error
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
            raise RewardError(self.name, f"returned {type(values).__name__}, not a list",
                              "return a list with one float (or None) per completion")
        if len(values) != len(completions):
            raise RewardError(self.name, f"returned {len(values)} values for "
                              f"{len(completions)} completions",
                              "return one float (or None) per completion, in order")
        out = []
        for index, value in enumerate(values):
            if value is None:
                out.append(math.nan)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                try:
                    value = float(value)  # a numpy or torch scalar
                except (TypeError, ValueError):
                    raise RewardError(self.name, f"returned {value!r} for completion {index}",
                                      "return a float, or None where it does not apply"
                                      ) from None
            if not math.isfinite(value):
                raise RewardError(self.name, f"returned {value} for completion {index}",
                                  "return a finite float, or None where the reward does not "
                                  "apply")
            out.append(float(value))
        return out


def built_in(config: RewardConfig, max_completion_length: int) -> Reward | None:
    """A built-in reward by its name; None for a user's `module:function`."""
    if config.name == "exact_match":
        return Reward(config.name, config.weight, exact_match,
                      {"column": config.column, "pattern": config.pattern})
    if config.name == "format":
        return Reward(config.name, config.weight, format_match, {"pattern": config.pattern})
    if config.name == "math_equal":
        try:
            importlib.import_module("math_verify")
        except ImportError as error:
            raise RewardError(config.name, "needs the math-verify package, which this "
                              "trainer's Python lacks", "pip install math-verify (the "
                              "trainer image has it)") from error
        return Reward(config.name, config.weight, math_equal, {"column": config.column})
    if config.name == "length_penalty":
        window = config.window or max(1, max_completion_length // 4)
        if window > max_completion_length:
            raise RewardError(config.name, f"its window {window} is longer than "
                              f"maxCompletionLength {max_completion_length}",
                              "set `window` to at most maxCompletionLength")
        return Reward(config.name, config.weight, length_penalty,
                      {"max_length": max_completion_length, "window": window})
    return None


def users_own(config: RewardConfig, search: Sequence[Path]) -> Reward:
    """A user's `module:function`, imported with `search` (the data's folder) ahead on the
    module path."""
    module_name, _, function_name = config.name.partition(":")
    folders = [str(folder) for folder in search if folder.is_dir()]
    sys.path[:0] = [folder for folder in folders if folder not in sys.path]
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise not_imported(config.name, module_name, folders, error) from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(config.name, f"module {module_name} ({module.__file__}) has no "
                          f"function {function_name}", "name a function the module defines")
    return Reward(config.name, config.weight, function, {})


def not_imported(name: str, module_name: str, folders: Sequence[str],
                 error: Exception) -> RewardError:
    """Why a user's module did not import, with the fix its cause needs: one not found is
    shipped beside the data or put on the trainer's Python path (the same words for `finetune
    run` and a pod: the trainer cannot tell them apart); one found whose own code failed
    (a SyntaxError, an exception at its top level, a package it imports missing) is fixed at
    its line."""
    if isinstance(error, ModuleNotFoundError) and error.name is not None and (
            module_name == error.name or module_name.startswith(f"{error.name}.")):
        file = f"{module_name.replace('.', '/')}.py"
        looked = f"in {', '.join(folders)} nor " if folders else ""
        return RewardError(name, f"module {module_name} cannot be imported: no {file} "
                           f"{looked}on the trainer's Python path", (
                               f"ship {file} beside the data (the job's dataset folder), or "
                               "on the trainer's Python path") if folders else (
                               f"put {file} on the trainer's Python path (this job's data "
                               "has no folder to ship it beside)"))
    where = users_line(error, _module_file(module_name))
    said = error.msg if isinstance(error, SyntaxError) else str(error)
    fix = f"fix {where}" if where else f"fix module {module_name}'s own code"
    if isinstance(error, ModuleNotFoundError) and error.name:
        fix = f"install {error.name} on the trainer's Python path, or {fix}"
    return RewardError(name, f"module {module_name} cannot be imported: "
                       f"{type(error).__name__}: {said}" + (f" at {where}" if where else ""),
                       fix)


def _module_file(module_name: str) -> str | None:
    """The file a module that failed to run was found in (None where that is unknown)."""
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception:  # a parent package that fails to import as well
        return None
    return spec.origin if spec is not None else None


def load_rewards(configs: Sequence[RewardConfig], max_completion_length: int,
                 search: Sequence[Path]) -> list[Reward]:
    """Every configured reward, imported: before any rank joins, so a missing module or
    package stops the run before it starts."""
    return [built_in(config, max_completion_length) or users_own(config, search)
            for config in configs]
