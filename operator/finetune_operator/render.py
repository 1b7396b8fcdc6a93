"""FineTuneJob → the objects its backend creates, offline (`finetune render`).

The backend is found through the same plugin registry the operator uses; only its pure
parts (validate, render) are called, so no cluster is needed.
"""

from __future__ import annotations

from typing import Any

from finetune_operator.api import FineTuneJob
from finetune_operator.backends import Backend, BackendContext, load_backends
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import Problem


def _backend(job: FineTuneJob, settings: OperatorSettings | None = None) -> Backend | None:
    context = BackendContext(settings=settings or OperatorSettings.from_env())
    return load_backends(context).get(job.spec.backend)


def backend_problems(job: FineTuneJob) -> list[Problem]:
    """What the job's backend refuses (the operator reports these as Validated=False)."""
    backend = _backend(job)
    return backend.validate(job) if backend is not None else []


def render(job: FineTuneJob, settings: OperatorSettings | None = None) -> list[dict[str, Any]]:
    """The objects the job's backend would create, in creation order."""
    backend = _backend(job, settings)
    if backend is None:  # validation refuses names no entry point declares
        raise ValueError(f"spec.backend: {job.spec.backend!r} is not installed")
    return backend.render(job)
