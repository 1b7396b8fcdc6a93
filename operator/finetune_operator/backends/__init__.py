"""Backend plugins: where a FineTuneJob runs.

A backend is a class with the `Backend` interface, found through the
`finetune_operator.backends` entry-point group: a plugin package adds one by declaring
`[project.entry-points."finetune_operator.backends"] name = "module:Class"`, without
touching this code. The class is built with a `BackendContext`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from finetune_operator.api import FineTuneJob
    from finetune_operator.kube import Kube
    from finetune_operator.reconcile import Observation
    from finetune_operator.settings import OperatorSettings
    from finetune_operator.validation import Problem
    from finetune_trainer.uris import Location

ENTRY_POINT_GROUP = "finetune_operator.backends"

# Backends this distribution ships whose implementation has not landed yet: manifests may
# name them (they validate), the operator reports them as not served.
PLANNED_BACKENDS: tuple[str, ...] = ()


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
