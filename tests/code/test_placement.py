"""Whether a job's workers run on GPUs or on CPUs is decided once, by `Resources.on_gpus`
(api.py), and read everywhere else (#62): the planner, local runs, the renderers and the
validation rules used to re-derive it from `gpus_per_node` about twenty times, in seven
files, each a place for the answer to drift."""

from __future__ import annotations

import ast

from tests.conftest import REPO

PACKAGE = REPO / "operator" / "finetune_operator"
DECIDES = PACKAGE / "api.py"


def decisions_on_gpu_count(source: str) -> list[int]:
    """The lines that decide CPU or GPU from a GPU count: `gpus_per_node` (or
    `gpusPerNode`) as a condition, negated, made a bool, in `and`/`or`, or compared with
    0."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def is_count(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "gpus_per_node") or (
            isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and node.slice.value == "gpusPerNode")

    found = []
    for node in ast.walk(tree):
        if not is_count(node):
            continue
        parent = parents.get(node)
        made_bool = isinstance(parent, ast.Call) and getattr(parent.func, "id", "") == "bool"
        tested = (isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert))
                  and parent.test is node)
        negated = isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)
        joined = isinstance(parent, ast.BoolOp)
        against_zero = isinstance(parent, ast.Compare) and any(
            isinstance(side, ast.Constant) and side.value == 0
            for side in (parent.left, *parent.comparators))
        if made_bool or tested or negated or joined or against_zero:
            found.append(node.lineno)
    return sorted(set(found))


def test_cpu_or_gpu_is_decided_in_one_place():
    found = {f"{path.relative_to(REPO)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != DECIDES
             for line in decisions_on_gpu_count(path.read_text())}
    assert not found, ("these decide CPU or GPU from the GPU count: read "
                       f"`spec.resources.on_gpus` instead: {sorted(found)}")


def test_the_guard_sees_each_way_of_deciding():
    planted = """
if r.gpus_per_node == 0: pass
if not r.gpus_per_node: pass
x = "GPU" if r.gpus_per_node else "CPU"
y = bool(r.gpus_per_node)
z = a and r.gpus_per_node
w = r.processes_per_node is not None and r.gpus_per_node > 0
v = doc["gpusPerNode"] == 0
count = r.nodes * r.gpus_per_node
limit = str(r.gpus_per_node)
"""
    assert decisions_on_gpu_count(planted) == [2, 3, 4, 5, 6, 7, 8]
