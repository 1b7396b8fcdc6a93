"""The kopf controller: thin handlers around `reconcile`.

Each FineTuneJob has one worker (a kopf daemon), the only writer of its status. It does the
same four things each time it is woken: observe the backend, ask `reconcile` what to do,
do it, and patch the status if it changed. It is woken as controller-runtime's informers
wake a reconciler: by a new generation of the job (a spec change), by a change of one of
its children (the kubernetes backend's Jobs, pods, Services and ConfigMaps, watched and
held in kopf indexes: `backends/children.py`), when a deadline falls due, and on an
interval only for what no watch reports (see `Runtime.interval`). The decisions
themselves are in `reconcile.py` (pure, table-tested); what a backend does, in its plugin
(`backends/`).
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
from finetune_operator.admission import admit
from finetune_operator.api import API_GROUP, PLURAL, TERMINAL_PHASES, VERSION, FineTuneJob
from finetune_operator.backends import Backend, BackendContext, BackendError, load_backends
from finetune_operator.backends.children import MANAGED, RESOURCES, owner_key
from finetune_operator.kube import Kube, KubeError, timestamp
from finetune_operator.metrics import RESTART_CAUSES, OperatorMetrics
from finetune_operator.planner import ModelConfigs, plan_job
from finetune_operator.reconcile import (
    Action,
    Decision,
    Feasibility,
    Observation,
    next_deadline,
    reconcile,
)
from finetune_operator.settings import OperatorSettings
from finetune_operator.trainer_config import launch_plan

FINALIZER = f"{API_GROUP}/finalizer"
logger = logging.getLogger("finetune_operator")


@dataclass
class Runtime:
    """What the handlers share: the backends (with their API client) and how often to look."""

    backends: dict[str, Backend]
    kube: Kube
    interval: float = 10.0
    """Seconds between looks at what no watch reports: rank 0's progress while a job runs,
    the Job controller's events while its pods are missing, a backend without watchable
    workers (Azure ML) while the job is not finished. Idle jobs are not looked at on a
    timer: a change wakes them, and deadlines are timed to when they fall due."""
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
    admission = admit(doc, runtime.backends)
    return admission.job, admission.backend, [str(p) for p in admission.errors]


async def feasibility(runtime: Runtime, job: FineTuneJob, problems: list[str]
                      ) -> Feasibility | None:
    """The planner's verdict before the first launch (None after it, or for invalid jobs).
    Reading the model's config may touch the network, so it runs off the event loop."""
    if problems or (job.status is not None and job.status.launched_spec):
        return None
    def plan() -> Feasibility:
        model = runtime.model_configs.resolve(job.spec.model.uri, job.spec.model.revision)
        decided = launch_plan(job, model)
        verdict = plan_job(job, model, decided.strategy, search_catalog=False)
        return Feasibility(fits=verdict.fits, message=verdict.reason, plan=decided)

    return await asyncio.to_thread(plan)


def _status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch from `old` to `new` (None removes a field)."""
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new})
    return patch


@dataclass
class Look:
    """One reconcile: the status changes as a merge patch (empty when nothing changed) and
    when to look again without being told (None: only a change wakes the job)."""

    changes: dict[str, Any]
    wake_after: float | None = None


async def look(runtime: Runtime, body: Any) -> Look:
    """Observe, decide and act for one FineTuneJob; the caller applies the status changes."""
    job, backend, problems = _problems(runtime, dict(body))
    now = datetime.now(UTC)
    if job is None:  # the CRD's schema should have stopped this; say why and do nothing
        return Look(_status_patch(dict(body.get("status") or {}),
                                  {**(body.get("status") or {}), "phase": "Failed",
                                   "message": "; ".join(problems)}))
    metrics, operation = runtime.metrics, "observe"
    try:
        seen = Observation() if problems or backend is None else await backend.observe(job)
        decision = reconcile(job, seen, now, problems, await feasibility(runtime, job, problems))
        # the backend renders from the status as decided (status.plan, recorded at launch)
        job = job.model_copy(update={"status": decision.status})
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
    created = timestamp((body.get("metadata") or {}).get("creationTimestamp"))
    metrics.job_seen(job.namespace, job.name, job.spec.backend, old, new, created, now)
    return Look(_status_patch(old, new), _wake_after(runtime, backend, job, decision, seen,
                                                      now))


def _wake_after(runtime: Runtime, backend: Backend | None, job: FineTuneJob,
                decision: Decision, seen: Observation, now: datetime) -> float | None:
    """When to look again with no change reported: a clock-driven rule coming due, or the
    interval while something can only be polled. A backend whose workers are watched
    (`children`) says what it polls; any other is polled while its job is not finished."""
    due = [next_deadline(job.spec.run_policy, decision.status, now)]
    if decision.actions:  # what was just done shows in the next look
        due.append(runtime.interval)
    if getattr(backend, "children", None) is not None:
        if seen.polled:
            due.append(runtime.interval)
    elif backend is not None and decision.status.phase not in TERMINAL_PHASES and (
            decision.status.launched_spec or decision.requeue_after is not None):
        due.append(runtime.interval if decision.requeue_after is None
                   else min(runtime.interval, decision.requeue_after))
    return min((d for d in due if d is not None), default=None)


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
        settings.persistence.diffbase_storage = _NoDiffBase()
        # our own events are posted explicitly; kopf's warnings and errors about an object
        # (a call the API server refused, and the retry) become its Warning / Error events
        settings.posting.level = logging.WARNING
        settings.posting.loggers = True
        # kopf's own calls (status patches, events) give up on a hung API server as ours do,
        # and retry; its default waits five minutes
        settings.networking.request_timeout = runtime.kube.timeout
        # a deletion that finds a job's worker mid-reconcile waits for it to finish, and
        # kopf looks again only after this long: its default (60 s) kept `kubectl delete`
        # waiting a minute whenever the two met
        settings.background.cancellation_polling = 1.0
        # a job's worker that is mid-reconcile when the operator stops (SIGTERM) or the job
        # is deleted finishes that reconcile (its calls time out in runtime.kube.timeout)
        # before it is cancelled: no status patch or launch is cut in half
        settings.background.instant_exit_timeout = runtime.kube.timeout
        # kopf keeps a task (and the object's latest event) per watched object until it has
        # been idle this long: with every job's pods and Jobs watched, its default (5 s)
        # held thousands of them through a burst
        settings.queueing.idle_timeout = 1.0
        # the children's watches ask the API server for the operator's own objects only (a
        # label selector): on a shared cluster, every other pod's changes never reach us
        selector = ",".join(f"{k}={v}" for k, v in MANAGED.items())
        for group, version, plural in RESOURCES.values():
            settings.watching.label_selectors[(group, version, plural) if group
                                              else (version, plural)] = selector

    wakers: dict[tuple[str, str], Waker] = {}
    """(namespace, name) → the worker of that FineTuneJob."""

    async def worker(body: kopf.Body, stopped: kopf.DaemonStopped, logger: logging.Logger,
                     **indexes: Any) -> None:
        """One job's reconciles, one at a time, each when the job or one of its children
        changed, a deadline comes due, or something only polling shows may have moved: the
        only writer of the job's status, so no two reconciles of a job ever race."""
        for backend in runtime.backends.values():
            _attach(backend, indexes)
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        waker = wakers[key] = Waker()
        retry, wait, latest = 0, 0.0, None
        try:
            while not stopped:
                # after a failure, the backoff (or the server's Retry-After) holds: changes
                # seen meanwhile are looked at once it ends
                if not await waker.sleep(wait, stopped, changes=not retry):
                    break
                current = _fresher(body, latest)
                if (current.get("metadata") or {}).get("deletionTimestamp"):
                    break  # being deleted: `cleanup` stops the workers; nothing relaunches them
                waker.generation = (current.get("metadata") or {}).get("generation")
                try:
                    patched, wait = await reconciled(current, logger)
                    latest, retry = patched or latest, 0
                except _Retry as error:
                    wait, retry = error.delay(retry), retry + 1
                    logger.error(error.message(wait))  # an Error event on the job
        finally:
            if wakers.get(key) is waker:
                del wakers[key]

    async def reconciled(body: dict[str, Any], logger: logging.Logger
                         ) -> tuple[dict[str, Any] | None, float | None]:
        """One reconcile and its status patch: (the job as patched, when to look again)."""
        backend = (body.get("spec") or {}).get("backend", "kubernetes")
        try:
            with runtime.metrics.reconcile_seconds.labels(backend).time():
                result = await look(runtime, body)
        except KubeError as error:
            if error.namespace_terminating:  # its children went first; the job goes next
                logger.info("not relaunched: its namespace is being deleted (%s)", error)
                return None, None  # the job's deletion ends this worker
            raise _Retry(runtime, "the API server refused a call ({}); retrying in {:g}s",
                         error, error.retry_after) from error
        except BackendError as error:
            raise _Retry(runtime, "{}; retrying in {:g}s", error, error.retry_after,
                         fixed=True) from error
        if not result.changes:
            return None, result.wake_after
        meta = body.get("metadata") or {}
        try:
            patched = await runtime.kube.patch_finetunejob_status(
                meta["namespace"], meta["name"], result.changes)
        except KubeError as error:
            runtime.metrics.backend_errors.labels(backend, "status").inc()
            raise _Retry(runtime, "the API server refused the status update ({}); retrying "
                         "in {:g}s", error, error.retry_after) from error
        return patched, result.wake_after

    def wake(key: tuple[str, str]) -> None:
        if (waker := wakers.get(key)) is not None:
            waker.wake()

    def spec_changed(body: kopf.Body, **_: Any) -> bool:
        """A spec change (generation) wakes the worker; its own status patches do not. A
        filter, not the handler, so that most events cost kopf no handler call."""
        meta = body.get("metadata") or {}
        waker = wakers.get((meta.get("namespace", ""), meta.get("name", "")))
        return waker is not None and meta.get("generation") != waker.generation

    async def job_changed(body: kopf.Body, **_: Any) -> None:
        meta = body.get("metadata") or {}
        wake((meta.get("namespace", ""), meta.get("name", "")))

    async def child_deleted(body: kopf.Body, **_: Any) -> None:
        """kopf drops a deleted object from its index without calling the index function:
        this wakes its job instead (every other change wakes it from the index function)."""
        if (key := owner_key(body)) is not None:
            wake(key)

    kopf.daemon(**on, id="reconcile", cancellation_timeout=1.0)(worker)
    kopf.on.event(**on, id="wake", when=spec_changed)(job_changed)
    watched: set[str] = set()
    for backend in runtime.backends.values():
        children = getattr(backend, "children", None)
        for kind, (group, version, plural) in (RESOURCES.items() if children else ()):
            if plural in watched:
                continue
            watched.add(plural)
            kopf.index(group, version, plural, id=f"children_{plural}", labels=MANAGED,
                       registry=registry)(children.indexer(kind, wake))
            kopf.on.event(group, version, plural, id=f"wake-{plural}", labels=MANAGED,
                          when=_is_deletion, registry=registry)(child_deleted)

    @kopf.on.delete(**on, id="cleanup")
    async def cleanup(body: kopf.Body, retry: int, **_: Any) -> None:
        job, backend, _problems_found = _problems(runtime, dict(body))
        if job is not None and backend is not None:  # else nothing was launched for it
            await cancelled(job, backend, retry)

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


# --- a job's worker: woken by changes, the clock, or polling --------------------------------

class Waker:
    """Wakes one job's worker: a change reported by a watch, else its own timeout."""

    settle = 0.05
    """Seconds a woken worker waits for the rest of a burst of changes (a Job and its pods
    change together) before it looks once at all of them."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()
        self.generation: int | None = None
        """The job's generation at the worker's last look: a spec change is a new one."""

    def wake(self) -> None:
        self._changed.set()

    async def sleep(self, timeout: float | None, stopped: kopf.DaemonStopped,
                    changes: bool = True) -> bool:
        """Until woken (unless not `changes`), `timeout` passes (None: no timeout) or the
        worker is stopped (then False). A change during the last look wakes at once."""
        if not changes:
            await stopped.wait(timeout)
        elif timeout is None or timeout > 0:
            changed = asyncio.ensure_future(self._changed.wait())
            stopping = asyncio.ensure_future(stopped.wait())
            try:
                await asyncio.wait((changed, stopping), timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                stopping.cancel()
            if self._changed.is_set() and not stopped:
                await asyncio.sleep(self.settle)
        self._changed.clear()
        return not stopped


class _Retry(Exception):
    """A reconcile that failed in a way that may pass: what to tell the job's events, and how
    long to wait (what the server asked for, else the runtime's backoff)."""

    def __init__(self, runtime: Runtime, template: str, error: Exception,
                 asked: float | None, fixed: bool = False) -> None:
        super().__init__(template.format(error, asked or 0))
        self.runtime, self.template, self.error = runtime, template, error
        self.asked, self.fixed = asked, fixed

    def delay(self, retry: int) -> float:
        """The wait after the `retry`-th failure in a row (0: the first)."""
        if self.fixed and self.asked is not None:
            return self.asked
        return self.runtime.backoff(retry, self.asked)

    def message(self, delay: float) -> str:
        return self.template.format(self.error, delay)


class _NoDiffBase(kopf.DiffBaseStorage):
    """kopf keeps a copy of each object's spec (the last-handled-configuration annotation)
    to tell create, update and field handlers what changed. This operator has none of those
    (a job's worker reconciles the whole state, and wakes on a new generation): the copy
    would be one write per job for nothing."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}  # kopf would deep-copy the whole job on every event to compare it

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


def _fresher(body: kopf.Body, patched: dict[str, Any] | None) -> dict[str, Any]:
    """The newer of the watched job and the one our last status patch returned: the watch
    may not have shown that patch yet (resourceVersions are etcd revisions, compared as
    numbers where both are)."""
    live = dict(body)
    if patched is None:
        return live
    try:
        newer = int(patched["metadata"]["resourceVersion"]) > int(
            live["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return live
    return patched if newer else live


def _is_deletion(type: str | None, **_: Any) -> bool:  # `type`: kopf's name for it
    return type == "DELETED"


def _attach(backend: Backend, indexes: dict[str, Any]) -> None:
    """Give a watching backend kopf's indexes of its children (the same for the whole run)."""
    children = getattr(backend, "children", None)
    if children is None:
        return
    for kind, (_group, _version, plural) in RESOURCES.items():
        if f"children_{plural}" in indexes:
            children.indexes[kind] = indexes[f"children_{plural}"]
