"""Shared fixtures: the repository's examples, the generated CRD, and manifest builders."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

# the real control plane's fixtures (control_plane, installation, operator_process, ...)
pytest_plugins = ["tests.controlplane.fixtures"]

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


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
    """GPU tests skip cleanly where no CUDA device is visible; kind tests without a cluster."""
    import os

    gpu = None
    for item in items:
        if "gpu" in item.keywords:
            if gpu is None:
                import torch

                gpu = torch.cuda.is_available()
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible"))
        if "kind" in item.keywords and not os.environ.get("KUBECONFIG"):
            item.add_marker(pytest.mark.skip(
                reason="needs a real cluster: set KUBECONFIG (kind cannot run without Docker)"))
