"""The import contracts `make test` enforces (lint-imports, pyproject.toml), shown to bite:
each plant below, in a scratch copy of the sources, breaks the contract it names (#16)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
TORCH_BAN = "The operator never imports the training stack"
LAYERS = "The operator's layers: each imports only the ones below it"
BACKENDS = "Backends do not import each other"


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
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _scratch(tmp_path_factory.mktemp("pristine"))


def test_the_sources_keep_every_contract(pristine):
    result = _lint(pristine)
    assert result.returncode == 0, result.stdout[-3000:]


PLANTS = [
    # torch reached only indirectly: the operator imports finetune_trainer.flops
    ("finetune_trainer/flops.py", "import torch", TORCH_BAN),
    ("finetune_operator/reconcile.py", "import finetune_operator.controller", LAYERS),
    ("finetune_operator/validation.py", "import finetune_operator.backends", LAYERS),
    ("finetune_operator/backends/kubernetes.py", "import finetune_operator.backends.azureml",
     BACKENDS),
]


@pytest.mark.parametrize(("module", "line", "contract"), PLANTS,
                         ids=[f"{m}:{line}" for m, line, _ in PLANTS])
def test_a_planted_import_breaks_its_contract(tmp_path, module, line, contract):
    root = _scratch(tmp_path)
    path = root / module
    path.write_text(path.read_text() + f"\n{line}  # planted by the test\n")
    result = _lint(root)
    assert result.returncode != 0, f"{line} in {module} kept every contract"
    assert f"{contract} BROKEN" in result.stdout, result.stdout[-3000:]


def test_finetune_run_imports_no_kubernetes_client():
    """What `finetune run` imports to plan, configure, start and follow a local run needs
    no Kubernetes client: a GPU box with only the training stack (and kopf's ~0.5 s import
    spared on every run). `follow` imported `kube` for a type annotation."""
    code = ("import sys\n"
            "import finetune_operator.cli, finetune_operator.follow, finetune_operator.local\n"
            "import finetune_operator.planner, finetune_operator.trainer_config\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'kopf', 'kubernetes', 'aiohttp', 'optuna', 'azure'}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
