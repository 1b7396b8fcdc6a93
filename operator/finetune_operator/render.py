"""FineTuneJob → the objects its backend creates, offline (`finetune render`).

The backend is found through the same plugin registry the operator uses; only its pure
parts (validate, render) are called, so no cluster is needed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from finetune_operator.api import FineTuneJob
from finetune_operator.backends import Backend, BackendContext, load_backends
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import Problem, check_document, relative_locations


def _backend(job: FineTuneJob, settings: OperatorSettings | None = None) -> Backend | None:
    context = BackendContext(settings=settings or OperatorSettings.from_env())
    return load_backends(context).get(job.spec.backend)


def backend_problems(job: FineTuneJob) -> list[Problem]:
    """What the job's backend refuses (the operator reports these as Validated=False)."""
    backend = _backend(job)
    return backend.validate(job) if backend is not None else []


def check_for_backend(doc: Any) -> tuple[FineTuneJob | None, list[Problem]]:
    """Every problem with one manifest that the operator reports as Validated=False, found
    offline: the API's rules (`check_document`) and, for a job that passes them, what its
    backend refuses. `finetune validate` and `finetune render` both answer with these, so
    validate never accepts what render, or the cluster, refuses. A backend's refusal of a
    relative path is `cluster_only`: validation warns already that those paths are for
    `finetune run` on one machine."""
    job, problems = check_document(doc)
    if job is None or any(p.severity == "error" for p in problems):
        return job, problems
    relative = set(relative_locations(job))
    return job, problems + [replace(p, cluster_only=True) if p.path in relative else p
                            for p in backend_problems(job)]


def render(job: FineTuneJob, settings: OperatorSettings | None = None) -> list[dict[str, Any]]:
    """The objects the job's backend would create, in creation order."""
    backend = _backend(job, settings)
    if backend is None:  # validation refuses names no entry point declares
        raise ValueError(f"spec.backend: {job.spec.backend!r} is not installed")
    return backend.render(job)
