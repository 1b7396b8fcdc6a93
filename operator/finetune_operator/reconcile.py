"""The operator's decisions: (job, observation, now) → actions, new status, events.

Pure: no API calls, no clocks, no kopf. The handlers observe the backend, call
`reconcile`, carry out the actions and patch the status; every rule of the job's life
(gang restarts and their budget, deadlines, stalls, suspend, spec changes) is here and
is tested as a table of situations.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from pydantic import ValidationError

from finetune_operator.api import (
    TERMINAL_PHASES,
    BackendRef,
    Condition,
    FineTuneJob,
    FineTuneJobSpec,
    FineTuneJobStatus,
    LaunchPlan,
    Progress,
    RunPolicy,
)
from finetune_operator.reasons import (
    AdmittedReason,
    CollectivePreflightReason,
    CompleteReason,
    ConditionType,
    DegradedReason,
    EventReason,
    ExportedReason,
    FailedReason,
    FeasibleReason,
    RunningReason,
    SpecChangeRefusedReason,
    StalledReason,
    SuspendedReason,
    ValidatedReason,
)

# Spec sections that may change while a job runs; any other change is refused.
MUTABLE_SECTIONS = frozenset({"runPolicy"})

FailureKind = Literal["worker", "preempted", "stopped", "refused"]
"""worker: a training process failed (counts against backoffLimit). preempted: the node or
pod was taken away (eviction, spot reclaim, node loss) — restarted for free. stopped: the
trainer exited 143 after a checkpoint because it was told to stop — restarted for free.
refused: the trainer refused to start, for a reason no restart changes (the output folder
holds another training's checkpoints or model; the hub refused the model) — the job fails,
no budget used."""


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str
    """Which pod, and why, as the user should read it."""
    reason: FailedReason = FailedReason.OTHER_SETTINGS_CHECKPOINTS
    """The Failed condition's reason, for a refusal."""
    setup: bool = False
    """A worker failure the image causes before any training (the trainer's exit 5: an import
    that fails, an op that cannot be built): the same on every rank and every attempt. The
    gang restarts once, in case it was not (a node's fault); a job that still has not
    trained when it fails so again fails: WorkerSetupFailed."""


@dataclass(frozen=True)
class Observation:
    """What the backend sees of the job's workload right now."""

    exists: bool = False
    deleting: bool = False
    """The workload is being deleted (a restart in progress)."""
    suspended: bool = False
    """The workload exists but does not run (Kueue has not admitted it, or we suspended it)."""
    stopping: bool = False
    """Workers of a suspended workload are still shutting down (writing their checkpoint)."""
    running: bool = False
    """Every worker is running."""
    succeeded: bool = False
    failure: Failure | None = None
    waiting: str | None = None
    """Why workers are not running yet, in the pod's own words (ImagePullBackOff: ...) or the
    backend's."""
    blocked: str | None = None
    """The reason, one CamelCase word, when `waiting` lasts until something changes (an
    image, a Secret, a claim, a node that fits: ErrImagePull, Unschedulable, ...); None for
    a wait that ends by itself (a model's download). The Running condition's reason, and a
    Warning event each time it changes."""
    progress: Progress | None = None
    """Rank 0's latest progress record, if it could be read."""
    queued: str | None = None
    """The backend holds the workload in its own queue, waiting for capacity (Azure ML
    `Queued`): phase Queued; the startup deadline counts from when it leaves."""
    queue_active: bool | None = None
    """Kueue's Workload for the job may be admitted (its `spec.active`, the switch that
    suspends a queued job and frees its quota); None: no Workload (yet), or no Kueue."""
    queue_message: str | None = None
    """Why Kueue has not admitted the job, in Kueue's words (no flavor fits, quota), or why
    it is not queued at all (no Workload: Kueue missing)."""
    queue_evicted: str | None = None
    """Why Kueue evicted the admitted job, in Kueue's words (a preemption, a pods-ready
    timeout), until it is admitted again; not for a suspension the job's spec asked for."""
    degraded: str | None = None
    """The backend reports trouble that may pass (Azure ML `NotResponding`): a `Degraded`
    condition, nothing else changes."""
    progress_unreadable: str | None = None
    """Why the running workers' progress cannot be read now (Azure ML's tracking service):
    a `Degraded` condition, and the stall check waits, as no progress read is not no
    progress made."""
    unreachable: str | None = None
    """The backend could not be asked (identity refused, throttled, outage), so nothing is
    known: a `Degraded` condition saying what to fix, and no decision until it answers."""
    backend_ref: BackendRef | None = None
    """The backend's own object for the current attempt (name, UI link), for the status."""
    missing: tuple[str, ...] = ()
    """Parts of the workload that are gone while it exists (a Service or ConfigMap deleted by
    hand), as `Kind name`: launching again puts them back (launch is idempotent)."""
    polled: bool = False
    """Part of what was seen can change without any watch event saying so (rank 0's
    progress, the reason pods are not created): the caller looks again after its interval.
    Not a decision input."""


@dataclass(frozen=True)
class Feasibility:
    """The planner's verdict on the GPUs the job asks for (see finetune_operator.planner)."""

    fits: bool | None
    """None: unknown (no model config, no known gpuType): the job launches."""
    message: str
    """The per-GPU breakdown and, when it does not fit, what would."""
    plan: LaunchPlan | None = None
    """The strategy and step settings the verdict is for: recorded at the first launch."""
    warnings: tuple[str, ...] = ()
    """What the spec asks that the model was not made for (a maxSeqLength beyond its
    context): a Warning event each at the first launch; the job runs."""


ActionKind = Literal["launch", "delete-workload", "suspend", "resume", "delete-job"]


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    reason: str = ""


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    """A member of one of `reasons`' enums (or the kubelet's word it passes on)."""
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", str(self.reason))  # the word: events are dumped


@dataclass
class Decision:
    status: FineTuneJobStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    """Seconds until the next look, while something is expected to change."""


def spec_fingerprint(job: FineTuneJob) -> dict[str, str]:
    """A short hash per spec section, to tell which sections changed after launch."""
    out = {}
    for name, value in job.spec.to_dict().items():
        digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
        out[name] = digest[:12]
    return out


def changed_after_launch(job: FineTuneJob) -> list[str]:
    """The spec sections other than runPolicy that differ from the launched ones: compared
    with `specAtLaunch` read by this version's model, so a field a newer operator added with
    a default is no change; by fingerprint for a job launched by an operator that kept none
    (until it is backfilled)."""
    status = job.status
    launched = status.launched_spec if status else {}
    if not launched:
        return []
    before = _launched_spec(job)
    if before is not None:
        now = job.spec.to_dict()
        then = before.to_dict()
        return sorted(k for k in set(now) | set(then)
                      if k not in MUTABLE_SECTIONS and now.get(k) != then.get(k))
    fingerprint = spec_fingerprint(job)
    return sorted(k for k in set(fingerprint) | set(launched)
                  if k not in MUTABLE_SECTIONS and fingerprint.get(k) != launched.get(k))


def _launched_spec(job: FineTuneJob) -> FineTuneJobSpec | None:
    """`status.specAtLaunch` with the current runPolicy, read by this version's model; None
    where there is none, or it cannot be read."""
    status = job.status
    if status is None or not status.spec_at_launch:
        return None
    try:
        return FineTuneJobSpec.model_validate({**status.spec_at_launch,
                                               "runPolicy": job.spec.run_policy.to_dict()})
    except ValidationError:
        return None


def as_launched(job: FineTuneJob) -> FineTuneJob:
    """The job as its workers run: the spec as launched with the current runPolicy, once a
    change to another section has been refused; else the job itself (and for a job
    launched by an operator that kept no `specAtLaunch`)."""
    if not changed_after_launch(job) or (spec := _launched_spec(job)) is None:
        return job  # (a record this version cannot read: the spec as written)
    return job.model_copy(update={"spec": spec})


def _spec_at_launch(job: FineTuneJob) -> dict:
    return {k: v for k, v in job.spec.to_dict().items() if k not in MUTABLE_SECTIONS}


def set_condition(status: FineTuneJobStatus, type_: ConditionType, value: bool | None,
                  reason: str, message: str, now: datetime, generation: int | None) -> None:
    """Add or update a condition (None: Unknown); its transition time moves only when its
    status does. `reason`: a member of the type's enum in `reasons` (or, on Running, a
    FailedReason or the kubelet's word)."""
    text = "Unknown" if value is None else "True" if value else "False"
    type_, reason = str(type_), str(reason)  # the words, not the enums: statuses are dumped
    for condition in status.conditions:
        if condition.type == type_:
            if condition.status != text:
                condition.last_transition_time = now
            condition.status, condition.reason, condition.message = text, reason, message
            condition.observed_generation = generation
            return
    status.conditions.append(Condition(type=type_, status=text, reason=reason, message=message,
                                       last_transition_time=now,
                                       observed_generation=generation))


def condition(status: FineTuneJobStatus, type_: ConditionType) -> Condition | None:
    return next((c for c in status.conditions if c.type == type_), None)


class _Builder:
    """Accumulates one decision from what the guards below see; keeps the transitions
    readable."""

    def __init__(self, job: FineTuneJob, now: datetime, seen: Observation | None = None,
                 problems: list[str] | None = None, feasibility: Feasibility | None = None,
                 launch_at: datetime | None = None, output_holder: str | None = None):
        self.asked = job
        """The spec as now written; `job` is as launched (`as_launched`)."""
        self.job, self.now = as_launched(job), now
        self.seen = seen or Observation()
        self.problems = problems or []
        self.feasibility = feasibility
        self.launch_at = launch_at
        self.output_holder = output_holder
        self.generation = job.metadata.generation
        self.status = (job.status or FineTuneJobStatus()).model_copy(deep=True)
        self.decision = Decision(status=self.status)

    def phase(self, phase: str, message: str) -> None:
        if self.status.phase != phase:
            self.event("Normal" if phase not in ("Failed", "Restarting") else "Warning",
                       phase, message)
        self.status.phase = phase  # type: ignore[assignment]
        self.status.message = message

    def cond(self, type_: ConditionType, value: bool | None, reason: str,
             message: str = "") -> None:
        set_condition(self.status, type_, value, reason, message, self.now, self.generation)

    def act(self, kind: ActionKind, reason: str = "") -> None:
        self.decision.actions.append(Action(kind, reason))

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.decision.events.append(Event(type_, reason, message))

    def requeue(self, seconds: float) -> None:
        current = self.decision.requeue_after
        self.decision.requeue_after = seconds if current is None else min(current, seconds)

    def fail(self, reason: FailedReason, message: str, stop_workload: bool) -> Decision:
        self.cond(ConditionType.FAILED, True, reason, message)
        self.cond(ConditionType.RUNNING, False, reason, "")
        self.phase("Failed", message)
        self.status.completion_time = self.status.completion_time or self.now
        if stop_workload:
            self.act("delete-workload", reason)
        return self.decision


def _seconds_since(then: datetime | None, now: datetime) -> float:
    return (now - then).total_seconds() if then else 0.0


def _merge_progress(b: _Builder, seen: Progress | None) -> None:
    if seen is None:
        return
    if seen.preflight:
        _preflight_condition(b, seen.preflight)
    before = b.status.progress
    advanced = before is None or (seen.step or 0) > (before.step or 0)
    last = b.now if advanced else (before.last_step_time if before else b.now)
    b.status.progress = seen.model_copy(update={"last_step_time": last, **{
        name: float(f"{value:.{SHOWN_DIGITS}g}") for name in SHOWN_FIGURES
        if (value := getattr(seen, name)) is not None}})


SHOWN_DIGITS = 4
SHOWN_FIGURES = ("loss", "eval_loss", "tokens_per_second")
"""The progress figures `kubectl get` shows (the Loss and Tokens/s columns; a sweep's Best is
its trials' loss or eval loss), kept to SHOWN_DIGITS significant digits in the status: a
printer column prints every digit a number has (6.144528664547088)."""


def _preflight_condition(b: _Builder, record: dict) -> None:
    """The trainer's all-reduce sweep before step 0: True when no node lagged its peers."""
    busbw = record.get("busBandwidthGBps")
    nodes: dict = record.get("nodes") or {}
    slow = [n for n in record.get("slowNodes") or [] if n in nodes]
    figures = ", ".join(f"{n} {v:g}" for n, v in sorted(nodes.items()))
    summary = f"all-reduce bus bandwidth {busbw:g} GB/s" + (f" (per node GB/s: {figures})"
                                                            if figures else "")
    if record.get("transport"):
        summary += f"; NCCL transport {record['transport']}"
    if slow:
        b.cond(ConditionType.COLLECTIVE_PREFLIGHT, False, CollectivePreflightReason.SLOW_NODES,
               f"{', '.join(slow)} below 0.8x the median of the other nodes: {summary}. "
               "Cordon the node and delete the job's pods to restart elsewhere, or check its "
               "network card and NVLink")
    else:
        b.cond(ConditionType.COLLECTIVE_PREFLIGHT, True, CollectivePreflightReason.MEASURED,
               summary)


def reconcile(job: FineTuneJob, seen: Observation, now: datetime,
              problems: list[str] | None = None,
              feasibility: Feasibility | None = None,
              launch_at: datetime | None = None,
              output_holder: str | None = None) -> Decision:
    """Decide what to do about `job`. `problems` are validation errors found by the caller
    (the API's rules and the backend's own), each `path: what — fix`. `feasibility` is the
    planner's verdict, computed by the caller before the first launch. `launch_at`: the
    job's turn to launch comes then (launches are paced, `controller.pacing`; the time is fixed when
    the turn is promised), so a launch due now waits for it. `output_holder`: the other
    live job that holds this one's output folder (`output_folders.holder`), as
    `namespace/name (phase)`.

    A chain of guards, in the order a job's life asks them: each adds to the decision and
    either ends it (True) or lets the next one look."""
    b = _Builder(job, now, seen, problems or [], feasibility, launch_at, output_holder)
    b.status.observed_generation = b.generation
    for guard in GUARDS:
        if guard(b):
            break
    return b.decision


def _finished(b: _Builder) -> bool:
    """A finished job only waits for its ttlSecondsAfterFinished; one refused as invalid
    before it launched is admitted again once its spec is edited."""
    if b.status.phase not in TERMINAL_PHASES:
        return False
    refused = condition(b.status, ConditionType.FAILED)
    if (not b.status.launched_spec and refused is not None
            and refused.reason in (FailedReason.INVALID_SPEC, FailedReason.OUTPUT_IN_USE)
            and refused.observed_generation not in (None, b.generation)):
        b.cond(ConditionType.FAILED, False, FailedReason.SPEC_EDITED, "")
        b.status.phase, b.status.message, b.status.completion_time = None, None, None
        return False
    seen_before = b.asked.status.observed_generation if b.asked.status else None
    if seen_before not in (None, b.generation):  # observedGeneration alone read as applied
        b.event("Warning", EventReason.SPEC_CHANGE_IGNORED,
                f"the job has ended ({b.status.phase}): an "
                "edit starts nothing (only spec.runPolicy.ttlSecondsAfterFinished still "
                "applies); apply it under a new name, or delete and re-create the job, to "
                "train again")
    ttl = b.job.spec.run_policy.ttl_seconds_after_finished
    if ttl is not None:
        left = ttl - _seconds_since(b.status.completion_time, b.now)
        if left <= 0:
            b.act("delete-job", "ttlSecondsAfterFinished")
        else:
            b.requeue(left)
    return True


def _admitted(b: _Builder) -> bool:
    """The spec must be valid, fit (before launch), and unchanged since launch except where
    allowed."""
    status, problems = b.status, b.problems
    if problems:
        b.cond(ConditionType.VALIDATED, False, ValidatedReason.INVALID_SPEC, "; ".join(problems))
        if not status.launched_spec:
            b.fail(FailedReason.INVALID_SPEC, "the spec is invalid: " + "; ".join(problems),
                   stop_workload=False)
            return True
        # after launch: what was launched keeps running; the condition says why
    else:
        b.cond(ConditionType.VALIDATED, True, ValidatedReason.VALID, "")
    if b.feasibility is not None and not status.launched_spec and not _feasible(
            b, b.feasibility):
        return True
    if status.launched_spec:
        if changed := changed_after_launch(b.asked):
            if not problems and _never_ran(status):
                return _relaunch_as_edited(b, changed)
            _refuse_change(b, changed)
        else:
            if condition(status, ConditionType.SPEC_CHANGE_REFUSED):
                b.cond(ConditionType.SPEC_CHANGE_REFUSED, False,
                       SpecChangeRefusedReason.SPEC_MATCHES_LAUNCH)
            if not status.spec_at_launch:  # launched by an operator that kept only hashes
                status.spec_at_launch = _spec_at_launch(b.asked)
            # the same spec, hashed by this version (a field it added shows in the hash)
            status.launched_spec = spec_fingerprint(b.asked)
    return False


def _output_in_use(b: _Builder) -> bool:
    """Another live job holds the output folder of this one, not launched yet: two jobs in
    one folder would resume each other's checkpoints or replace each other's model. The
    refusal is final (`_finished` admits it again only once edited): the same manifest
    applied again is `unchanged` to the API server, so the fix said is delete and apply."""
    if b.output_holder is None or b.status.launched_spec:
        return False
    job = b.job
    b.fail(FailedReason.OUTPUT_IN_USE,
           f"spec.output.uri {job.spec.output.uri} is the output folder of "
           f"FineTuneJob {b.output_holder} — give this job a folder of its own (another "
           "spec.output.uri); to train on from that job's checkpoints, once it has ended "
           f"delete this job and apply it again (`kubectl delete ftj {job.name} -n "
           f"{job.namespace}`, then `kubectl apply -f` its manifest)", stop_workload=False)
    return True


def _never_ran(status: FineTuneJobStatus) -> bool:
    """No worker of the job has trained yet: waiting to be scheduled, for its image, in a
    queue. Nothing it would resume from exists, so a change costs nothing."""
    return (status.phase in ("Pending", "Launching", "Queued", "Restarting")
            and status.restarts == 0 and status.progress is None
            and status.last_checkpoint is None)


def _relaunch_as_edited(b: _Builder, changed: list[str]) -> bool:
    """The fix a waiting job's message asked for (an image, a nodeSelector, a smaller
    gang): the workers are launched again with it, as Kubernetes lets a Job that never
    started change its scheduling directives. Refused, the job waited out its startup
    deadline and failed."""
    status, sections = b.status, f"spec.{', spec.'.join(changed)}"
    # launched no more: once the workload is gone, the edited spec is planned and launched
    # as a new job's is (phase Restarting holds the launch until then)
    status.launched_spec, status.spec_at_launch, status.plan = {}, {}, None
    if condition(status, ConditionType.SPEC_CHANGE_REFUSED):
        b.cond(ConditionType.SPEC_CHANGE_REFUSED, False,
               SpecChangeRefusedReason.SPEC_MATCHES_LAUNCH)
    b.event("Normal", EventReason.SPEC_CHANGE_APPLIED,
            f"{sections} changed before any worker ran: launching the workers again with it")
    b.cond(ConditionType.RUNNING, False, RunningReason.RELAUNCHING,
           f"{sections} changed before any worker ran")
    b.act("delete-workload", "spec changed before any worker ran")
    b.phase("Restarting", f"{sections} changed before any worker ran: launching the "
            "workers again with it")
    b.requeue(2)
    return True


def _refuse_change(b: _Builder, changed: list[str]) -> None:
    """What runs keeps running; the condition, a Warning event once per generation and the
    message say so (`kubectl get ftj` and a GitOps tool's sync show the spec as applied)."""
    sections = f"spec.{', spec.'.join(changed)}"
    before = condition(b.status, ConditionType.SPEC_CHANGE_REFUSED)
    if before is None or before.status != "True" or before.observed_generation != b.generation:
        b.event("Warning", EventReason.SPEC_CHANGE_REFUSED,
                f"{sections} cannot change after launch: "
                "the workers go on with the spec they were launched with")
    b.cond(ConditionType.SPEC_CHANGE_REFUSED, True, SpecChangeRefusedReason.IMMUTABLE_AFTER_LAUNCH,
           f"{sections} cannot change after launch; only spec.runPolicy can (suspend, "
           "deadlines, budget). Revert the change, or delete and re-create the job to start "
           "over")


def _backend_health(b: _Builder) -> bool:
    """What the backend says about itself: its object, and whether it can be trusted now
    (nothing is decided while it cannot be asked)."""
    seen, status = b.seen, b.status
    if seen.backend_ref is not None:
        status.backend_ref = seen.backend_ref
    if seen.unreachable:
        _degraded(b, DegradedReason.BACKEND_UNREACHABLE, seen.unreachable)
        status.phase = status.phase or "Pending"
        status.message = f"cannot reach the backend: {seen.unreachable}"
        b.requeue(60)
        return True
    if seen.degraded:
        _degraded(b, DegradedReason.BACKEND_DEGRADED, seen.degraded)
    elif seen.progress_unreadable:
        _degraded(b, DegradedReason.PROGRESS_UNREADABLE,
                  f"{seen.progress_unreadable}; the stall check "
                  "waits until it can be read")
    elif (degraded := condition(status, ConditionType.DEGRADED)) and degraded.status == "True":
        b.cond(ConditionType.DEGRADED, False, DegradedReason.RECOVERED, "")
    return False


def _active_deadline(b: _Builder) -> bool:
    """activeDeadlineSeconds ends the job whatever the workers do."""
    limit, started = b.job.spec.run_policy.active_deadline_seconds, b.status.start_time
    if limit and started and _seconds_since(started, b.now) > limit:
        b.fail(FailedReason.DEADLINE_EXCEEDED,
               f"the job ran longer than activeDeadlineSeconds ({limit}s)",
               stop_workload=b.seen.exists)
        return True
    return False


def _suspended(b: _Builder) -> bool:
    """spec.runPolicy.suspend: stop the workers (a queued job through Kueue's switch, which
    frees its quota), and say so."""
    if not b.job.spec.run_policy.suspend:
        return False
    seen, status = b.seen, b.status
    if seen.queue_active or (seen.exists and not seen.suspended and seen.queue_active is None):
        b.act("suspend", "spec.runPolicy.suspend")
    admitted = condition(status, ConditionType.ADMITTED)
    if queued(b.job) and admitted is not None and admitted.status == "True":
        b.cond(ConditionType.ADMITTED, False, AdmittedReason.SUSPENDED,
               "suspended by spec.runPolicy.suspend: Kueue "
               "frees the job's quota, and it queues again when resumed")
    if status.phase != "Suspended" and (status.launched_spec or not seen.exists):
        freed = " and Kueue frees the job's quota" if queued(b.job) else ""
        b.cond(ConditionType.RUNNING, False, RunningReason.SUSPENDED, "")
        b.cond(ConditionType.SUSPENDED, True, SuspendedReason.SUSPENDED_BY_USER,
               f"workers checkpoint and stop{freed}; "
               "set spec.runPolicy.suspend=false to resume")
        b.phase("Suspended", "suspended by spec.runPolicy.suspend")
    return True


def _resumed(b: _Builder) -> bool:
    """suspend cleared: start again (or queue again) once the old workers have stopped."""
    seen, status = b.seen, b.status
    if status.phase != "Suspended":
        return False
    if seen.exists and seen.suspended and seen.stopping:
        # a new gang now would resume from an older checkpoint than the one being written
        status.message = ("resuming once the suspended workers have stopped (they write "
                          "a checkpoint first)")
        b.requeue(2)
        return True
    b.cond(ConditionType.SUSPENDED, False, SuspendedReason.RESUMED, "")
    if seen.queue_active is False or (seen.exists and seen.suspended and not queued(b.job)):
        b.act("resume", "spec.runPolicy.suspend cleared")
    if queued(b.job) and seen.exists:  # back in the queue: Kueue resumes it on admission
        _wait_for_queue(b)  # what Kueue said was read before the resume: the suspension
    else:
        b.phase("Launching", "resuming from the last checkpoint")
    status.launch_time = b.now
    return True


def _progress(b: _Builder) -> bool:
    _merge_progress(b, b.seen.progress)
    return False


def _restarting(b: _Builder) -> bool:
    """A gang restart waits until the old workload is gone; so does a new job whose name
    a deleted job's workers still hold."""
    seen = b.seen
    if not (seen.deleting or (seen.exists and b.status.phase == "Restarting")):
        return False
    if not seen.deleting:  # the delete was asked for but has not shown yet: ask again
        b.act("delete-workload", "restart")
    elif b.status.phase in (None, "Pending") and seen.waiting:
        b.status.phase = "Pending"  # another job's leftovers: said in the status alone
        b.status.message = seen.waiting
    b.requeue(2)
    return True


def _launch(b: _Builder) -> bool:
    """Nothing running: launch (the first time, or the next attempt after a restart)."""
    if b.seen.exists:
        return False
    status, job = b.status, b.job
    if b.launch_at is not None:
        if status.phase in (None, "Pending"):  # said in the status alone: no event per job
            # the time of day, not a countdown: each look says the same, so the status is
            # written once however often the job is looked at before its turn
            status.phase = "Pending"
            status.message = (f"waiting for its turn to launch at "
                              f"{b.launch_at.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ} "
                              "(the operator paces launches: --launch-rate, the chart's "
                              "launchRate)")
        b.requeue(max(0.0, (b.launch_at - b.now).total_seconds()))
        return True
    b.act("launch")
    edited = status.phase == "Restarting" and not status.launched_spec  # _relaunch_as_edited
    if not status.launched_spec and b.feasibility is not None:
        status.plan = b.feasibility.plan  # what this and every later launch renders
        for warning in b.feasibility.warnings:
            b.event("Warning", EventReason.PLAN_WARNING, warning)
    status.launched_spec = spec_fingerprint(job)
    status.spec_at_launch = _spec_at_launch(job)
    status.launch_time = b.now
    status.start_time = status.start_time or b.now
    first = status.phase in (None, "Pending")
    if first and queued(job):  # created suspended: nothing runs before Kueue admits it
        _wait_for_queue(b)
    elif first:
        b.phase("Launching", "creating workers")
    elif edited and queued(job):
        _wait_for_queue(b, "the edited spec is a new Job, which Kueue admits like any other",
                        reason=AdmittedReason.REQUEUED_BY_EDIT)
    elif edited:
        b.phase("Launching", "creating workers with the edited spec")
    elif status.phase == "Restarting" and queued(job):
        # a new Job is a new Workload to Kueue: it queues again (docs/kueue.md says why the
        # gang is not restarted inside the admitted Job)
        _wait_for_queue(b, f"the gang restarts (restart {status.restarts}) as a new Job, "
                        "which Kueue admits like any other; it resumes from the last "
                        "checkpoint", reason=AdmittedReason.REQUEUED_BY_RESTART)
    elif status.phase == "Restarting":
        b.phase("Launching", f"restarting the gang (restart {status.restarts}); it resumes "
                "from the last checkpoint")
    else:  # launched, not finished, and nothing there: removed outside the operator
        message = ("the workers were deleted outside the operator; launching them again "
                   "(not counted against backoffLimit); they resume from the last checkpoint")
        b.event("Warning", EventReason.WORKERS_MISSING, message)
        b.phase("Launching", message)
    b.requeue(5)
    return True


def _adopted(b: _Builder) -> bool:
    """The workload exists but the status never recorded its launch: an operator that
    stopped before it could. Take it over as if this one had launched it."""
    status = b.status
    if status.launched_spec:
        return False
    status.launched_spec = spec_fingerprint(b.job)
    status.spec_at_launch = _spec_at_launch(b.job)
    if b.feasibility is not None:
        status.plan = status.plan or b.feasibility.plan
    status.launch_time = status.launch_time or b.now
    status.start_time = status.start_time or b.now
    if status.phase in (None, "Pending"):
        b.phase("Launching", "adopted workers launched before an operator restart")
    return False


def _succeeded(b: _Builder) -> bool:
    if not b.seen.succeeded:
        return False
    status = b.status
    where = f"the model is in {b.job.spec.output.uri}/final"
    early = b.seen.progress.stopped_early if b.seen.progress else None
    b.cond(ConditionType.RUNNING, False, RunningReason.COMPLETED, "")
    if early:
        b.cond(ConditionType.COMPLETE, True, CompleteReason.STOPPED_EARLY, early)
        b.phase("Succeeded", f"training {early}; {where}")
    else:
        b.cond(ConditionType.COMPLETE, True, CompleteReason.TRAINING_FINISHED, where)
        b.phase("Succeeded", f"training finished; {where}")
    status.completion_time = b.now
    if status.progress:
        status.progress.eta_seconds = 0
    _exported(b, b.seen.progress.exports if b.seen.progress else None)
    return True


def _exported(b: _Builder, exports: list[dict[str, str]] | None) -> None:
    """The pushes to spec.output.export, once: `Exported` and an event. A failed one leaves
    the job Succeeded (the model is in the output folder), said with the fix."""
    if not exports:
        return
    failed = [e for e in exports if e.get("error")]
    if failed:
        targets = {t.uri: t for t in b.job.spec.output.export if t.pushed_by_trainer}
        folders = dict.fromkeys(
            f"{b.job.spec.output.uri}/{'merged' if targets[e['uri']].merged else 'final'}"
            for e in failed if e["uri"] in targets)  # a registration says its own fix
        message = "; ".join(f"{e['uri']}: {e['error']}" for e in failed) + (
            f" — the model is in {' and '.join(folders)}: push it by hand with `finetune "
            "export` once fixed" if folders else "")
        b.cond(ConditionType.EXPORTED, False, ExportedReason.EXPORT_FAILED, message)
        b.event("Warning", ExportedReason.EXPORT_FAILED, message)
        return
    message = "pushed " + ", ".join(e.get("pushed", e["uri"]) for e in exports)
    b.cond(ConditionType.EXPORTED, True, ExportedReason.PUSHED, message)
    b.event("Normal", ExportedReason.PUSHED, message)


def _admitted_by_kueue(b: _Builder) -> bool:
    """Kueue unsuspended the Job (before a failure is judged, so a failed job's conditions
    are current); the startup deadline counts from here."""
    if queued(b.job) and not b.seen.suspended:
        b.cond(ConditionType.ADMITTED, True, AdmittedReason.ADMITTED, "")
        if b.status.phase == "Queued":
            b.phase("Launching", "admitted by Kueue; starting the workers")
            b.status.launch_time = b.now
    return False


def _failed(b: _Builder) -> bool:
    if b.seen.failure is None:
        return False
    _restart_or_fail(b, b.seen.failure)
    return True


def _parts_missing(b: _Builder) -> bool:
    """The workers need them to start (after a restart, a resume, admission): put back what
    was deleted by hand (launch is idempotent)."""
    if b.seen.missing:
        what = ", ".join(b.seen.missing)
        b.event("Warning", EventReason.CHILD_RECREATED,
                f"{what} deleted outside the operator; recreating it")
        b.act("launch", f"recreate {what}")
    return False


def _in_backend_queue(b: _Builder) -> bool:
    """The backend's own queue (Azure ML waiting for compute)."""
    if not b.seen.queued:
        return False
    b.cond(ConditionType.ADMITTED, False, AdmittedReason.WAITING_FOR_CAPACITY, b.seen.queued)
    b.phase("Queued", b.seen.queued)
    b.status.launch_time = b.now  # the startup deadline counts from leaving the queue
    b.requeue(15)
    return True


def _held_suspended(b: _Builder) -> bool:
    """The workload exists suspended: created so for Kueue and not admitted yet, evicted by
    Kueue, or suspended by someone else."""
    seen, job = b.seen, b.job
    if not seen.suspended:
        return False
    admitted = condition(b.status, ConditionType.ADMITTED)
    if queued(job) and admitted is not None and admitted.status == "True":
        said = seen.queue_evicted or seen.queue_message
        why = f" ({said})" if said else ""
        message = (f"Kueue evicted the job{why} and suspended its workers, which checkpoint "
                   f"and stop; it waits in queue {job.spec.kubernetes.queue_name} to be "
                   "admitted again and resumes from the last checkpoint (not counted against "
                   "backoffLimit)")
        b.event("Warning", AdmittedReason.PREEMPTED, message)
        b.cond(ConditionType.ADMITTED, False, AdmittedReason.PREEMPTED, message)
        b.cond(ConditionType.RUNNING, False, RunningReason.PREEMPTED, message)
        b.phase("Queued", message)
    elif queued(job) and admitted is not None and admitted.reason in (
            AdmittedReason.PREEMPTED, AdmittedReason.REQUEUED_BY_RESTART):
        if seen.queue_message:  # Kueue's latest word; the reason says why it queues again
            _wait_for_queue(b, seen.queue_message, reason=admitted.reason)
    elif queued(job):
        _wait_for_queue(b, seen.queue_message)
    else:  # suspended by someone else: the startup deadline counts once it runs
        b.cond(ConditionType.ADMITTED, False, AdmittedReason.WAITING_FOR_QUEUE,
               "the workload is suspended")
        b.phase("Queued", "waiting in the queue")
        b.status.launch_time = b.now
    b.requeue(15)  # under Kueue the startup deadline counts from admission (see above)
    return True


def _running(b: _Builder) -> bool:
    if condition(b.status, ConditionType.ADMITTED):
        b.cond(ConditionType.ADMITTED, True, AdmittedReason.ADMITTED, "")
    if not (b.seen.running or b.seen.progress is not None):
        return False
    if b.status.phase != "Running":
        b.cond(ConditionType.RUNNING, True, RunningReason.WORKERS_RUNNING, "")
    exporting = b.seen.progress is not None and b.seen.progress.exporting
    b.phase("Running", "steps done; pushing the model to " + ", ".join(
        t.uri for t in b.job.spec.output.export) if exporting else "training")
    _watch_for_stall(b)
    return True


def _starting(b: _Builder) -> bool:
    """Launched but not running yet: the startup deadline. Workers that ran since the launch
    are past it, though not all run now: one rank ends before the others."""
    if b.status.phase == "Running":
        b.requeue(10.0)
        return True
    deadline = b.job.spec.run_policy.startup_deadline_seconds
    waited = _seconds_since(b.status.launch_time, b.now)
    if deadline and waited > deadline:
        why = b.seen.waiting or "workers did not start"
        b.fail(FailedReason.STARTUP_DEADLINE_EXCEEDED, f"workers did not start within "
               f"startupDeadlineSeconds ({deadline}s): {why}", stop_workload=True)
        return True
    if b.seen.waiting:
        reason = b.seen.blocked or RunningReason.WORKERS_WAITING
        before = condition(b.status, ConditionType.RUNNING)
        if b.seen.blocked and (before is None or before.reason != reason):
            # `kubectl describe`, kubectl get events and event exporters see what to fix
            b.event("Warning", reason, f"workers cannot start: {b.seen.waiting}")
        b.cond(ConditionType.RUNNING, False, reason, b.seen.waiting)
        b.status.message = f"waiting for workers: {b.seen.waiting}"
    b.requeue(min(10.0, max(1.0, deadline - waited)) if deadline else 10.0)
    return True


GUARDS: tuple[Callable[[_Builder], bool], ...] = (
    _finished, _admitted, _output_in_use, _backend_health, _active_deadline, _suspended,
    _resumed, _progress, _restarting, _launch, _adopted, _succeeded, _admitted_by_kueue, _failed,
    _parts_missing, _in_backend_queue, _held_suspended, _running, _starting)
"""`reconcile`'s questions, in order."""


def _degraded(b: _Builder, reason: DegradedReason, message: str) -> None:
    before = condition(b.status, ConditionType.DEGRADED)
    if before is None or before.status != "True" or before.message != message:
        b.event("Warning", EventReason.DEGRADED, message)
    b.cond(ConditionType.DEGRADED, True, reason, message)


def _feasible(b: _Builder, plan: Feasibility) -> bool:
    """Record the planner's verdict; False when the job must not launch."""
    if plan.fits is None:
        b.cond(ConditionType.FEASIBLE, None, FeasibleReason.UNKNOWN, plan.message)
        return True
    if plan.fits:
        b.cond(ConditionType.FEASIBLE, True, FeasibleReason.FITS, plan.message)
        return True
    if b.job.spec.resources.skip_feasibility_check:
        b.cond(ConditionType.FEASIBLE, False, FeasibleReason.CHECK_SKIPPED,
               f"{plan.message}; launched anyway because "
               "spec.resources.skipFeasibilityCheck is true")
        return True
    before = condition(b.status, ConditionType.FEASIBLE)
    message = (f"{plan.message}. Change the spec as suggested (or another gpuType), or set "
               "spec.resources.skipFeasibilityCheck: true to launch anyway")
    if before is None or before.status != "False" or before.message != message:
        b.event("Warning", EventReason.INFEASIBLE, message)
    b.cond(ConditionType.FEASIBLE, False, FeasibleReason.DOES_NOT_FIT, message)
    b.status.phase = "Pending"
    b.status.message = "not launched: predicted not to fit its gpuType (see Feasible)"
    return False


def queued(job: FineTuneJob) -> bool:
    """The job waits in a Kueue queue (`spec.kubernetes.queueName`)."""
    return bool(job.spec.kubernetes and job.spec.kubernetes.queue_name)


def _wait_for_queue(b: _Builder, why: str | None = None,
                    reason: AdmittedReason = AdmittedReason.WAITING_FOR_QUEUE) -> None:
    """Phase Queued; `why`: Kueue's own words, or ours, shown in the status and describe."""
    queue = b.job.spec.kubernetes.queue_name if b.job.spec.kubernetes else None
    message = f"waiting for Kueue to admit the job from queue {queue}"
    if why:
        message += f": {why}"
    b.cond(ConditionType.ADMITTED, False, reason, message)
    b.phase("Queued", message)


def _restart_or_fail(b: _Builder, failure: Failure) -> Decision:
    status, limit = b.status, b.job.spec.run_policy.backoff_limit
    if failure.kind == "refused":
        return b.fail(failure.reason, failure.message, stop_workload=True)
    counted = failure.kind == "worker"
    if failure.setup and _never_trained(status) and status.restarts >= min(limit, 1):
        tries = f"after {status.restarts} restart{'s' * (status.restarts != 1)}"
        return b.fail(FailedReason.WORKER_SETUP_FAILED,
                      f"{failure.message} ({tries}, never having trained: "
                      "every attempt would fail the same way until the workers' image "
                      "changes)", stop_workload=True)
    if counted and status.restarts >= limit:
        return b.fail(FailedReason.BACKOFF_LIMIT_EXCEEDED,
                      f"{failure.message} (restart budget of {limit} "
                      "used up)", stop_workload=True)
    if counted:
        status.restarts += 1
    cause = {"worker": "a worker failed", "preempted": "a worker was preempted",
             "stopped": "workers were stopped"}[failure.kind]
    b.cond(ConditionType.RUNNING, False, RunningReason.RESTARTING, failure.message)
    b.act("delete-workload", failure.kind)
    budget = f"restart {status.restarts} of {limit}" if counted else "not counted"
    if failure.setup and _never_trained(status):
        budget += "; the same failure again before any step fails the job"
    b.phase("Restarting", f"{cause}: {failure.message}; restarting the gang ({budget})")
    b.requeue(2)
    return b.decision


def _never_trained(status: FineTuneJobStatus) -> bool:
    """No attempt of the job has completed a step or a checkpoint."""
    return not (status.progress and status.progress.step) and status.last_checkpoint is None


def _watch_for_stall(b: _Builder) -> Decision:
    if b.seen.progress_unreadable:
        b.requeue(30.0)
        return b.decision
    timeout = b.job.spec.run_policy.stall_timeout_seconds
    progress = b.status.progress
    if progress is not None and progress.exporting:  # steps over: a long push is no hang
        b.requeue(30.0)
        return b.decision
    # measured from the later of the last step and this attempt's launch
    marks = [t for t in (progress.last_step_time if progress else None, b.status.launch_time)
             if t is not None]
    quiet = _seconds_since(max(marks) if marks else None, b.now)
    if timeout and quiet > timeout:
        step = progress.step if progress else None
        b.cond(ConditionType.STALLED, True, StalledReason.NO_PROGRESS,
               f"no step completed for {int(quiet)}s "
               f"(stallTimeoutSeconds {timeout}) at step {step}")
        return _restart_or_fail(b, Failure("worker", f"no progress for {int(quiet)}s at step "
                                           f"{step}: the gang looks hung"))
    if (stalled := condition(b.status, ConditionType.STALLED)) and stalled.status == "True":
        b.cond(ConditionType.STALLED, False, StalledReason.PROGRESSING, "")
    b.requeue(min(30.0, max(1.0, timeout - quiet)) if timeout else 30.0)
    return b.decision


def next_deadline(policy: RunPolicy, status: FineTuneJobStatus, now: datetime) -> float | None:
    """Seconds until a rule that only the clock can fire is due (activeDeadlineSeconds, the
    startup deadline, a stall, the TTL after finishing), for `status` as `reconcile` left
    it; None when no such rule applies. Everything else a job waits for is a change some
    watch reports: a look at each idle job on a timer is not needed."""
    due: list[float] = []
    if status.phase in TERMINAL_PHASES:
        if policy.ttl_seconds_after_finished is not None:
            due.append(policy.ttl_seconds_after_finished
                       - _seconds_since(status.completion_time, now))
    else:
        if policy.active_deadline_seconds and status.start_time:
            due.append(policy.active_deadline_seconds - _seconds_since(status.start_time, now))
        if status.phase == "Launching" and policy.startup_deadline_seconds and (
                status.launch_time):
            due.append(policy.startup_deadline_seconds
                       - _seconds_since(status.launch_time, now))
        if status.phase == "Running" and policy.stall_timeout_seconds:
            progress = status.progress
            marks = [t for t in (progress.last_step_time if progress else None,
                                 status.launch_time) if t is not None]
            due.append(policy.stall_timeout_seconds
                       - _seconds_since(max(marks) if marks else None, now))
    return max(0.0, min(due)) if due else None
