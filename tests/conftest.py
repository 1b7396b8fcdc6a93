"""Shared fixtures: the repository's examples, the generated CRD, and manifest builders.

Tests are grouped by the component they check (api, cli, backends, operator, planner,
trainer, metrics, install, code); what they need to run is their level, a marker set here
from the fixtures they use: `scenario` (the real operator against the emulator), `cluster`
(the real control plane), `kind` (a cluster of your own), `gpu`, and `unit` for the rest.
`pytest -m unit` is the quick loop; `make test` runs every level this machine can."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

# the real control plane's fixtures (control_plane, installation, operator_process, ...) and
# the emulated cluster's (cluster, kubelet, operator, rank0, testbed). They need the
# operator's stack; a GPU machine given only the trainer's wheels (scripts/gpu-wheels.sh)
# lacks it and runs the trainer's tests without them.
try:
    import kmock  # noqa: F401
    import kopf  # noqa: F401
    import pytest_asyncio  # noqa: F401

    pytest_plugins = ["tests.support.cluster_fixtures", "tests.support.operator_fixtures"]
except ImportError:
    pytest_plugins = []

LEVELS = ("unit", "scenario", "cluster", "kind", "gpu")
CLUSTER_FIXTURES = {"control_plane", "installation", "operator_process",
                    "control_plane_testbed"}
SCENARIO_FIXTURES = {"kmock", "cluster", "kubelet", "operator", "emulated_testbed"}
TESTBED_LEVELS = {"emulator": "scenario", "control-plane": "cluster", "kubeconfig": "kind"}


def level(item: pytest.Item) -> str:
    """What a test needs to run: a level it is marked with (a test that starts its own
    cluster says so), else what the fixtures it asks for need."""
    for marked in ("gpu", "kind", "cluster", "scenario"):
        if item.get_closest_marker(marked) is not None:
            return marked
    testbed = getattr(item, "callspec", None) and item.callspec.params.get("testbed")
    if testbed:
        return TESTBED_LEVELS[testbed]
    names = set(getattr(item, "fixturenames", ()))
    if names & CLUSTER_FIXTURES:
        return "cluster"
    return "scenario" if names & SCENARIO_FIXTURES else "unit"

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml")
                  if "kind: FineTuneJob" in p.read_text())
SWEEP_EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml")
                        if "kind: FineTuneSweep" in p.read_text())


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="session")
def committed_crd() -> dict[str, Any]:
    return load_yaml(REPO / "crds" / "finetunejobs.finetune.dev.yaml")


def minimal_job(**spec_overrides: Any) -> dict[str, Any]:
    """The smallest valid FineTuneJob; tests change one thing at a time."""
    job = {
        "apiVersion": "finetune.dev/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": "demo"},
        "spec": {
            "model": {"uri": "hf://Qwen/Qwen2.5-0.5B"},
            "dataset": {"uri": "pvc://data/train.jsonl"},
            "hyperparameters": {"maxSteps": 10},
            "output": {"uri": "pvc://ckpt/demo"},
        },
    }
    job["spec"].update(copy.deepcopy(spec_overrides))
    return job


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama and its tokenizer, saved with save_pretrained (nothing downloaded)."""
    from finetune_trainer.tiny import build_tiny_llama, corpus_from_jsonl

    out = tmp_path_factory.mktemp("tiny-llama")
    return build_tiny_llama(out, corpus_from_jsonl(REPO / "examples/data/tiny-chat.jsonl"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def pytest_collection_modifyitems(config, items):
    """Each test gets its level marker; GPU tests skip cleanly where no CUDA device is
    visible, kind tests without a cluster."""
    import os

    gpu = None
    for item in items:
        item.add_marker(getattr(pytest.mark, level(item)))
        if item.get_closest_marker("gpu") is not None:
            if gpu is None:
                import torch

                gpu = torch.cuda.is_available()
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible"))
        if item.get_closest_marker("kind") is not None and not os.environ.get("KUBECONFIG"):
            item.add_marker(pytest.mark.skip(
                reason="needs a real cluster: set KUBECONFIG (kind cannot run without Docker)"))
