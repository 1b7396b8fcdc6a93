"""Azure ML's answers → what the reconciler needs. Pure: the client fetches, this reads.

Job states (Azure ML): NotStarted, Starting, Provisioning, Preparing, Queued, Running,
Finalizing, CancelRequested, Completed, Failed, Canceled, NotResponding, Paused.
NotResponding can recover, so it is a Degraded condition, not an end; so is any other
state an attempt reports after it was seen running (Unknown, the SDK's fallback, or a
starting state again).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

from finetune_operator.api import BackendRef, FineTuneJob, Progress
from finetune_operator.backends.azureml.jobspec import attempt_of
from finetune_operator.reasons import FailedReason
from finetune_operator.reconcile import Failure, Observation
from finetune_trainer.exits import EXIT_BAD_INPUT, EXIT_OTHER_CHECKPOINTS, EXIT_SETUP
from finetune_trainer.record import ProgressRecord
from finetune_trainer.tracking import (
    EXPORT_EVAL_LOSS_TAG,
    FAILURE_TAG,
    REFUSED_TAG,
    STOPPED_EARLY_TAG,
)

BACKEND_KIND = "AzureMLJob"
STARTING = frozenset({"NotStarted", "Starting", "Provisioning", "Preparing"})
QUEUED = frozenset({"Queued", "Paused"})
RUNNING = frozenset({"Running", "Finalizing"})
CANCELING = frozenset({"CancelRequested"})
ENDED = frozenset({"Completed", "Failed", "Canceled"})
NOT_RESPONDING = "NotResponding"
READ_RUN = RUNNING | {"Completed", "Failed", NOT_RESPONDING}
"""States whose MLflow run is read: progress, and a failed worker's reason (its tags)."""


@dataclass(frozen=True)
class AzureJob:
    """What the operator reads of one Azure ML job."""

    name: str
    status: str
    studio_url: str | None = None
    tracking_uri: str | None = None
    """The workspace's MLflow endpoint (azureml://<region>.api.azureml.ms/mlflow/...)."""
    compute: str | None = None

    @property
    def ended(self) -> bool:
        return self.status in ENDED


def current_attempt(job: FineTuneJob) -> int:
    """The attempt the status last pointed at (1 before any was seen)."""
    ref = job.status.backend_ref if job.status else None
    if ref is not None and ref.kind == BACKEND_KIND:
        return attempt_of(job, ref.name) or 1
    return 1


def backend_ref(azure: AzureJob) -> BackendRef:
    return BackendRef(kind=BACKEND_KIND, name=azure.name, url=azure.studio_url)


def observe(job: FineTuneJob, azure: AzureJob | None, progress: Progress | None = None,
            tags: dict[str, str] | None = None, unread: str | None = None) -> Observation:
    """The newest attempt of `job` (None: none exists) as the reconciler sees it; `tags`:
    its MLflow run's, where a failed worker left its reason and a finished run why it
    stopped early; `unread`: why that run could not be read."""
    seen = _observe(job, azure, progress, tags)
    if unread and seen.running:
        return replace(seen, progress_unreadable=(
            f"the progress of Azure ML job {azure.name if azure else ''} cannot be read from "
            f"its MLflow run ({unread})"))
    return seen


def _observe(job: FineTuneJob, azure: AzureJob | None, progress: Progress | None,
             tags: dict[str, str] | None) -> Observation:
    if azure is None:
        return Observation()
    ref, state, phase = backend_ref(azure), azure.status, (job.status.phase if job.status
                                                              else None)
    where = f"Azure ML job {azure.name}"
    if state == "Completed":
        return Observation(exists=True, succeeded=True, progress=final(progress, tags or {}),
                           backend_ref=ref)
    if job.spec.run_policy.suspend or phase == "Suspended":
        # we cancelled it to suspend: cancelled (or cancelling) is what suspended looks like
        suspended = state in CANCELING or azure.ended
        # still cancelling: its workers write their checkpoint, and a resume now would find
        # this attempt alive, submit nothing, and then read its Canceled as a failure
        return Observation(exists=True, suspended=suspended, stopping=state in CANCELING,
                           backend_ref=ref)
    if phase == "Restarting" and azure.ended:
        return Observation(backend_ref=ref)  # gone: the next attempt can be submitted
    if state in CANCELING:
        return Observation(exists=True, deleting=True, backend_ref=ref)
    if state == "Failed":
        return Observation(exists=True, backend_ref=ref, progress=progress,
                           failure=failure(where, azure, tags or {}))
    if state == "Canceled":
        # someone meant it to stop: submitting it again (the budget's worth of GPU nodes,
        # each time) would undo what they did
        return Observation(exists=True, backend_ref=ref, failure=Failure(
            "refused", f"{where} was cancelled outside the operator (Azure ML Studio or the "
            "CLI), so the job ends here; to stop a job and resume it later, set "
            "spec.runPolicy.suspend", reason=FailedReason.CANCELLED_IN_AZURE_ML))
    if state in QUEUED:
        on = f" on compute {azure.compute}" if azure.compute else ""
        return Observation(exists=True, backend_ref=ref,
                           queued=f"{where} is {state}: waiting for capacity{on}")
    if state in RUNNING:
        return Observation(exists=True, running=True, progress=progress, backend_ref=ref)
    if state == NOT_RESPONDING:
        return Observation(exists=True, running=True, progress=progress, backend_ref=ref,
                           degraded=f"{where} is NotResponding: Azure ML lost contact with "
                           "its workers; it may recover by itself")
    if phase == "Running" and job.status is not None and job.status.backend_ref is not None \
            and job.status.backend_ref.name == azure.name:
        # an attempt seen running that reports Unknown (the SDK's fallback) or a starting
        # state again: still followed as running, never failed by a startup deadline that
        # counts from its launch hours ago
        return Observation(exists=True, running=True, progress=progress, backend_ref=ref,
                           degraded=f"{where} reports {state} after it ran; the operator "
                           "follows it on until it runs or ends")
    # NotStarted, Starting, Provisioning, Preparing (image build, node setup), or a state
    # newer than this code: still on its way
    return Observation(exists=True, waiting=f"{where} is {state}", backend_ref=ref)


def progress_from_metrics(metrics: list[dict[str, Any]]) -> Progress | None:
    """status.progress from the MLflow run's latest metrics (`runs/get` → data.metrics),
    logged by the trainer under finetune_trainer.record's MLFLOW_METRICS names."""
    record = ProgressRecord.from_mlflow(metrics)
    return None if record is None else Progress.from_record(record)


def final(progress: Progress | None, tags: dict[str, str]) -> Progress | None:
    """A completed run's progress with what rank 0 tagged it with as it finished (the
    tracker's finish): why it stopped early, and its export's eval loss."""
    if progress is None:
        return None
    update: dict[str, Any] = {}
    if early := tags.get(STOPPED_EARLY_TAG):
        update["stopped_early"] = early
    with contextlib.suppress(KeyError, ValueError):  # none, or not a number
        update["eval_loss"] = float(tags[EXPORT_EVAL_LOSS_TAG])
    return progress.model_copy(update=update)


def tags_of(run_data: dict[str, Any]) -> dict[str, str]:
    """An MLflow run's tags (`runs/get` → data.tags, a list of {key, value}) by key."""
    return {tag["key"]: str(tag.get("value", "")) for tag in run_data.get("tags") or []
            if isinstance(tag, dict) and tag.get("key")}


def failure(where: str, azure: AzureJob, tags: dict[str, str]) -> Failure:
    """A failed attempt, with what its workers said (`finetune_trainer.tracking`): the model,
    the data or checkpoints of other settings refused fail the job at once, as on
    Kubernetes (every attempt would say the same), and what the image cannot set up (an
    import, an op that cannot be built) after one more attempt; anything else is a failed
    attempt."""
    studio = "its logs are in Azure ML Studio" + (f": {azure.studio_url}"
                                                  if azure.studio_url else "")
    code, _, line = tags.get(REFUSED_TAG, "").partition(" ")
    if code == str(EXIT_BAD_INPUT):
        return Failure("refused", f"{where} failed: {line} ({studio})",
                       reason=FailedReason.INPUT_REFUSED)
    if code == str(EXIT_OTHER_CHECKPOINTS):
        return Failure("refused", f"{where} failed: {line} ({studio})")
    if code == str(EXIT_SETUP):  # submitted again once at most (reconcile)
        return Failure("worker", f"{where} failed: {line} ({studio})", setup=True)
    said = tags.get(FAILURE_TAG)
    return Failure("worker", f"{where} failed: {said} ({studio})" if said
                   else f"{where} failed; {studio}")
