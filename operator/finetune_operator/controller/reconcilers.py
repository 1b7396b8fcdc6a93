"""The kopf controller: watches that fill a queue, and a few reconcilers that drain it.

kopf watches the FineTuneJobs and, for the kubernetes backend, their children (Jobs, pods,
Services, ConfigMaps, held in kopf indexes: `backends/children.py`). A watch event only puts
the job's key in the work queue (`workqueue`), as controller-runtime's informers do: a new
job, a new generation (a spec change), a change of one of its children. A fixed number of
reconcilers (`Runtime.reconcilers`) take keys from the queue, one job at a time each, and do the
same four things: observe the backend, ask `reconcile` what to do (pure, table-tested), do it,
and patch the status if it changed. A job is looked at again without a change only when a
deadline falls due or something no watch reports may have moved (`Runtime.interval`).

FineTuneSweeps share the queue and the reconcilers (`sweeps`): a change of a
trial's FineTuneJob wakes its sweep.

No task per job, and no finalizer for a job whose children the garbage collector removes
(owner references): a job costs the operator one cache entry while it waits, and one
`kubectl delete` is all a deletion takes. A backend with something outside the cluster to
stop (Azure ML) keeps a finalizer, and stops it before the job goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Collection, Hashable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from finetune_operator import crd, kube
from finetune_operator.admission import admit
from finetune_operator.api import (
    API_GROUP,
    DEFAULT_BACKEND,
    KIND,
    PLURAL,
    SWEEP_KIND,
    SWEEP_PLURAL,
    TERMINAL_PHASES,
    VERSION,
    FineTuneJob,
)
from finetune_operator.backends import (
    Backend,
    BackendContext,
    BackendError,
    LaunchBlocked,
    check_manifest,
    load_backends,
)
from finetune_operator.backends.children import MANAGED, RESOURCES, owner_key
from finetune_operator.controller.pacing import LAUNCH_BURST, LAUNCH_RATE, LaunchPacer
from finetune_operator.controller.sweeps import Sweeps
from finetune_operator.controller.workqueue import WorkQueue
from finetune_operator.kube import (
    Kube,
    KubeError,
    merge_patch,
    newer,
    slim,
    timestamp,
    webhook_hint,
)
from finetune_operator.metrics import RESTART_CAUSES, OperatorMetrics
from finetune_operator.output_folders import OutputUser, holder
from finetune_operator.planner import ModelConfigs, plan_job
from finetune_operator.planner.sources import hub_offline
from finetune_operator.reasons import EventReason
from finetune_operator.reconcile import (
    Action,
    Decision,
    Event,
    Feasibility,
    Observation,
    as_launched,
    next_deadline,
    reconcile,
)
from finetune_operator.settings import OperatorSettings
from finetune_operator.sweep import LABEL as SWEEP_LABEL
from finetune_operator.trainer_config import launch_plan

FINALIZER = f"{API_GROUP}/finalizer"
OUTPUTS_INDEX = "output_folders"
"""kopf's index of the FineTuneJobs by output folder (`Controller.output_user`)."""
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
    reconcilers: int = 16
    """Jobs reconciled at once (controller-runtime's MaxConcurrentReconciles): what bounds
    the operator's API calls in flight, however many jobs change together."""
    launches: LaunchPacer = field(default_factory=lambda: LaunchPacer(
        LAUNCH_RATE, LAUNCH_BURST))
    """Turns to launch: a burst of new jobs is acknowledged at once and launched at a pace
    the API server can take beside everyone else's requests."""

    def backoff(self, retry: int, asked: float | None = None) -> float:
        """How long to wait after the `retry`-th consecutive failure (0: the first): what the
        API server asked for (Retry-After), else an exponential backoff."""
        if asked is not None:
            return asked
        return min(self.max_retry_delay, self.retry_delay * 2 ** min(retry, 32))

    @classmethod
    def build(cls, kube: Kube, settings: OperatorSettings, interval: float = 10.0,
              progress_port: int | None = None, reconcilers: int = 16,
              launch_rate: float = LAUNCH_RATE, launch_burst: int = LAUNCH_BURST) -> Runtime:
        context = BackendContext(settings=settings, kube=kube, progress_port=progress_port)
        backends = load_backends(context)
        return cls(backends=backends, kube=kube, interval=interval, reconcilers=reconcilers,
                   metrics=OperatorMetrics(backends=set(backends)),
                   launches=LaunchPacer(launch_rate, launch_burst))


async def act(runtime: Runtime, backend: Backend, job: FineTuneJob, action: Action) -> None:
    steps = {"launch": backend.launch, "delete-workload": backend.restart,
             "suspend": backend.suspend, "resume": backend.resume}
    if action.kind == "delete-job":
        await runtime.kube.delete_finetunejob(job.namespace, job.name)
    else:
        await steps[action.kind](job)


# --- the one routine -----------------------------------------------------------------------

def _document(body: dict[str, Any]) -> dict[str, Any]:
    """The job as a manifest: what admission reads of the watched object."""
    doc = {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")}
    doc["metadata"] = {k: v for k, v in (body.get("metadata") or {}).items()
                       if k in ("name", "namespace", "uid", "generation", "labels",
                                "annotations")}
    return doc


def _problems(runtime: Runtime, body: dict[str, Any]
              ) -> tuple[FineTuneJob | None, Backend | None, list[str]]:
    admission = admit(_document(body), runtime.backends)
    return admission.job, admission.backend, [str(p) for p in admission.errors]


async def feasibility(runtime: Runtime, job: FineTuneJob, problems: list[str]
                      ) -> Feasibility | None:
    """The planner's verdict before the first launch (None after it, or for invalid jobs).
    Reading the model's config may touch the network, so it runs off the event loop."""
    if problems or (job.status is not None and job.status.launched_spec):
        return None
    def plan() -> Feasibility:
        model = runtime.model_configs.resolve(job.spec.model.uri, job.spec.model.revision)
        decided, as_run = launch_plan(job, model)
        verdict = plan_job(as_run, model, decided.strategy, search_catalog=False,
                           as_written=job, offline="HF_HUB_OFFLINE=1" if hub_offline() else None,
                           by_operator=True)
        return Feasibility(fits=verdict.fits, message=verdict.reason, plan=decided,
                           warnings=tuple(verdict.warnings))

    return await asyncio.to_thread(plan)


@dataclass
class Look:
    """One reconcile: the status changes as a merge patch (empty when nothing changed), the
    events to post once the status says so, and when to look again without being told
    (None: only a change wakes the job)."""

    changes: dict[str, Any]
    wake_after: float | None = None
    events: list[Event] = field(default_factory=list)


async def look(runtime: Runtime, body: Any, output_holder: str | None = None) -> Look:
    """Observe, decide and act for one FineTuneJob; the caller applies the status changes.
    `output_holder`: the other live job that holds its output folder, if one does."""
    job, backend, problems = _problems(runtime, dict(body))
    now = datetime.now(UTC)
    if job is None:  # the CRD's schema should have stopped this; say why and do nothing
        return Look(merge_patch(dict(body.get("status") or {}),
                                  {**(body.get("status") or {}), "phase": "Failed",
                                   "message": "; ".join(problems)}))
    metrics, operation = runtime.metrics, "observe"
    # after launch the workers run the spec as launched, whatever an edit refused since says
    running = as_launched(job)
    launched = bool(job.status and job.status.launched_spec)
    if launched and (running is not job or backend is None):
        backend = runtime.backends.get(running.spec.backend)
    try:
        seen = (Observation() if (problems and not launched) or backend is None
                else await backend.observe(running))
        verdict = await feasibility(runtime, job, problems)
        decision = reconcile(job, seen, now, problems, verdict, output_holder=output_holder)
        decision = _paced(runtime, job, seen, now, problems, verdict, decision, output_holder)
        # the backend renders from the status as decided (status.plan, recorded at launch)
        job = running.model_copy(update={"status": decision.status})
        for action in decision.actions:
            logger.info("%s/%s: %s %s", job.namespace, job.name, action.kind, action.reason)
            assert backend is not None  # no action is decided for a job without one
            operation = action.kind
            try:
                await act(runtime, backend, job, action)
            except LaunchBlocked as blocked:
                return _blocked(body, blocked)
            if action.kind == "delete-workload" and action.reason in RESTART_CAUSES:
                metrics.restarted(job.spec.backend, action.reason)
    except (KubeError, BackendError):
        metrics.backend_errors.labels(job.spec.backend, operation).inc()
        raise
    old, new = dict(body.get("status") or {}), decision.status.to_dict()
    created = timestamp((body.get("metadata") or {}).get("creationTimestamp"))
    metrics.job_seen(job.namespace, job.name, job.spec.backend, old, new, created, now)
    return Look(merge_patch(old, new), _wake_after(runtime, backend, job, decision, seen,
                                                      now), decision.events)


def _blocked(body: Any, blocked: LaunchBlocked) -> Look:
    """The launch cannot happen until the job's owner changes something: nothing of the
    decision is kept but the reason, in the status (Pending before a first launch) and in a
    Warning event when it is new. Unlike a retried failure, an edit is looked at at once."""
    old = dict(body.get("status") or {})
    message = f"not launched: {blocked}"
    new = {**old, "message": message}
    if old.get("phase") in (None, "Pending"):
        new["phase"] = "Pending"
    events = [] if old.get("message") == message else [
        Event("Warning", EventReason.LAUNCH_BLOCKED, message)]
    return Look(merge_patch(old, new), blocked.retry_after, events)


def _paced(runtime: Runtime, job: FineTuneJob, seen: Observation, now: datetime,
           problems: list[str], verdict: Feasibility | None, decision: Decision,
           output_holder: str | None = None) -> Decision:
    """The decision again, waiting for the job's turn, when it launches workers (not when it
    puts back a part deleted by hand) and its turn has not come."""
    key = (job.namespace, job.name)
    if seen.exists or not any(a.kind == "launch" for a in decision.actions):
        runtime.launches.release(key)  # a turn promised earlier is not needed any more
        return decision
    if runtime.launches.reserve(key) <= 0:
        return decision
    return reconcile(job, seen, now, problems, verdict,
                     launch_at=runtime.launches.turn_at(key), output_holder=output_holder)


def _wake_after(runtime: Runtime, backend: Backend | None, job: FineTuneJob,
                decision: Decision, seen: Observation, now: datetime) -> float | None:
    """When to look again with no change reported: a clock-driven rule coming due, or the
    interval while something can only be polled. A backend whose workers are watched
    (`children`) says what it polls; any other is polled while its job is not finished."""
    due = [next_deadline(job.spec.run_policy, decision.status, now)]
    if (turn := runtime.launches.promised((job.namespace, job.name))) is not None:
        # waiting for its turn to launch: nothing else wakes it, and no workers to poll (a
        # polled look would only ask a polled backend (Azure ML) for a job not there yet)
        return min(d for d in (*due, turn) if d is not None)
    if seen.unreachable:  # asked again after a few intervals, not at each (a refused
        # identity costs a token request per job and look, and its SDK a warning)
        return min(d for d in (*due, runtime.interval * UNREACHABLE_POLLS) if d is not None)
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


UNREACHABLE_POLLS = 6
"""A backend that cannot be asked is asked again after this many intervals (a minute at the
default 10 s)."""


# --- the reconcilers ------------------------------------------------------------------------

Key = tuple[str, str]
"""(namespace, name) of a FineTuneJob: what the queue holds."""
SETTLE_SECONDS = 0.05
"""How long a job whose child changed waits in the queue before it is looked at."""


class Controller:
    """The jobs as the watch last showed them, the queue of jobs to look at, and the
    reconcilers that look. The watch handlers only record and enqueue; the reconcilers are
    the only writers of the jobs' status, and never two of them at one job."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.queue = WorkQueue()
        self.jobs: dict[Key, dict[str, Any]] = {}
        """Every FineTuneJob watched, slimmed (`kube.slim`): what a reconcile starts from."""
        self.failures: dict[Key, int] = {}
        """Reconciles of a job that failed in a row: how long its retry waits."""
        self.acting = asyncio.Event()
        """This replica acts (always, standalone; with peering, while it leads): the
        reconcilers wait while it is clear."""
        self.acting.set()
        self._reconcilers: list[asyncio.Task] = []
        self.sweeps = Sweeps(runtime.kube, self.queue, self.jobs, runtime.backoff)
        """The FineTuneSweeps: their keys share the queue and the reconcilers."""
        self.outputs: Any = {}
        """kopf's index of every FineTuneJob by its output folder (`output_user`), attached
        by the watch; complete before any job is looked at (kopf lists first)."""
        self._folders: dict[Key, tuple[tuple[Any, Any], str | None]] = {}
        """Each job's output folder by its (uid, generation): a job is parsed once per spec,
        not at each of its events."""
        runtime.metrics.watch_queue(self.queue, runtime.launches)

    # --- fed by the watches

    def seen(self, event_type: str | None, body: dict[str, Any]) -> None:
        """A watch event of a FineTuneJob (None: listed when the watch (re)started)."""
        key = _key(body)
        sweep = ((body.get("metadata") or {}).get("labels") or {}).get(SWEEP_LABEL)
        if sweep:  # a trial's phase or progress moved: its sweep looks
            self.sweeps.trial_changed(key[0], sweep)
        if event_type == "DELETED":
            self.gone(key)
            return
        current, before = slim(body), self.jobs.get(key)
        if before is not None and newer(before, current):
            return  # our own status patch has already shown us this and more
        self.jobs[key] = current
        meta = current["metadata"]
        if meta.get("deletionTimestamp"):
            self.queue.forget(key)  # nothing more to do for it (its finalizer, if any, aside)
        elif before is None or (before["metadata"].get("generation")
                                != meta.get("generation")):
            self.queue.add(key)  # new to us, or its spec changed: its own status does not

    def changed(self, key: Key) -> None:
        """One of the job's children changed: look at the job (if it is one we know), once
        kopf has stored the change in its index (the index function calls this before), and
        once for the rest of a burst (a Job and its pods change together)."""
        if key in self.jobs:
            self.queue.add_after(key, SETTLE_SECONDS)

    def output_user(self, body: dict[str, Any]) -> dict[str, OutputUser] | None:
        """kopf's index function: the job under its output folder, launched or not, with its
        phase (None: no folder another job could share, or a spec no backend takes)."""
        folder = self._folder(body)
        if folder is None:
            return None
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        return {folder: OutputUser(meta.get("namespace", ""), meta.get("name", ""),
                                   str(meta.get("creationTimestamp") or ""),
                                   bool(status.get("launchedSpec")), status.get("phase"))}

    def _folder(self, body: dict[str, Any]) -> str | None:
        key, meta = _key(body), body.get("metadata") or {}
        stamp = (meta.get("uid"), meta.get("generation"))
        if (known := self._folders.get(key)) is not None and known[0] == stamp:
            return known[1]
        # the manifest's rules only (kopf calls this on its event loop: no backend's checks
        # of a job, which may build an Azure ML job); the reconcile says the rest
        job, problems = check_manifest(_document(body))
        launched = bool((body.get("status") or {}).get("launchedSpec"))
        folder = None
        errors = any(problem.severity == "error" for problem in problems)
        if job is not None and (launched or not errors):  # launched: its workers write it
            running = as_launched(job)
            backend = self.runtime.backends.get(running.spec.backend)
            find = getattr(backend, "output_folder", None)
            folder = find(running) if find is not None else None
        self._folders[key] = (stamp, folder)
        return folder

    def output_holder(self, body: dict[str, Any]) -> str | None:
        """The other live job that holds this one's output folder (`output_folders.holder`),
        said as `namespace/name (phase)`; None when it may go on."""
        folder = self._folder(body)
        if folder is None:
            return None
        (me,) = self.output_user(body).values()  # type: ignore[union-attr]
        found = holder(me, self.outputs.get(folder, ()))
        return None if found is None else str(found)

    def gone(self, key: Key) -> None:
        self.jobs.pop(key, None)
        self._folders.pop(key, None)
        self.failures.pop(key, None)
        self.runtime.launches.release(key)
        self.queue.forget(key)
        for backend in self.runtime.backends.values():
            forget = getattr(backend, "forget", None)
            if forget is not None:
                forget(*key)
        self.runtime.metrics.job_gone(*key)

    # --- the reconcilers

    def start(self) -> list[asyncio.Task]:
        self._reconcilers = [asyncio.create_task(self._reconciler(), name=f"reconciler-{n}")
                             for n in range(self.runtime.reconcilers)]
        return self._reconcilers

    async def stop(self) -> None:
        """Finish the looks in progress (each within the API timeout), start no new one."""
        self.queue.shut_down()
        # a standby's reconciler that was handed a key waits to act: wake it, and the shut
        # queue gives it None (else it held the stop for the whole timeout, past the pod's
        # grace period)
        self.acting.set()
        if not self._reconcilers:
            return
        _done, pending = await asyncio.wait(self._reconcilers,
                                            timeout=self.runtime.kube.timeout + 5)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _reconciler(self) -> None:
        while (key := await self._next()) is not None:
            try:
                if len(key) == 3:  # type: ignore[arg-type]  # a sweep's: (kind, ns, name)
                    await self.sweeps.reconcile(key)  # type: ignore[arg-type]
                else:
                    await self.reconcile(key)  # type: ignore[arg-type]
            except Exception:  # a bug must not stop this reconciler: log it, retry the job
                logger.exception("%s/%s: the reconcile failed", *key[-2:])  # type: ignore[index]
                self.queue.hold(key, self._retry_delay(key, None))
            finally:
                self.queue.done(key)

    async def _next(self) -> Hashable | None:
        """The next key to look at, once this replica acts (None: shut down)."""
        while True:
            await self.acting.wait()
            key = await self.queue.get()
            if key is None or self.acting.is_set():
                return key
            self.queue.done(key)  # a standby now: whoever leads looks at it

    def stand_by(self) -> None:
        """Another replica leads now: forget every job (it looks after them) until this one
        leads again and lists them anew."""
        self.acting.clear()
        for key in list(self.jobs):
            self.queue.forget(key)
        self.jobs.clear()
        self.failures.clear()
        self.sweeps.forget_all()

    async def lead(self, namespaces: tuple[str, ...] = ()) -> None:
        """This replica leads (again): act, starting from every job there is now in the
        namespaces it watches (kopf lists them too when its watches resume; the first
        listing wins, the other is a no-op)."""
        if self.acting.is_set():
            return
        self.acting.set()
        kube_ = self.runtime.kube
        try:
            listed = [body for ns in namespaces or (None,) for body in await kube_.list(KIND, ns)]
        except KubeError as error:
            logger.warning("listing the FineTuneJobs after taking over failed (%s): the "
                           "watch's own listing brings them", error)
            return
        for body in listed:
            self.seen(None, {"apiVersion": f"{API_GROUP}/{VERSION}", "kind": KIND, **body})
        with contextlib.suppress(KubeError):  # without the sweeps' CRD there are none
            for ns in namespaces or (None,):
                for body in await kube_.list(SWEEP_KIND, ns):
                    self.sweeps.seen(None, {"apiVersion": f"{API_GROUP}/{VERSION}",
                                            "kind": SWEEP_KIND, **body})

    def _retry_delay(self, key: Hashable, error: _Retry | None) -> float:
        retry = self.failures.get(key, 0)  # type: ignore[call-overload]
        self.failures[key] = retry + 1  # type: ignore[index]
        return error.delay(retry) if error is not None else self.runtime.backoff(retry)

    async def reconcile(self, key: Key) -> None:
        """One look at one job, its status patch and its events; then when to look again."""
        body = self.jobs.get(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            look_, patched = await self._look(body, self.output_holder(body))
        except _Retry as error:
            wait = self._retry_delay(key, error)
            logger.error("%s/%s: %s", *key, error.message(wait))
            await self._post(body, Event("Warning", EventReason.RETRYING, error.message(wait)))
            await self._not_launched_yet(key, body, error)
            self.queue.hold(key, wait)
            return
        self.failures.pop(key, None)
        if patched is not None and key in self.jobs and newer(slim(patched),
                                                               self.jobs[key]):
            self.jobs[key] = slim(patched)
        for event in look_.events:
            await self._post(patched or body, event)
        if look_.wake_after is not None:
            self.queue.add_after(key, look_.wake_after)

    async def _not_launched_yet(self, key: Key, body: dict[str, Any], error: _Retry) -> None:
        """A job whose first launch fails again and again (an admission webhook that does
        not answer refuses every Job create) says so in its status, Pending, instead of no
        phase at all: once per cause, not per retry. A launched job keeps its phase; the
        Retrying events say it."""
        status = body.get("status") or {}
        if status.get("phase") not in (None, "Pending") or status.get("launchedSpec"):
            return
        message = (f"not launched yet (retried with a backoff): {error.error}"
                   f"{webhook_hint(error.error)}")
        if status.get("message") == message and status.get("phase") == "Pending":
            return
        try:
            patched = await self.runtime.kube.patch_finetunejob_status(
                *key, {"phase": "Pending", "message": message})
        except KubeError as refused:  # the same outage, likely: the events say it
            backend = (body.get("spec") or {}).get("backend", DEFAULT_BACKEND)
            self.runtime.metrics.backend_errors.labels(backend, "status").inc()
            logger.warning("%s/%s: status not updated: %s", *key, refused)
            return
        if patched is not None and key in self.jobs and newer(slim(patched), self.jobs[key]):
            self.jobs[key] = slim(patched)

    async def _look(self, body: dict[str, Any], output_holder: str | None = None
                    ) -> tuple[Look, dict[str, Any] | None]:
        """`look` and the status patch; a failure that may pass is a _Retry."""
        runtime = self.runtime
        backend = (body.get("spec") or {}).get("backend", DEFAULT_BACKEND)
        try:
            with runtime.metrics.reconcile_seconds.labels(backend).time():
                result = await look(runtime, body, output_holder)
        except KubeError as error:
            if error.namespace_terminating:  # its children went first; the job goes next
                logger.info("%s/%s: not relaunched: its namespace is being deleted (%s)",
                            *_key(body), error)
                return Look({}), None
            raise _Retry(runtime, "the API server refused a call ({}); retrying in {:g}s",
                         error, error.retry_after) from error
        except BackendError as error:
            raise _Retry(runtime, "{}; retrying in {:g}s", error, error.retry_after,
                         fixed=True) from error
        if not result.changes:
            return result, None
        namespace, name = _key(body)
        try:
            patched = await runtime.kube.patch_finetunejob_status(namespace, name,
                                                                  result.changes)
        except KubeError as error:
            runtime.metrics.backend_errors.labels(backend, "status").inc()
            raise _Retry(runtime, "the API server refused the status update ({}); retrying "
                         "in {:g}s", error, error.retry_after) from error
        return result, patched

    async def _post(self, body: dict[str, Any], event: Event) -> None:
        """Post an event on the job; one that cannot be posted is logged, not retried."""
        try:
            await self.runtime.kube.post_event(body, event.type, event.reason, event.message)
        except KubeError as error:
            logger.warning("%s/%s: event %s not posted: %s", *_key(body), event.reason, error)

    async def cleanup(self, body: dict[str, Any], retry: int) -> None:
        """The job is being deleted and its backend has something to stop (the finalizer
        holds the deletion until it is stopped): after any look in progress, stop it."""
        key = _key(body)
        self.queue.forget(key)
        await self.queue.settled(key)
        job, backend, _problems_found = _problems(self.runtime, dict(body))
        if job is None or backend is None:  # nothing was launched for it
            return
        try:
            await backend.cancel(job)
        except KubeError as error:
            delay = self.runtime.backoff(retry, error.retry_after)
            raise kopf.TemporaryError(f"deleting the workers failed ({error}); retrying in "
                                      f"{delay:g}s", delay=delay) from error
        except BackendError as error:
            raise kopf.TemporaryError(f"stopping the workers failed: {error}",
                                      delay=error.retry_after) from error


def _key(body: Any) -> Key:
    meta = body.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


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
    """Who this replica is in the peering object (default: the pod's name and a random
    suffix)."""


def default_identity() -> str:
    return f"{socket.gethostname()}-{random.SystemRandom().getrandbits(32):08x}"


def leads(status: dict[str, Any] | None, identity: str, priority: int,
          now: datetime) -> bool:
    """Whether this replica acts, by kopf's rule on the peering object's status (each
    replica's priority, lastseen and lifetime): no other live replica has a higher
    priority, or the same one (then kopf pauses every one of them)."""
    for peer, record in (status or {}).items():
        if peer == identity or not isinstance(record, dict):
            continue
        seen = timestamp(str(record.get("lastseen") or "")) if record.get("lastseen") else None
        if seen is not None and seen.tzinfo is None:
            seen = seen.replace(tzinfo=UTC)
        alive = seen is not None and (now - seen).total_seconds() <= float(
            record.get("lifetime") or 60)
        if alive and int(record.get("priority") or 0) >= priority:
            return False
    return True


PEERING_LOOK_SECONDS = 2.0
"""How often a replica reads the peering object to learn whether it leads. kopf pauses its
own handlers at once; the reconcilers, which also act on timers, follow within this."""


async def follow_peering(controller: Controller, peering: Peering, identity: str,
                         priority: int, namespaces: tuple[str, ...]) -> None:
    """Keep `controller.acting` to whether this replica leads (kopf's peering decides which
    one acts; its watches pause, and the reconcilers must too, or a demoted replica would go
    on acting on its timers beside the new leader)."""
    kube_ = controller.runtime.kube
    where = [("ClusterKopfPeering", None)] if not namespaces else [
        ("KopfPeering", ns) for ns in namespaces]
    while True:
        try:
            objects = [await kube_.get(kind, ns, peering.name) for kind, ns in where]
        except KubeError as error:
            logger.warning("cannot read the peering object %s (%s): acting as before",
                           peering.name, error)
        else:
            now = datetime.now(UTC)
            if all(leads((o or {}).get("status"), identity, priority, now) for o in objects):
                await controller.lead(namespaces)
            elif controller.acting.is_set():
                logger.info("another replica leads: standing by")
                controller.stand_by()
        await asyncio.sleep(min(PEERING_LOOK_SECONDS, peering.lifetime / 4))


async def run(runtime: Runtime, *, namespaces: tuple[str, ...] = (),
              liveness_port: int | None = None, stop_flag: Any = None, ready_flag: Any = None,
              kubeconfig: str | None = None, spare: Collection[asyncio.Task] | None = None,
              peering: Peering | None = None) -> None:
    """Run the operator until `stop_flag` (or a signal): every namespace when none is given;
    standalone unless `peering` is given. It logs in as `kube.configuration(kubeconfig)` says
    (the service account in a pod, else KUBECONFIG), as `runtime.kube` does.

    When it stops, the looks in progress finish; kopf cancels the tasks that appeared while
    it ran, except `spare` (by default: the tasks that existed before it started).
    """
    registry = kopf.OperatorRegistry()
    controller = register(registry, runtime)

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
        identity = peering.identity or default_identity()
        logger.info("peering through %r as %s with priority %d", peering.name, identity,
                    priority)
        controller.acting.clear()  # until the peering object says this replica leads

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
    ours = controller.start()
    follower = None if peering is None else asyncio.create_task(
        follow_peering(controller, peering, identity, priority, namespaces),
        name="peering follower")
    if follower is not None:
        ours.append(follower)
    try:
        tasks = await kopf.spawn_tasks(
            registry=registry, standalone=peering is None, clusterwide=not namespaces,
            namespaces=namespaces,
            peering_name=peering.name if peering else None,
            priority=priority if peering else None,
            identity=identity if peering else None,  # a NewType of str in kopf
            liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port
            else None, stop_flag=stop_flag, ready_flag=ready_flag)
        await kopf.run_tasks(tasks, ignored=_Either(spare, ours))
    finally:
        if follower is not None:
            follower.cancel()
        await controller.stop()
        with contextlib.suppress(Exception):
            await runtime.kube.close()


CRD_UPGRADE = "kubectl apply --server-side --force-conflicts -f charts/finetune-operator/crds/"


async def warn_of_crd_drift(client: Kube) -> list[str]:
    """A warning for each CRD the API server serves other than this operator's own (an
    upgrade of the chart leaves them as they were): what differs, and the command that
    upgrades them. The operator runs on: what both know works."""
    warnings = []
    for ours in (crd.crd(), crd.sweep_crd()):
        name = ours["metadata"]["name"]
        try:
            served = await client.get("CustomResourceDefinition", None, name)
        except Exception as error:  # advisory: nothing here may keep the operator from starting
            logger.warning("cannot read the CRD %s to compare it with this operator's: %s",
                           name, error)
            continue
        if served is None:
            warnings.append(f"the CRD {name} is not installed — install it: {CRD_UPGRADE}")
        elif (differs := crd.drift(ours, served)) is not None:
            warnings.append(f"the CRD {name} on this cluster is not this operator's: it "
                            f"{differs} — upgrade it: {CRD_UPGRADE}")
    for warning in warnings:
        logger.warning("%s", warning)
    return warnings


def register(registry: kopf.OperatorRegistry, runtime: Runtime) -> Controller:
    """Attach the watch handlers to `registry` (one per operator process, or per test); the
    returned controller's reconcilers are started by `run`."""
    on = {"group": API_GROUP, "version": VERSION, "plural": PLURAL, "registry": registry}
    controller = Controller(runtime)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
        settings.persistence.diffbase_storage = _NoDiffBase()
        # kopf's warnings and errors about an object (a cleanup the API server refused, and
        # the retry) become its Warning / Error events; ours are posted by the reconcilers
        settings.posting.level = logging.WARNING
        settings.posting.loggers = True
        # kopf's own calls (watches, events, finalizers) give up on a hung API server as
        # ours do, and retry; its default waits five minutes
        settings.networking.request_timeout = runtime.kube.timeout
        # a deletion that finds its cleanup waiting for a look in progress is looked at
        # again this soon (kopf's default, 60 s, kept `kubectl delete` waiting a minute)
        settings.background.cancellation_polling = 1.0
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

    @kopf.on.startup(registry=registry)
    async def check_crds(**_: Any) -> None:
        await warn_of_crd_drift(runtime.kube)

    async def job_event(type: str | None, body: kopf.Body, **indexes: Any) -> None:
        # kopf calls this once every index is listed in full, and passes the indexes
        for backend in runtime.backends.values():
            _attach(backend, indexes)
        controller.outputs = indexes[OUTPUTS_INDEX]
        controller.seen(type, body)

    def needs_cleanup(spec: kopf.Spec, **_: Any) -> bool:
        """A finalizer only where the garbage collector cannot clean up (Azure ML's jobs)."""
        backend = runtime.backends.get(spec.get("backend", DEFAULT_BACKEND))
        return backend is not None and getattr(backend, "cleanup_on_delete", True)

    async def cleanup(body: kopf.Body, retry: int, **_: Any) -> None:
        await controller.cleanup(dict(body), retry)

    async def child_deleted(body: kopf.Body, **_: Any) -> None:
        """kopf drops a deleted object from its index without calling the index function:
        this wakes its job instead (every other change wakes it from the index function)."""
        if (key := owner_key(body)) is not None:
            controller.changed(key)

    kopf.index(**on, id=OUTPUTS_INDEX)(lambda body, **_: controller.output_user(dict(body)))
    kopf.on.event(**on, id="watch")(job_event)

    def sweep_event(type: str | None, body: kopf.Body, **_: Any) -> None:
        controller.sweeps.seen(type, body)

    kopf.on.event(API_GROUP, VERSION, SWEEP_PLURAL, id="watch-sweeps",
                  registry=registry)(sweep_event)
    kopf.on.delete(**on, id="cleanup", when=needs_cleanup)(cleanup)
    watched: set[str] = set()
    for backend in runtime.backends.values():
        children = getattr(backend, "children", None)
        for kind, (group, version, plural) in (RESOURCES.items() if children else ()):
            if plural in watched:
                continue
            watched.add(plural)
            kopf.index(group, version, plural, id=f"children_{plural}", labels=MANAGED,
                       registry=registry)(children.indexer(kind, controller.changed))
            kopf.on.event(group, version, plural, id=f"wake-{plural}", labels=MANAGED,
                          when=_is_deletion, registry=registry)(child_deleted)
    return controller


class _Either(Collection):
    """Tasks kopf must leave alone when it stops: the caller's, and the reconcilers (which
    `run` stops itself, after their looks in progress)."""

    def __init__(self, *collections: Collection[asyncio.Task]):
        self.collections = collections

    def __contains__(self, task: object) -> bool:
        return any(task in c for c in self.collections)

    def __iter__(self):
        return (t for c in self.collections for t in c)

    def __len__(self) -> int:
        return sum(len(c) for c in self.collections)


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
    (a reconciler reads the whole state, and is woken by a new generation): the copy would
    be one write per job for nothing."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}  # kopf would deep-copy the whole job on every event to compare it

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


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
