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
from finetune_operator.kube import Kube, connect
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import parse_job
from tests.conftest import minimal_job

ASYNC_METHODS = ("launch", "observe", "suspend", "resume", "restart", "cancel")
CONTEXT = BackendContext(settings=OperatorSettings(), kube=Kube(connect("http://127.0.0.1:9")))
BACKENDS = load_backends(CONTEXT)


def test_the_kubernetes_backend_is_registered_by_entry_point():
    assert "kubernetes" in {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert "kubernetes" in installed_names()


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_conforms(name):
    backend = BACKENDS[name]
    assert isinstance(backend, Backend)
    assert backend.name == name
    for method in ASYNC_METHODS:
        assert inspect.iscoroutinefunction(getattr(backend, method)), method
    job = parse_job(minimal_job(backend=name))
    assert backend.validate(job) == []
    assert backend.render(job), "render shows what launch creates"
    problems = backend.validate(parse_job(minimal_job(backend=name,
                                                      dataset={"uri": "./local.jsonl"})))
    assert problems and all(p.path and p.fix for p in problems)
