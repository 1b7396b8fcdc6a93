"""Backend plugins: where a FineTuneJob runs.

A backend is a class with the `Backend` interface, found through the
`finetune_operator.backends` entry-point group: a plugin package adds one by declaring
`[project.entry-points."finetune_operator.backends"] name = "module:Class"`, without
touching this code. The class is built with a `BackendContext`.

What a backend says of a manifest before anything runs (its spec section, that section's
rules, where its logs are) is a `BackendRules` in a light module of its own, found through
the `finetune_operator.backend_rules` group under the same name: validating a manifest, on
a machine given only the training stack too, loads none of its clients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from finetune_operator.validation import CelRule, Problem, Rule, cel_rules, check_document

if TYPE_CHECKING:
    from finetune_operator.api import FineTuneJob
    from finetune_operator.kube import Kube
    from finetune_operator.reconcile import Observation
    from finetune_operator.settings import OperatorSettings
    from finetune_trainer.uris import Location

ENTRY_POINT_GROUP = "finetune_operator.backends"
RULES_ENTRY_POINT_GROUP = "finetune_operator.backend_rules"

# Backends this distribution ships whose implementation has not landed yet: manifests may
# name them (they validate), the operator reports them as not served.
PLANNED_BACKENDS: tuple[str, ...] = ()

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Kueue's queue label. The kubernetes backend puts it on the worker Job from
spec.kubernetes.queueName; on a FineTuneJob itself (where users of Kubeflow's TrainJob put
it) Kueue never reads it, so both backends' rules refuse it there, each with its fix."""


class BackendError(Exception):
    """A backend call failed in a way that may pass (throttling, an outage, a missing role
    or identity): the handler retries after `retry_after` seconds. The message says what
    happened and what to fix, for people; it never carries a credential."""

    def __init__(self, message: str, retry_after: float = 30.0):
        super().__init__(message)
        self.retry_after = retry_after


class LaunchBlocked(BackendError):
    """The job cannot launch until something its owner controls changes (an output claim
    that is not ReadWriteMany): it stays Pending, the message in its status and a Warning
    event, and is looked at again when it changes, or after `retry_after` seconds."""


@dataclass
class BackendContext:
    """What a backend gets from the operator."""

    settings: OperatorSettings
    kube: Kube | None = None
    """None offline (`finetune render`): only validate and render may be called."""
    progress_port: int | None = None
    """Where rank 0 serves /progress (tests); defaults to settings.metrics_port."""
    azure_credential: Any = None
    """azure-core TokenCredential of the azureml backend; None: DefaultAzureCredential
    (workload identity in the cluster)."""
    azure_transport: Any = None
    """azure-core HttpTransport of the azureml backend; None: the SDK's default (tests
    pass a fake that answers like Azure ML's REST API)."""


@runtime_checkable
class Backend(Protocol):
    """One place jobs run. Every method is idempotent: names derive from the job, so a
    repeated call finds what an earlier one made instead of making it twice."""

    name: str
    cleanup_on_delete: bool
    """True: the operator holds a finalizer on each job and calls `cancel` before the job
    goes (workers outside the cluster). False: the job's children are owned by it and the
    garbage collector removes them; `forget` is called once it is gone."""

    def mount(self, location: Location) -> str:
        """Where the workers open a model, dataset or output location (a mount path, a
        placeholder the trainer binds, or the URI as it is), or `Unreachable` saying what to
        write instead; the trainer config is built with it
        (`trainer_config.build_trainer_config`)."""

    def validate(self, job: FineTuneJob) -> list[Problem]:
        """What this backend cannot run (beyond the API's own rules), the locations `mount`
        cannot open among them (`trainer_config.unreachable_locations`)."""

    def render(self, job: FineTuneJob) -> list[dict[str, Any]]:
        """The objects `launch` creates, for `finetune render`."""

    def output_folder(self, job: FineTuneJob) -> str | None:
        """The folder the job's output lands in, as a key two jobs share exactly when they
        write one folder (`output_folders.folder_key`: a claim and its path in the
        namespace; a workspace's datastore and path); None where no other job can write it
        (a path on the worker's own disk). The operator launches one live job per folder."""

    async def launch(self, job: FineTuneJob) -> None:
        """Start the workers (or find them started)."""

    async def observe(self, job: FineTuneJob) -> Observation:
        """What the workers are doing now."""

    async def suspend(self, job: FineTuneJob) -> None:
        """Stop the workers after a checkpoint, keeping what resume needs."""

    async def resume(self, job: FineTuneJob) -> None:
        """Start suspended workers again; they resume from the last checkpoint."""

    async def restart(self, job: FineTuneJob) -> None:
        """Remove the failed gang; the next reconcile launches a new one."""

    async def cancel(self, job: FineTuneJob) -> None:
        """Remove everything the job created (the job is being deleted)."""

    def forget(self, namespace: str, name: str) -> None:
        """The job is gone: drop whatever the backend keeps about it in memory."""


@functools.cache
def installed_names() -> frozenset[str]:
    """Names a manifest may use in `spec.backend` (entry points do not change at run time)."""
    return frozenset(PLANNED_BACKENDS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_backends(context: BackendContext) -> dict[str, Backend]:
    """Every installed backend, built for this operator."""
    return {ep.name: ep.load()(context) for ep in entry_points(group=ENTRY_POINT_GROUP)}


@dataclass(frozen=True)
class BackendRules:
    """A backend's word on a manifest before anything runs (`RULES_ENTRY_POINT_GROUP`)."""

    section: str | None = None
    """The spec field only this backend reads (`azureml`): on a job of another backend it is
    ignored, and validation says so."""
    rules: tuple[Rule, ...] = ()
    """Its rules of a manifest; those with CEL are compiled into the CRD too."""
    logs_hint: Callable[[dict[str, Any]], str] | None = None
    """Where its workers' logs are read, from the FineTuneJob as the API server returns it;
    None: in the job's pods (`finetune logs` reads them)."""


@functools.cache
def installed_rules() -> dict[str, BackendRules]:
    """Each installed backend's rules, by its name."""
    return {ep.name: ep.load() for ep in entry_points(group=RULES_ENTRY_POINT_GROUP)}


def backend_problems(job: FineTuneJob) -> Iterator[Problem]:
    """Every installed backend's rules of `job` (each says when its rules apply), and a
    warning for each section of a backend other than the job's."""
    for name, backend in sorted(installed_rules().items()):
        for rule in backend.rules:
            yield from rule.check(job)
        section = backend.section
        if section and name != job.spec.backend and getattr(job.spec, section, None) is not None:
            yield Problem(f"spec.{section}", f"is ignored by backend {job.spec.backend}",
                          f"remove it, or set `backend: {name}`", "warning")


def check_manifest(doc: Any) -> tuple[FineTuneJob | None, list[Problem]]:
    """`validation.check_document` and the installed backends' rules: every problem of one
    manifest that needs no backend to be running (`admission.admit` adds theirs)."""
    job, problems = check_document(doc)
    return job, problems + list(backend_problems(job)) if job is not None else problems


def all_cel_rules() -> list[CelRule]:
    """The API's CEL rules and the installed backends', for the CRD generator."""
    return cel_rules() + [c for name, backend in sorted(installed_rules().items())
                          for rule in backend.rules for c in rule.cel]
