"""Every installed backend plugin honours the Backend interface."""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points

import pytest

from finetune_operator.backends import (
    ENTRY_POINT_GROUP,
    Backend,
    BackendContext,
    installed_names,
    load_backends,
)
from finetune_operator.kube import Kube
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import parse_job
from tests.conftest import minimal_job

ASYNC_METHODS = ("launch", "observe", "suspend", "resume", "restart", "cancel")
PUSHED = "registry.example/finetune-trainer:1.2.3"
"""The trainer image the operator is given (its default is a placeholder: a warning)."""
CONTEXT = BackendContext(settings=OperatorSettings(trainer_image=PUSHED), kube=Kube())
BACKENDS = load_backends(CONTEXT)
# What each backend needs beyond the minimal job to run it at all.
RUNNABLE = {"azureml": {
    "azureml": {"subscriptionId": "00000000-0000-0000-0000-000000000000",
                "resourceGroup": "rg", "workspace": "ws", "compute": "gpu"},
    "dataset": {"uri": "azureml://datastores/blob/paths/train.jsonl"},
    "output": {"uri": "azureml://datastores/blob/paths/out"}}}


def test_the_built_in_backends_are_registered_by_entry_point():
    for name in ("kubernetes", "azureml"):
        assert name in {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
        assert name in installed_names()


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_conforms(name, monkeypatch):
    monkeypatch.setenv("FINETUNE_TRAINER_IMAGE", PUSHED)  # a backend reading the environment
    backend = BACKENDS[name]
    assert isinstance(backend, Backend)
    assert backend.name == name
    for method in ASYNC_METHODS:
        assert inspect.iscoroutinefunction(getattr(backend, method)), method
    needs = RUNNABLE.get(name, {})
    job = parse_job(minimal_job(backend=name, **needs))
    assert backend.validate(job) == []
    assert backend.render(job), "render shows what launch creates"
    assert all(isinstance(backend.mount(location), str) for location in job.spec.locations)
    problems = backend.validate(parse_job(minimal_job(backend=name, **{
        **needs, "dataset": {"uri": "./local.jsonl"}})))
    assert problems and all(p.path and p.fix for p in problems)
