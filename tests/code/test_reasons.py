"""#62: the condition types and reasons the operator writes are spelled once, in
`finetune_operator/reasons.py`; no other module of the operator writes one as a bare string.
A literal elsewhere is a spelling the enum, the troubleshooting page and its test cannot see.

Read with `ast`: every string constant of the operator's modules, docstrings and the text
of f-strings aside (messages may name a reason for people to read)."""

from __future__ import annotations

import ast
from enum import StrEnum
from pathlib import Path

import pytest

from finetune_operator import reasons
from finetune_operator.api import Phase, TrialPhase
from tests.conftest import REPO

pytestmark = pytest.mark.unit

PACKAGE = REPO / "operator" / "finetune_operator"
VOCABULARY = PACKAGE / "reasons.py"

OTHERS_WORDS = {
    # the phases: a Literal of the API (api.Phase), spelled where they are compared
    **{phase: "a FineTuneJob's phase (api.Phase)" for phase in Phase.__args__},
    **{phase: "a trial's phase (api.TrialPhase)" for phase in TrialPhase.__args__},
    "Unknown": "a condition's status (True, False or Unknown), besides Feasible's reason",
}
"""Words that are also a reason of ours but mean something else where they are written."""

ALLOWED_IN = {
    ("backends/kubernetes/states.py", "Complete"): "a batch/v1 Job's condition type",
    ("backends/azureml/states.py", "Completed"): "an Azure ML job's state",
    ("backends/azureml/backend.py", "Completed"): "an Azure ML job's state",
}
"""(module, word): a word of another component's vocabulary written where it is read."""


def vocabulary() -> set[str]:
    enums = [value for value in vars(reasons).values()
             if isinstance(value, type) and issubclass(value, StrEnum) and value is not StrEnum]
    return {member.value for enum in enums for member in enum}


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the constants that are docstrings (a module's, a class's, a function's, and
    an attribute's: a string expression on its own line)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def literals(source: str, words: set[str]) -> list[tuple[int, str]]:
    """(line, word) of each string constant of `source` that is one of `words`."""
    tree = ast.parse(source)
    skip = _docstrings(tree) | {id(part) for node in ast.walk(tree)
                                if isinstance(node, ast.JoinedStr) for part in node.values}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in words and id(node) not in skip)


def spelled_outside(package: Path = PACKAGE) -> list[str]:
    words = vocabulary() - set(OTHERS_WORDS)
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == VOCABULARY:
            continue
        module = str(path.relative_to(package))
        found += [f"{module}:{line}: {word!r}" for line, word in literals(path.read_text(), words)
                  if (module, word) not in ALLOWED_IN]
    return found


def test_no_module_spells_a_reason_of_its_own():
    assert spelled_outside() == []


def test_a_planted_literal_is_found():
    planted = ('"""A docstring naming InvalidSpec is fine."""\n'
               'def look(b, seen):\n'
               '    b.cond(ConditionType.RUNNING, False, "WorkersWaiting", f"not {seen} '
               'InvalidSpec")\n'
               '    return seen.reason == "OutputInUse"\n')
    assert literals(planted, vocabulary()) == [(3, "WorkersWaiting"), (4, "OutputInUse")]


def test_others_words_are_still_words_of_ours():
    """An entry that no longer collides with the vocabulary is stale."""
    assert sorted(set(OTHERS_WORDS) - vocabulary() - set(Phase.__args__)
                  - set(TrialPhase.__args__)) == []
    assert sorted(word for _, word in ALLOWED_IN if word not in vocabulary()) == []
