"""Admission: whether a FineTuneJob may run, decided in one place.

The operator, `finetune validate`, `finetune render`, `finetune plan` and `finetune run`
all ask `admit`, so none accepts what another refuses: the manifest's rules (the API's,
`validation`, and each installed backend's of its own section, `backends.check_manifest`;
most compiled into the CRD too), whether the job's backend is there to run it, and that
backend's refusals of this job. Only the caller's backends differ: the ones the operator serves,
or every installed one offline (`offline_backends`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from finetune_operator.api import FineTuneJob
from finetune_operator.backends import (
    Backend,
    BackendContext,
    check_manifest,
    installed_names,
    load_backends,
)
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import (
    PUSH_THE_TRAINER_IMAGE,
    Problem,
    relative_locations,
)

Where = Literal["cluster", "here"]
"""cluster: the job runs on its backend (the operator, `validate`, `render`). here: on this
machine (`finetune run`, `finetune plan`): the backend's own rules and the rules that only
a cluster has do not apply, so its code is not loaded (a GPU box given only the training
stack has no Kubernetes client)."""


@dataclass(frozen=True)
class Admission:
    job: FineTuneJob | None
    """The parsed job; None when the document is not a FineTuneJob at all."""
    problems: list[Problem] = field(default_factory=list)
    """Every problem found, warnings included, each naming its field and the fix."""
    backend: Backend | None = None
    """The job's backend, where it is there (a job launched before its spec turned invalid
    still has workers to stop)."""

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def admitted(self) -> bool:
        return self.job is not None and not self.errors


def offline_backends(settings: OperatorSettings | None = None) -> dict[str, Backend]:
    """Every installed backend, built without a cluster: only validate and render work."""
    return load_backends(BackendContext(settings=settings or OperatorSettings.from_env()))


def admit(doc: Any, backends: Mapping[str, Backend], where: Where = "cluster") -> Admission:
    """Check one manifest (a parsed YAML/JSON document) for a run `where` it is meant to
    run, on one of `backends` (`here`: one of the installed backends' names, none loaded).
    A backend's refusal of a relative path is `cluster_only`: validation says already that
    those paths are for `finetune run` on one machine."""
    job, problems = check_manifest(doc)
    if where == "here":
        problems = [p for p in problems if not p.cluster_only]
        if job is not None and job.spec.backend not in installed_names():
            problems = [*problems, _not_there(job.spec.backend, installed_names())]
        return Admission(job, problems)
    if job is None:
        return Admission(job, problems)
    backend = backends.get(job.spec.backend)
    if backend is None:  # said with the API's own problems: every problem at once
        problems = [*problems, _not_there(job.spec.backend, backends)]
    if backend is None or any(p.severity == "error" for p in problems):
        return Admission(job, problems, backend)
    relative = set(relative_locations(job))
    refusals = [replace(p, cluster_only=True) if p.path in relative else p
                for p in backend.validate(job)]
    return Admission(job, problems + refusals, backend)


def said_by_validate(problems: list[Problem]) -> list[Problem]:
    """`admit`'s problems (`cluster`) as `finetune validate` says them: without a backend's
    refusal of a relative path (validation's own warning says once that those are for
    `finetune run`), nor the trainer image the operator's settings name (the cluster's, not
    this machine's: `finetune render` says it)."""
    return [p for p in problems if not (p.cluster_only and p.severity == "error")
            and PUSH_THE_TRAINER_IMAGE not in p.fix]


def _not_there(name: str, backends: Collection[str]) -> Problem:
    what = "is not served by this operator" if name in installed_names() else (
        "is not an installed backend")
    return Problem("spec.backend", f"{name!r} {what}", "use one of: " + ", ".join(
        sorted(backends)))
