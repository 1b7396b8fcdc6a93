"""The kopf controller: thin handlers around `reconcile`.

Every handler does the same four things: observe the backend, ask `reconcile` what to
do, do it, and patch the status if it changed. The decisions themselves are in
`reconcile.py` (pure, table-tested); the Kubernetes objects in `backends/kubernetes.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf

from finetune_operator import naming
from finetune_operator.api import API_GROUP, PLURAL, VERSION, FineTuneJob, Progress
from finetune_operator.backends import kubernetes
from finetune_operator.kube import Kube, KubeError
from finetune_operator.reconcile import Action, Observation, reconcile
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import check_document

FINALIZER = f"{API_GROUP}/finalizer"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
SUPPORTED_BACKENDS = ("kubernetes",)
logger = logging.getLogger("finetune_operator")


@dataclass
class Runtime:
    """What the handlers share: the API client, the settings, and how often to look."""

    kube: Kube
    settings: OperatorSettings
    interval: float = 10.0
    """Seconds between looks at a job's workers (status, progress, deadlines, stalls)."""
    progress_port: int | None = None
    """Where rank 0 serves /progress; defaults to the metrics port."""


# --- observe -------------------------------------------------------------------------------

async def read_progress(runtime: Runtime, pods: list[dict[str, Any]]) -> Progress | None:
    """Rank 0's latest progress record, or None when it cannot be read right now."""
    rank0 = next((p for p in pods
                  if p["metadata"].get("annotations", {}).get(COMPLETION_INDEX_ANNOTATION) == "0"
                  and p.get("status", {}).get("phase") in ("Running", "Succeeded")
                  and p.get("status", {}).get("podIP")), None)
    if rank0 is None:
        return None
    port = runtime.progress_port or runtime.settings.metrics_port
    url = f"http://{rank0['status']['podIP']}:{port}/progress"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
            async with session.get(url) as response:
                if response.status != 200:
                    return None
                record = await response.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        logger.debug("progress of %s not readable: %s", rank0["metadata"]["name"], error)
        return None
    return Progress(step=record.get("step"), total_steps=record.get("totalSteps"),
                    epoch=record.get("epoch"), loss=record.get("loss"),
                    tokens_per_second=record.get("tokensPerSecond"),
                    eta_seconds=record.get("etaSeconds"))


async def observe(runtime: Runtime, job: FineTuneJob) -> Observation:
    workload = await runtime.kube.get("Job", job.namespace, naming.worker_job(job.name))
    if workload is None:
        return Observation()
    pods = [p for p in await runtime.kube.pods(job.namespace, f"{naming.LABEL_JOB}={job.name}")
            if p["metadata"].get("labels", {}).get(naming.LABEL_JOB) == job.name]
    progress = await read_progress(runtime, pods)
    return kubernetes.observe(workload, pods, job.spec.resources.nodes, progress)


# --- act -----------------------------------------------------------------------------------

async def act(runtime: Runtime, job: FineTuneJob, action: Action) -> None:
    kube, namespace = runtime.kube, job.namespace
    if action.kind == "launch":
        for obj in kubernetes.render(job, runtime.settings):
            created = await kube.create(obj)
            logger.info("%s %s/%s %s", "created" if created else "found", obj["kind"],
                        namespace, obj["metadata"]["name"])
    elif action.kind == "delete-workload":
        await kube.delete("Job", namespace, naming.worker_job(job.name))
    elif action.kind in ("suspend", "resume"):
        await kube.suspend_job(namespace, naming.worker_job(job.name), action.kind == "suspend")
    elif action.kind == "delete-job":
        await kube.delete_finetunejob(namespace, job.name)


async def delete_children(runtime: Runtime, namespace: str, name: str) -> None:
    """Everything the job created; owner references would collect them too, but a delete
    that waits for them lets users reuse the name at once."""
    await runtime.kube.delete("Job", namespace, naming.worker_job(name))
    await runtime.kube.delete("Service", namespace, naming.headless_service(name), "Background")
    await runtime.kube.delete("ConfigMap", namespace, naming.trainer_config_map(name),
                              "Background")


# --- the one routine -----------------------------------------------------------------------

def _problems(body: dict[str, Any]) -> tuple[FineTuneJob | None, list[str]]:
    doc = {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")}
    doc["metadata"] = {k: v for k, v in (body.get("metadata") or {}).items()
                       if k in ("name", "namespace", "uid", "generation", "labels",
                                "annotations")}
    job, problems = check_document(doc)
    errors = [str(p) for p in problems if p.severity == "error"]
    if job is not None and not errors:
        if job.spec.backend not in SUPPORTED_BACKENDS:
            errors.append(f"spec.backend: {job.spec.backend!r} is not served by this operator "
                          f"yet — use one of: {', '.join(SUPPORTED_BACKENDS)}")
        else:
            errors += [str(p) for p in kubernetes.validate(job)]
    return job, errors


def _status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch from `old` to `new` (None removes a field)."""
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new})
    return patch


async def reconcile_body(runtime: Runtime, body: kopf.Body, patch: kopf.Patch) -> None:
    job, problems = _problems(dict(body))
    now = datetime.now(UTC)
    if job is None:  # the CRD's schema should have stopped this; say why and do nothing
        patch.status.update({"phase": "Failed", "message": "; ".join(problems)})
        return
    seen = Observation() if problems else await observe(runtime, job)
    decision = reconcile(job, seen, now, problems)
    for action in decision.actions:
        logger.info("%s/%s: %s %s", job.namespace, job.name, action.kind, action.reason)
        await act(runtime, job, action)
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    old = dict(body.get("status") or {})
    changes = _status_patch(old, decision.status.to_dict())
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
    async def cleanup(name: str, namespace: str, **_: Any) -> None:
        try:
            await delete_children(runtime, namespace, name)
        except KubeError as error:
            raise kopf.TemporaryError(f"deleting the workers failed ({error}); retrying",
                                      delay=10) from error
