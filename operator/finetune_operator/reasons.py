"""The words the operator writes where machines read them: a FineTuneJob's condition types,
the reason on each condition, and the reasons of the events it posts on jobs and sweeps.

One vocabulary, declared beside the status types as Kubeflow Trainer and Kueue declare
theirs, so that a cause is spelled the same by every backend, alerts can match on it, and
docs/troubleshooting.md can be held to it: each section of that page lists exactly the
members of its enum here (tests/docs/test_troubleshooting.py), and no module of the
operator writes one of these words as a bare string (tests/code/test_reasons.py).

A new reason: a member in the enum of its condition, a row in that condition's section of
the troubleshooting page (what it means, what to do), then the code that sets it.
"""

from __future__ import annotations

from enum import StrEnum


class ConditionType(StrEnum):
    """A FineTuneJob's conditions (`status.conditions[].type`)."""

    VALIDATED = "Validated"
    FEASIBLE = "Feasible"
    ADMITTED = "Admitted"
    RUNNING = "Running"
    COLLECTIVE_PREFLIGHT = "CollectivePreflight"
    STALLED = "Stalled"
    DEGRADED = "Degraded"
    SUSPENDED = "Suspended"
    SPEC_CHANGE_REFUSED = "SpecChangeRefused"
    COMPLETE = "Complete"
    EXPORTED = "Exported"
    FAILED = "Failed"


class ValidatedReason(StrEnum):
    VALID = "Valid"
    INVALID_SPEC = "InvalidSpec"


class FeasibleReason(StrEnum):
    FITS = "Fits"
    UNKNOWN = "Unknown"
    """The planner has no verdict (the condition's status is Unknown)."""
    DOES_NOT_FIT = "DoesNotFit"
    CHECK_SKIPPED = "CheckSkipped"


class AdmittedReason(StrEnum):
    ADMITTED = "Admitted"
    WAITING_FOR_QUEUE = "WaitingForQueue"
    REQUEUED_BY_RESTART = "RequeuedByRestart"
    REQUEUED_BY_EDIT = "RequeuedByEdit"
    PREEMPTED = "Preempted"
    SUSPENDED = "Suspended"
    WAITING_FOR_CAPACITY = "WaitingForCapacity"


class RunningReason(StrEnum):
    """The Running condition's own reasons. Besides them it carries a `FailedReason` once the
    job fails, and the kubelet's or the scheduler's word (`WaitingReason`) while workers
    cannot start."""

    WORKERS_RUNNING = "WorkersRunning"
    WORKERS_WAITING = "WorkersWaiting"
    RESTARTING = "Restarting"
    RELAUNCHING = "Relaunching"
    PREEMPTED = "Preempted"
    SUSPENDED = "Suspended"
    COMPLETED = "Completed"


class WaitingReason(StrEnum):
    """Why workers cannot start, in the words of the kubelet and the scheduler, which the
    Running condition and a Warning event pass on. Theirs, not ours: a word of theirs not
    listed here is passed on as it is."""

    UNSCHEDULABLE = "Unschedulable"
    SCHEDULING_GATED = "SchedulingGated"
    ERR_IMAGE_PULL = "ErrImagePull"
    """Also said for ImagePullBackOff and InvalidImageName (one cause, one fix)."""
    ERR_IMAGE_NEVER_PULL = "ErrImageNeverPull"
    FAILED_MOUNT = "FailedMount"
    FAILED_ATTACH_VOLUME = "FailedAttachVolume"
    FAILED_CREATE = "FailedCreate"
    """The Job controller's: it could not create a worker pod."""
    CREATE_CONTAINER_CONFIG_ERROR = "CreateContainerConfigError"
    CREATE_CONTAINER_ERROR = "CreateContainerError"
    RUN_CONTAINER_ERROR = "RunContainerError"


class CollectivePreflightReason(StrEnum):
    MEASURED = "Measured"
    SLOW_NODES = "SlowNodes"


class StalledReason(StrEnum):
    NO_PROGRESS = "NoProgress"
    PROGRESSING = "Progressing"


class DegradedReason(StrEnum):
    BACKEND_UNREACHABLE = "BackendUnreachable"
    BACKEND_DEGRADED = "BackendDegraded"
    PROGRESS_UNREADABLE = "ProgressUnreadable"
    RECOVERED = "Recovered"


class SuspendedReason(StrEnum):
    SUSPENDED_BY_USER = "SuspendedByUser"
    RESUMED = "Resumed"


class SpecChangeRefusedReason(StrEnum):
    IMMUTABLE_AFTER_LAUNCH = "ImmutableAfterLaunch"
    SPEC_MATCHES_LAUNCH = "SpecMatchesLaunch"


class CompleteReason(StrEnum):
    TRAINING_FINISHED = "TrainingFinished"
    STOPPED_EARLY = "StoppedEarly"


class ExportedReason(StrEnum):
    PUSHED = "Pushed"
    EXPORT_FAILED = "ExportFailed"


class FailedReason(StrEnum):
    """Why a job ended without a model; the Running condition says it too."""

    INVALID_SPEC = "InvalidSpec"
    OUTPUT_IN_USE = "OutputInUse"
    """Another live job holds the output folder (`output_folders`); an edit admits it again."""
    SPEC_EDITED = "SpecEdited"
    """Failed=False: a job refused before launch was edited and is admitted again."""
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    STARTUP_DEADLINE_EXCEEDED = "StartupDeadlineExceeded"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    WORKER_SETUP_FAILED = "WorkerSetupFailed"
    """The workers could not set themselves up in their image again after a restart."""
    INPUT_REFUSED = "InputRefused"
    """The trainer, or its fetch of the model, refused the model or the data (exit 2) on any
    backend: no attempt would differ."""
    OTHER_SETTINGS_CHECKPOINTS = "OtherSettingsCheckpoints"
    CANCELLED_IN_AZURE_ML = "CancelledInAzureML"


CONDITION_REASONS: dict[ConditionType, type[StrEnum]] = {
    ConditionType.VALIDATED: ValidatedReason,
    ConditionType.FEASIBLE: FeasibleReason,
    ConditionType.ADMITTED: AdmittedReason,
    ConditionType.RUNNING: RunningReason,
    ConditionType.COLLECTIVE_PREFLIGHT: CollectivePreflightReason,
    ConditionType.STALLED: StalledReason,
    ConditionType.DEGRADED: DegradedReason,
    ConditionType.SUSPENDED: SuspendedReason,
    ConditionType.SPEC_CHANGE_REFUSED: SpecChangeRefusedReason,
    ConditionType.COMPLETE: CompleteReason,
    ConditionType.EXPORTED: ExportedReason,
    ConditionType.FAILED: FailedReason,
}
"""Each condition type's own reasons."""


class EventReason(StrEnum):
    """Events on a FineTuneJob besides those named by a condition's reason (`Preempted`,
    `Pushed`, `ExportFailed`, a waiting word) and those named by the phase they enter."""

    LAUNCH_BLOCKED = "LaunchBlocked"
    RETRYING = "Retrying"
    INFEASIBLE = "Infeasible"
    PLAN_WARNING = "PlanWarning"
    DEGRADED = "Degraded"
    SPEC_CHANGE_REFUSED = "SpecChangeRefused"
    SPEC_CHANGE_APPLIED = "SpecChangeApplied"
    SPEC_CHANGE_IGNORED = "SpecChangeIgnored"
    WORKERS_MISSING = "WorkersMissing"
    CHILD_RECREATED = "ChildRecreated"


class SweepReason(StrEnum):
    """Events on a FineTuneSweep (it has a phase, no conditions)."""

    INVALID = "Invalid"
    TRIAL_CREATED = "TrialCreated"
    TRIAL_STOPPED = "TrialStopped"
    TRIAL_REFUSED = "TrialRefused"
    SWEEP_SUCCEEDED = "SweepSucceeded"
    SWEEP_FAILED = "SweepFailed"
    SPEC_CHANGE_IGNORED = "SpecChangeIgnored"
