"""#62: an import inside a function says why it waits. Deferred, an import is a cost moved
from every start of a light process to the call that needs it: in the operator, from
`finetune validate` and `--help`; in the trainer, torch kept out of what the operator
imports and of the pods' light init containers, deepspeed and peft out of the jobs that do
not use them. Or it is a package that may be missing (azure-ai-ml, the optional `azure`
extra; a module only some torch releases have). Without a reason on its line it is only a
hidden edge of the import graph; a module that only a training process loads imports torch
at its top.

The reason is a comment on the import's first line, on the line above it, or on any line of
the block of imports it starts (one comment may speak for the imports that follow it)."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

PACKAGES = [REPO / "operator" / "finetune_operator", REPO / "trainer" / "finetune_trainer"]


def _blocks(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[list[ast.stmt]]:
    """The function's imports (its nested blocks' too, not its nested functions'), in runs
    of consecutive statements."""
    runs: list[list[ast.stmt]] = []

    def walk(body: list[ast.stmt]) -> None:
        run: list[ast.stmt] = []
        for statement in body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                run.append(statement)
                continue
            if run:
                runs.append(run)
                run = []
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # its own imports are its own
            for field in ("body", "orelse", "finalbody"):
                walk(getattr(statement, field, []))
            for handler in getattr(statement, "handlers", []):
                walk(handler.body)
        if run:
            runs.append(run)

    walk(function.body)
    return runs


def unexplained(source: str) -> list[tuple[int, str]]:
    """(line, text) of the first import of each block inside a function with no comment."""
    lines = source.splitlines()
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for block in _blocks(function):
            first, last = block[0].lineno, block[-1].end_lineno or block[-1].lineno
            said = lines[first - 2].strip().startswith("#") or any(
                "#" in line for line in lines[first - 1:last])
            if not said:
                found.append((first, lines[first - 1].strip()))
    return sorted(set(found))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda package: package.name)
def test_each_deferred_import_says_why(package):
    paths = sorted(package.rglob("*.py"))
    assert paths, f"{package} moved: point PACKAGES at it"
    found = [f"{path.relative_to(package)}:{line}: {text}" for path in paths
             for line, text in unexplained(path.read_text())]
    assert found == []


def test_an_import_without_its_reason_is_found():
    source = ("def plan():\n"
              "    # the planner's tables: only the command that plans loads them\n"
              "    from finetune_operator import planner\n"
              "    from finetune_operator.planner import report\n"
              "    if planner:\n"
              "        import yaml\n"
              "        return yaml\n"
              "    import optuna  # the sweeps' sampler: 0.3 s, only for a sweep\n"
              "    return report, optuna\n")
    assert unexplained(source) == [(6, "import yaml")]

