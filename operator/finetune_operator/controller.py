"""The kopf controller: thin handlers around `reconcile`.

Every handler does the same four things: observe the backend, ask `reconcile` what to
do, do it, and patch the status if it changed. The decisions themselves are in
`reconcile.py` (pure, table-tested); what a backend does, in its plugin (`backends/`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kopf

from finetune_operator.api import API_GROUP, PLURAL, VERSION, FineTuneJob
from finetune_operator.backends import Backend, BackendContext, load_backends
from finetune_operator.kube import Kube, KubeError
from finetune_operator.reconcile import Action, Observation, reconcile
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import check_document

FINALIZER = f"{API_GROUP}/finalizer"
logger = logging.getLogger("finetune_operator")


@dataclass
class Runtime:
    """What the handlers share: the backends (with their API client) and how often to look."""

    backends: dict[str, Backend]
    kube: Kube
    interval: float = 10.0
    """Seconds between looks at a job's workers (status, progress, deadlines, stalls)."""

    @classmethod
    def build(cls, kube: Kube, settings: OperatorSettings, interval: float = 10.0,
              progress_port: int | None = None) -> Runtime:
        context = BackendContext(settings=settings, kube=kube, progress_port=progress_port)
        return cls(backends=load_backends(context), kube=kube, interval=interval)


async def act(runtime: Runtime, backend: Backend, job: FineTuneJob, action: Action) -> None:
    steps = {"launch": backend.launch, "delete-workload": backend.restart,
             "suspend": backend.suspend, "resume": backend.resume}
    if action.kind == "delete-job":
        await runtime.kube.delete_finetunejob(job.namespace, job.name)
    else:
        await steps[action.kind](job)


# --- the one routine -----------------------------------------------------------------------

def _problems(runtime: Runtime, body: dict[str, Any]
              ) -> tuple[FineTuneJob | None, Backend | None, list[str]]:
    doc = {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")}
    doc["metadata"] = {k: v for k, v in (body.get("metadata") or {}).items()
                       if k in ("name", "namespace", "uid", "generation", "labels",
                                "annotations")}
    job, problems = check_document(doc)
    errors = [str(p) for p in problems if p.severity == "error"]
    backend = runtime.backends.get(job.spec.backend) if job is not None else None
    if job is not None and not errors:
        if backend is None:
            errors.append(f"spec.backend: {job.spec.backend!r} is not served by this operator "
                          f"— use one of: {', '.join(sorted(runtime.backends))}")
        else:
            errors += [str(p) for p in backend.validate(job)]
    return job, backend, errors


def _status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch from `old` to `new` (None removes a field)."""
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new})
    return patch


async def reconcile_body(runtime: Runtime, body: kopf.Body, patch: kopf.Patch) -> None:
    job, backend, problems = _problems(runtime, dict(body))
    now = datetime.now(UTC)
    if job is None:  # the CRD's schema should have stopped this; say why and do nothing
        patch.status.update({"phase": "Failed", "message": "; ".join(problems)})
        return
    seen = Observation() if problems or backend is None else await backend.observe(job)
    decision = reconcile(job, seen, now, problems)
    for action in decision.actions:
        logger.info("%s/%s: %s %s", job.namespace, job.name, action.kind, action.reason)
        assert backend is not None  # no action is decided for a job without one
        await act(runtime, backend, job, action)
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    changes = _status_patch(dict(body.get("status") or {}), decision.status.to_dict())
    if changes:
        patch.status.update(changes)


# --- registration --------------------------------------------------------------------------

async def run(runtime: Runtime, *, namespaces: tuple[str, ...] = (),
              liveness_port: int | None = None, stop_flag: Any = None, ready_flag: Any = None,
              server: str | None = None, spare: Collection[asyncio.Task] | None = None) -> None:
    """Run the operator until `stop_flag` (or a signal): every namespace when none is given.

    When it stops, kopf cancels the tasks that appeared while it ran, except `spare`
    (by default: the tasks that existed before it started).
    """
    registry = kopf.OperatorRegistry()
    register(registry, runtime)
    if server is not None:
        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=server)
    spare = set(asyncio.all_tasks()) if spare is None else spare
    tasks = await kopf.spawn_tasks(
        registry=registry, standalone=True, clusterwide=not namespaces, namespaces=namespaces,
        liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None,
        stop_flag=stop_flag, ready_flag=ready_flag)
    await kopf.run_tasks(tasks, ignored=spare)


def register(registry: kopf.OperatorRegistry, runtime: Runtime) -> None:
    """Attach the handlers to `registry` (one per operator process, or per test)."""
    on = {"group": API_GROUP, "version": VERSION, "plural": PLURAL, "registry": registry}

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=API_GROUP, key="last-handled-configuration")
        settings.posting.level = logging.WARNING  # our own events are posted explicitly

    async def handle(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        try:
            await reconcile_body(runtime, body, patch)
        except KubeError as error:
            raise kopf.TemporaryError(f"the API server refused a call ({error}); retrying",
                                      delay=10) from error

    kopf.on.resume(**on, id="reconcile-resumed")(handle)
    kopf.on.create(**on, id="reconcile-created")(handle)
    kopf.on.update(**on, id="reconcile-updated")(handle)
    kopf.timer(**on, id="observe", interval=runtime.interval)(handle)

    @kopf.on.delete(**on, id="cleanup")
    async def cleanup(body: kopf.Body, **_: Any) -> None:
        job, backend, _problems_found = _problems(runtime, dict(body))
        if job is None or backend is None:
            return  # nothing was launched for it
        try:
            await backend.cancel(job)
        except KubeError as error:
            raise kopf.TemporaryError(f"deleting the workers failed ({error}); retrying",
                                      delay=10) from error
