"""The kopf controller: thin handlers around `reconcile`.

Every handler does the same four things: observe the backend, ask `reconcile` what to
do, do it, and patch the status if it changed. The decisions themselves are in
`reconcile.py` (pure, table-tested); what a backend does, in its plugin (`backends/`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from finetune_operator import kube
from finetune_operator.api import API_GROUP, PLURAL, VERSION, FineTuneJob
from finetune_operator.backends import Backend, BackendContext, BackendError, load_backends
from finetune_operator.kube import Kube, KubeError
from finetune_operator.metrics import RESTART_CAUSES, OperatorMetrics
from finetune_operator.planner import ModelConfigs, plan_job, resolve_strategy
from finetune_operator.reconcile import Action, Feasibility, Observation, reconcile
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
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    model_configs: ModelConfigs = field(default_factory=ModelConfigs)
    """Where the planner finds a model's config.json (offline unless given a hub fetch)."""
    retry_delay: float = 1.0
    """Seconds before the first retry of a failed API call; doubled on each failure after."""
    max_retry_delay: float = 60.0

    def backoff(self, retry: int, asked: float | None = None) -> float:
        """How long to wait after the `retry`-th consecutive failure (0: the first): what the
        API server asked for (Retry-After), else an exponential backoff."""
        if asked is not None:
            return asked
        return min(self.max_retry_delay, self.retry_delay * 2 ** min(retry, 32))

    @classmethod
    def build(cls, kube: Kube, settings: OperatorSettings, interval: float = 10.0,
              progress_port: int | None = None) -> Runtime:
        context = BackendContext(settings=settings, kube=kube, progress_port=progress_port)
        backends = load_backends(context)
        return cls(backends=backends, kube=kube, interval=interval,
                   metrics=OperatorMetrics(backends=set(backends)))


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


async def feasibility(runtime: Runtime, job: FineTuneJob, problems: list[str]
                      ) -> Feasibility | None:
    """The planner's verdict before the first launch (None after it, or for invalid jobs).
    Reading the model's config may touch the network, so it runs off the event loop."""
    if problems or (job.status is not None and job.status.launched_spec):
        return None
    def plan() -> Feasibility:
        model = runtime.model_configs.resolve(job.spec.model.uri, job.spec.model.revision)
        verdict = plan_job(job, model, resolve_strategy(job), search_catalog=False)
        return Feasibility(fits=verdict.fits, message=verdict.reason)

    return await asyncio.to_thread(plan)


def _status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch from `old` to `new` (None removes a field)."""
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new})
    return patch


async def reconcile_body(runtime: Runtime, body: kopf.Body) -> dict[str, Any]:
    """Observe, decide and act for one FineTuneJob; returns the status changes as a merge
    patch (empty when nothing changed) for the caller to apply."""
    job, backend, problems = _problems(runtime, dict(body))
    now = datetime.now(UTC)
    if job is None:  # the CRD's schema should have stopped this; say why and do nothing
        return _status_patch(dict(body.get("status") or {}),
                             {**(body.get("status") or {}), "phase": "Failed",
                              "message": "; ".join(problems)})
    metrics, operation = runtime.metrics, "observe"
    try:
        seen = Observation() if problems or backend is None else await backend.observe(job)
        decision = reconcile(job, seen, now, problems, await feasibility(runtime, job, problems))
        for action in decision.actions:
            logger.info("%s/%s: %s %s", job.namespace, job.name, action.kind, action.reason)
            assert backend is not None  # no action is decided for a job without one
            operation = action.kind
            await act(runtime, backend, job, action)
            if action.kind == "delete-workload" and action.reason in RESTART_CAUSES:
                metrics.restarted(job.spec.backend, action.reason)
    except (KubeError, BackendError):
        metrics.backend_errors.labels(job.spec.backend, operation).inc()
        raise
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    old, new = dict(body.get("status") or {}), decision.status.to_dict()
    created = (body.get("metadata") or {}).get("creationTimestamp")
    metrics.job_seen(job.namespace, job.name, job.spec.backend, old, new,
                     datetime.fromisoformat(created) if created else None, now)
    return _status_patch(old, new)


# --- registration --------------------------------------------------------------------------

@dataclass(frozen=True)
class Peering:
    """Several operator replicas, one acting: kopf's peering object elects the replica with
    the highest priority; the others stand by and take over when its record expires."""

    name: str
    priority: int = 0
    """0 draws one at random: kopf freezes every replica when two share a priority."""
    lifetime: int = 60
    """Seconds a replica's record lasts without a refresh: how long a takeover can take."""
    identity: str | None = None
    """Who this replica is in the peering object (kopf derives it from the pod by default)."""


async def run(runtime: Runtime, *, namespaces: tuple[str, ...] = (),
              liveness_port: int | None = None, stop_flag: Any = None, ready_flag: Any = None,
              kubeconfig: str | None = None, spare: Collection[asyncio.Task] | None = None,
              peering: Peering | None = None) -> None:
    """Run the operator until `stop_flag` (or a signal): every namespace when none is given;
    standalone unless `peering` is given. It logs in as `kube.configuration(kubeconfig)` says
    (the service account in a pod, else KUBECONFIG), as `runtime.kube` does.

    When it stops, kopf cancels the tasks that appeared while it ran, except `spare`
    (by default: the tasks that existed before it started).
    """
    registry = kopf.OperatorRegistry()
    register(registry, runtime)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # called again whenever the API server answers 401: a rotated service-account
        # token or an exec plugin's new token is read afresh
        try:
            return kube.connection_info(kube.configuration(kubeconfig))
        except kube.LoginError as error:
            raise kopf.LoginError(str(error)) from error
    if peering is not None:
        priority = peering.priority or random.SystemRandom().randint(1, 2**31 - 1)
        logger.info("peering through %r with priority %d", peering.name, priority)

        @kopf.on.startup(registry=registry)
        async def peer(settings: kopf.OperatorSettings, **_: Any) -> None:
            settings.peering.mandatory = True
            settings.peering.lifetime = peering.lifetime
            # kopf would wait, idle and silent, for an object nobody creates: say so instead
            missing = await runtime.kube.peering_missing(peering.name, namespaces)
            if missing:
                kind = "KopfPeering" if namespaces else "ClusterKopfPeering"
                raise kopf.PermanentError(
                    f"--peering {peering.name}: no {kind} {peering.name!r} "
                    f"({', '.join(missing)}); create it (the Helm chart does when replicas > "
                    "1), or run a single replica without --peering")
    spare = set(asyncio.all_tasks()) if spare is None else spare
    tasks = await kopf.spawn_tasks(
        registry=registry, standalone=peering is None, clusterwide=not namespaces,
        namespaces=namespaces,
        peering_name=peering.name if peering else None,
        priority=priority if peering else None,
        identity=peering.identity if peering else None,  # a NewType of str in kopf
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
        # our own events are posted explicitly; kopf's warnings and errors about an object
        # (a call the API server refused, and the retry) become its Warning / Error events
        settings.posting.level = logging.WARNING
        settings.posting.loggers = True
        # kopf's own calls (status patches, events) give up on a hung API server as ours do,
        # and retry; its default waits five minutes
        settings.networking.request_timeout = runtime.kube.timeout
        # a deletion that finds the observe timer mid-reconcile waits for it to finish, and
        # kopf looks again only after this long: its default (60 s) kept `kubectl delete`
        # waiting a minute whenever the two met
        settings.background.cancellation_polling = 1.0

    # one reconcile of a job at a time: the create handler and the timer's first tick would
    # otherwise both see no workers and both launch them
    busy: dict[str, asyncio.Lock] = {}

    async def reconciled(body: kopf.Body, retry: int) -> dict[str, Any]:
        """The status changes of one reconcile; an API failure is retried with a backoff."""
        try:
            backend = (body.get("spec") or {}).get("backend", "kubernetes")
            uid = (body.get("metadata") or {}).get("uid", "")
            async with busy.setdefault(uid, asyncio.Lock()):
                with runtime.metrics.reconcile_seconds.labels(backend).time():
                    return await reconcile_body(runtime, body)
        except KubeError as error:
            delay = runtime.backoff(retry, error.retry_after)
            raise kopf.TemporaryError(f"the API server refused a call ({error}); retrying in "
                                      f"{delay:g}s", delay=delay) from error
        except BackendError as error:
            raise kopf.TemporaryError(str(error), delay=error.retry_after) from error

    async def handle(body: kopf.Body, patch: kopf.Patch, retry: int, **_: Any) -> None:
        patch.status.update(await reconciled(body, retry))

    async def observe(body: kopf.Body, retry: int, **_: Any) -> None:
        """The timer patches the status itself: kopf stops a timer for good when the patch it
        applies for one fails (a 409, a 422, an outage longer than its retries), and nothing
        would look at the job again until the operator restarts."""
        changes = await reconciled(body, retry)
        if not changes:
            return
        meta = body.get("metadata") or {}
        try:
            await runtime.kube.patch_finetunejob_status(meta["namespace"], meta["name"], changes)
        except KubeError as error:
            runtime.metrics.backend_errors.labels(
                (body.get("spec") or {}).get("backend", "kubernetes"), "status").inc()
            delay = runtime.backoff(retry, error.retry_after)
            raise kopf.TemporaryError(f"the API server refused the status update ({error}); "
                                      f"retrying in {delay:g}s", delay=delay) from error

    kopf.on.resume(**on, id="reconcile-resumed")(handle)
    kopf.on.create(**on, id="reconcile-created")(handle)
    kopf.on.update(**on, id="reconcile-updated")(handle)
    # the first look comes one interval after the create (or resume) handler's reconcile
    kopf.timer(**on, id="observe", interval=runtime.interval,
               initial_delay=runtime.interval)(observe)

    @kopf.on.delete(**on, id="cleanup")
    async def cleanup(body: kopf.Body, retry: int, **_: Any) -> None:
        job, backend, _problems_found = _problems(runtime, dict(body))
        if job is not None and backend is not None:  # else nothing was launched for it
            await cancelled(job, backend, retry)
        busy.pop((body.get("metadata") or {}).get("uid", ""), None)  # no reconcile follows

    async def cancelled(job: FineTuneJob, backend: Backend, retry: int) -> None:
        try:
            await backend.cancel(job)
        except KubeError as error:
            delay = runtime.backoff(retry, error.retry_after)
            raise kopf.TemporaryError(f"deleting the workers failed ({error}); retrying in "
                                      f"{delay:g}s", delay=delay) from error
        except BackendError as error:
            raise kopf.TemporaryError(f"stopping the workers failed: {error}",
                                      delay=error.retry_after) from error
        runtime.metrics.job_gone(job.namespace, job.name)
