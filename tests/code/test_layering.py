"""The import contracts `make test` enforces (lint-imports, pyproject.toml), shown to bite:
each plant below, in a scratch copy of the sources, breaks the contract it names (#16)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support import waits

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
TORCH_BAN = "The operator never imports the training stack"
LAYERS = "The operator's layers: each imports only the ones below it"
BACKENDS = "Backends do not import each other"
TRAINER_PACKAGE = "Importing the trainer package imports no training stack"
TRAINER_LAYERS = "The trainer's layers: its entry points, its loop, then its components"


def _scratch(root: Path) -> Path:
    """The two packages and pyproject.toml, nothing else: lint-imports run there with that
    folder first on the path reads the copy, not the installed sources."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "operator" / "finetune_operator", root / "finetune_operator",
                    ignore=ignore)
    shutil.copytree(REPO / "trainer" / "finetune_trainer", root / "finetune_trainer",
                    ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=waits.seconds_left())


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _scratch(tmp_path_factory.mktemp("pristine"))


@pytest.mark.process
def test_the_sources_keep_every_contract(pristine):
    result = _lint(pristine)
    assert result.returncode == 0, result.stdout[-3000:]


PLANTS = [
    # torch reached only indirectly: the operator imports finetune_trainer.flops
    ("finetune_trainer/flops.py", "import torch", TORCH_BAN),
    # the package the operator's imports of trainer modules run first (passed unseen once)
    ("finetune_trainer/__init__.py", "import torch", TRAINER_PACKAGE),
    ("finetune_operator/reconcile.py", "import finetune_operator.controller", LAYERS),
    ("finetune_operator/validation.py", "import finetune_operator.backends", LAYERS),
    ("finetune_operator/backends/kubernetes/backend.py",
     "import finetune_operator.backends.azureml", BACKENDS),
    # a component importing the loop it is a part of (a function-level import counts)
    ("finetune_trainer/checkpoint.py", "def _planted():\n    import finetune_trainer.train",
     TRAINER_LAYERS),
]


@pytest.mark.process
@pytest.mark.parametrize(("module", "line", "contract"), PLANTS,
                         ids=[f"{m}:{line}" for m, line, _ in PLANTS])
def test_a_planted_import_breaks_its_contract(tmp_path, module, line, contract):
    root = _scratch(tmp_path)
    path = root / module
    path.write_text(path.read_text() + f"\n{line}  # planted by the test\n")
    result = _lint(root)
    assert result.returncode != 0, f"{line} in {module} kept every contract"
    assert f"{contract} BROKEN" in result.stdout, result.stdout[-3000:]


CYCLES = """
import sys
import grimp
graph = grimp.build_graph("finetune_operator", "finetune_trainer",
                          exclude_type_checking_imports=True, cache_dir=None)
modules = set(graph.modules)
edges = {m: set(graph.find_modules_directly_imported_by(m)) & modules for m in modules}
index, low, stack, on_stack, cycles = {}, {}, [], set(), []
sys.setrecursionlimit(10_000)

def visit(module):  # Tarjan: each strongly connected component of more than one module
    index[module] = low[module] = len(index)
    stack.append(module)
    on_stack.add(module)
    for other in edges[module]:
        if other not in index:
            visit(other)
            low[module] = min(low[module], low[other])
        elif other in on_stack:
            low[module] = min(low[module], index[other])
    if low[module] == index[module]:
        component = []
        while not component or component[-1] != module:
            component.append(stack.pop())
            on_stack.discard(component[-1])
        if len(component) > 1:
            cycles.append(" <-> ".join(sorted(component)))

for module in sorted(modules):
    if module not in index:
        visit(module)
print("\\n".join(sorted(cycles)))
"""


def import_cycles(root: Path) -> list[str]:
    """The circles of the import graph of the packages under `root`: every import counted,
    those inside functions too (they run, only later), but for `if TYPE_CHECKING:` ones
    (annotations: nothing runs them). grimp is the graph import-linter reads."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-c", CYCLES], cwd=root, env=env,
                            capture_output=True, text=True, timeout=waits.seconds_left())
    assert result.returncode == 0, result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if line]


@pytest.mark.process
def test_no_import_goes_round_in_a_circle(pristine):
    """#62: a function-level import kept out of the layers' sight (`errors` <-> `tracking`,
    `planner.plan` -> `validation`) was a circle all the same."""
    assert import_cycles(pristine) == []


@pytest.mark.process
def test_a_function_level_import_that_closes_a_circle_is_found(tmp_path):
    root = _scratch(tmp_path)
    path = root / "finetune_trainer" / "layout.py"
    path.write_text(path.read_text() + "\n\ndef _planted():\n"
                    "    from finetune_trainer import train  # planted by the test\n")
    assert any("finetune_trainer.layout" in cycle for cycle in import_cycles(root))


@pytest.mark.process
def test_the_gpu_session_runs_the_gpu_tests_with_the_training_stack_alone(tmp_path):
    """`scripts/gpu-session.sh tests` on a GPU box given only the trainer's wheels: the
    shared conftest loaded the cluster fixtures, which import kopf, kmock and pytest-asyncio,
    so pytest stopped there before collecting anything. Here the GPU tests skip (no GPU);
    `finetune run` itself with that stack: test_local_machine.py's
    test_the_training_stack_alone_plans_runs_and_follows_a_job."""
    site = tmp_path / "site"  # the wheels' folder, installed already (this venv has them)
    site.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests/support/training_stack_only"),
           "PY": sys.executable, "OUT": str(tmp_path / "out"), "FINETUNE_SITE": str(site),
           "FINETUNE_SCRATCH": str(tmp_path / "scratch")}
    script = str(REPO / "scripts/gpu-session.sh")
    result = subprocess.run(["bash", script, "tests"], env=env, capture_output=True,
                            text=True, timeout=waits.seconds_left())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = (tmp_path / "out" / "tests.txt").read_text()
    assert re.search(r"\b\d+ skipped\b", said) and " error" not in said, said
    assert "torch" in (tmp_path / "out" / "machine.txt").read_text()
    wrong = subprocess.run(["bash", script, "train"], env=env, capture_output=True, text=True)
    assert wrong.returncode == 2 and "unknown step train" in wrong.stderr
