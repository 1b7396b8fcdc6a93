"""FineTuneJob → the objects its backend creates, offline (`finetune render`).

The backend is found through the same plugin registry the operator uses; only its pure
parts (validate, render) are called, so no cluster is needed. What it may render is
`admission.admit`'s to say.
"""

from __future__ import annotations

from typing import Any

from finetune_operator.admission import offline_backends
from finetune_operator.api import FineTuneJob
from finetune_operator.settings import OperatorSettings


def render(job: FineTuneJob, settings: OperatorSettings | None = None) -> list[dict[str, Any]]:
    """The objects the job's backend would create, in creation order."""
    backend = offline_backends(settings).get(job.spec.backend)
    if backend is None:  # admission refuses names no entry point declares
        raise ValueError(f"spec.backend: {job.spec.backend!r} is not installed")
    return backend.render(job)
