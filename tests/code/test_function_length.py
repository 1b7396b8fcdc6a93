"""#16: no function in operator/ or trainer/ longer than 80 lines. Decision logic lives in
named pieces a reader can hold at once (reconcile's guards, one memory function per
strategy, the trainer's components); a long function is where the next change hides."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

LIMIT = 80


def long_functions(root: Path, limit: int = LIMIT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} "
                                 f"({lines} lines)")
    return found


def test_no_function_is_longer_than_80_lines():
    assert long_functions(REPO / "operator") + long_functions(REPO / "trainer") == []


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    (tmp_path / "short.py").write_text("def short():\n    return 1\n")
    assert [line.split()[1] for line in long_functions(tmp_path)] == ["long"]
