"""Azure ML job states → the reconciler's Observation → phases and conditions (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from finetune_operator.api import BackendRef, FineTuneJobStatus, Progress
from finetune_operator.backends.azureml import states
from finetune_operator.backends.azureml.states import AzureJob
from finetune_operator.reconcile import Observation, condition, reconcile, spec_fingerprint
from finetune_operator.validation import parse_job
from tests.conftest import minimal_job

T0 = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
AML = {"subscriptionId": "00000000-0000-0000-0000-000000000000", "resourceGroup": "rg",
       "workspace": "ws", "compute": "gpu"}


def aml_job(phase: str | None = "Launching", suspend: bool = False):
    doc = minimal_job(backend="azureml", azureml=AML, runPolicy={"suspend": suspend},
                      output={"uri": "azureml://datastores/blob/paths/out"})
    doc["metadata"].update(uid="0b5e6c7e-1234-4abc-9def-001122334455", generation=1)
    job = parse_job(doc)
    if phase is not None:
        job.status = FineTuneJobStatus(phase=phase, launch_time=T0, start_time=T0,
                                       launched_spec=spec_fingerprint(job))
    return job


def azure(status: str) -> AzureJob:
    return AzureJob(name="demo-0b5e6c7e1234", status=status, compute="gpu",
                    studio_url="https://ml.azure.com/runs/demo-0b5e6c7e1234")


@pytest.mark.parametrize(("state", "expected"), [
    ("NotStarted", {"exists": True, "waiting": "Azure ML job demo-0b5e6c7e1234 is NotStarted"}),
    ("Starting", {"exists": True, "waiting": "Azure ML job demo-0b5e6c7e1234 is Starting"}),
    ("Provisioning", {"exists": True,
                      "waiting": "Azure ML job demo-0b5e6c7e1234 is Provisioning"}),
    ("Preparing", {"exists": True, "waiting": "Azure ML job demo-0b5e6c7e1234 is Preparing"}),
    ("Queued", {"exists": True, "queued": "Azure ML job demo-0b5e6c7e1234 is Queued: waiting "
                "for capacity on compute gpu"}),
    ("Running", {"exists": True, "running": True}),
    ("Finalizing", {"exists": True, "running": True}),
    ("CancelRequested", {"exists": True, "deleting": True}),
    ("Completed", {"exists": True, "succeeded": True}),
])
def test_states_map_to_observations(state, expected):
    seen = states.observe(aml_job(), azure(state))
    assert seen == Observation(**expected, backend_ref=BackendRef(
        kind="AzureMLJob", name="demo-0b5e6c7e1234",
        url="https://ml.azure.com/runs/demo-0b5e6c7e1234"))


def test_failed_and_cancelled_are_failed_attempts_with_the_reason():
    failed = states.observe(aml_job(), azure("Failed"))
    assert failed.failure.kind == "worker"
    assert "failed; its logs are in Azure ML Studio: https://ml.azure.com/runs/" in (
        failed.failure.message)

def test_progress_that_cannot_be_read_is_not_taken_for_a_hung_gang():
    """The operator's identity cannot read the MLflow run, or the tracking service is down:
    the stall check restarted a healthy job every stallTimeoutSeconds until its budget was
    gone. Now a Degraded condition says why, and the stall check waits."""
    job = aml_job("Running")
    later = T0 + timedelta(hours=2)
    job.status.progress = Progress(step=500, last_step_time=T0 + timedelta(minutes=5))
    seen = states.observe(job, azure("Running"), unread="the tracking service answered 403")
    decision = reconcile(job, seen, later)
    assert decision.status.phase == "Running" and decision.actions == []
    degraded = condition(decision.status, "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ProgressUnreadable")
    assert "(the tracking service answered 403); the stall check waits" in degraded.message
    readable = reconcile(job, states.observe(job, azure("Running")), later)
    assert readable.status.phase == "Restarting"  # read again, and 2 h without a step


def test_a_job_cancelled_in_studio_ends_without_another_attempt():
    """Someone meant it to stop: submitting it again would undo that, on GPU nodes."""
    cancelled = states.observe(aml_job("Running"), azure("Canceled"))
    assert (cancelled.failure.kind, cancelled.failure.reason) == ("refused",
                                                                  "CancelledInAzureML")
    decision = reconcile(aml_job("Running"), cancelled, T0)
    assert decision.status.phase == "Failed" and decision.status.restarts == 0
    assert "cancelled outside the operator (Azure ML Studio or the CLI)" in (
        condition(decision.status, "Failed").message)
    assert "spec.runPolicy.suspend" in condition(decision.status, "Failed").message


@pytest.mark.parametrize("state", ["Unknown", "Preparing", "Starting"])
def test_an_attempt_seen_running_that_reports_another_state_runs_on(state):
    """The SDK's own words: NotResponding can go back to any earlier state, and Unknown is
    its fallback. Read as "still starting", a job launched hours ago failed at once on its
    startup deadline, and its Azure ML job was cancelled."""
    job = aml_job("Running")
    job.status.backend_ref = states.backend_ref(azure("Running"))
    later = T0 + timedelta(hours=2)
    job.status.progress = Progress(step=500, last_step_time=later - timedelta(minutes=1))
    seen = states.observe(job, azure(state))
    assert seen.running and f"reports {state} after it ran" in seen.degraded
    decision = reconcile(job, seen, later)
    assert decision.status.phase == "Running" and decision.actions == []
    assert condition(decision.status, "Degraded").status == "True"
    # a new attempt that is still starting is waited for, as before
    assert states.observe(aml_job("Launching"), azure(state)).waiting


def test_a_workers_refusal_on_the_run_fails_the_job_at_once():
    """The trainer's tags on the job's run (finetune_trainer.tracking): its exit 2 or 4 is
    the same on every attempt, so no attempt is submitted again; its exit 5 (the image
    cannot set the workers up) is submitted again once, then fails the job; another failure
    is quoted and counted."""
    data = {"tags": [{"key": "mlflow.user", "value": "x"}, {"key": "finetune.refused",
             "value": "2 /mnt/data/chats.jsonl:2: is not valid JSON — fix or remove it"}]}
    seen = states.observe(aml_job(), azure("Failed"), tags=states.tags_of(data))
    assert (seen.failure.kind, seen.failure.reason) == ("refused", "InputRefused")
    assert seen.failure.message == (
        "Azure ML job demo-0b5e6c7e1234 failed: /mnt/data/chats.jsonl:2: is not valid JSON — "
        "fix or remove it (its logs are in Azure ML Studio: "
        "https://ml.azure.com/runs/demo-0b5e6c7e1234)")
    decision = reconcile(aml_job("Running"), seen, T0)
    assert decision.status.phase == "Failed" and decision.status.restarts == 0
    assert condition(decision.status, "Failed").reason == "InputRefused"

    other = states.observe(aml_job(), azure("Failed"), tags={
        "finetune.refused": "4 /out holds checkpoints trained with other settings (...)"})
    assert (other.failure.kind, other.failure.reason) == ("refused",
                                                          "OtherSettingsCheckpoints")
    setup = states.observe(aml_job(), azure("Failed"), tags={
        "finetune.refused": "5 op 'deepspeed_shm_comm' could not be built in this image: "
                            "/bin/sh: 1: c++: not found (...)"})
    assert (setup.failure.kind, setup.failure.setup) == ("worker", True)
    again = reconcile(aml_job("Running"), setup, T0)
    assert again.status.restarts == 1 and again.status.phase != "Failed"
    resubmitted = aml_job("Running")  # the attempt submitted again fails the same way
    resubmitted.status.restarts = 1
    ended = reconcile(resubmitted, setup, T0)
    assert ended.status.phase == "Failed"
    assert condition(ended.status, "Failed").reason == "WorkerSetupFailed"
    assert "c++: not found" in condition(ended.status, "Failed").message
    crashed = states.observe(aml_job(), azure("Failed"), tags={
        "finetune.failure": "rank 5: RuntimeError: CUDA error: an illegal memory access"})
    assert crashed.failure.kind == "worker" and crashed.failure.message.startswith(
        "Azure ML job demo-0b5e6c7e1234 failed: rank 5: RuntimeError: CUDA error")
    assert reconcile(aml_job("Running"), crashed, T0).status.restarts == 1


def test_not_responding_runs_on_degraded():
    seen = states.observe(aml_job(), azure("NotResponding"))
    assert seen.running and seen.failure is None
    assert "NotResponding" in seen.degraded and "may recover" in seen.degraded


def test_what_we_cancelled_is_suspended_or_gone():
    for state in ("CancelRequested", "Canceled"):
        assert states.observe(aml_job("Running", suspend=True), azure(state)).suspended
        assert states.observe(aml_job("Suspended"), azure(state)).suspended
    assert not states.observe(aml_job("Running", suspend=True), azure("Running")).suspended
    gone = states.observe(aml_job("Restarting"), azure("Failed"))
    assert not gone.exists and gone.backend_ref.name == "demo-0b5e6c7e1234"
    assert states.observe(aml_job("Restarting"), azure("CancelRequested")).deleting
    # still cancelling: a resume waits for its workers' checkpoint
    assert states.observe(aml_job("Suspended"), azure("CancelRequested")).stopping
    assert not states.observe(aml_job("Suspended"), azure("Canceled")).stopping
    assert states.observe(aml_job(), None) == Observation()


def test_progress_from_the_runs_latest_metrics():
    metrics = [{"key": "loss", "value": 1.5, "step": 30}, {"key": "loss", "value": 1.25,
                                                          "step": 40},
               {"key": "total_steps", "value": 100.0, "step": 40},
               {"key": "tokens_per_second", "value": 5e4, "step": 40},
               {"key": "epoch", "value": 0.4, "step": 40},
               {"key": "eta_seconds", "value": 600.0, "step": 40},
               {"key": "learning_rate", "value": 1e-4, "step": 40}]
    progress = states.progress_from_metrics(metrics)
    assert (progress.step, progress.total_steps, progress.loss, progress.tokens_per_second,
            progress.epoch, progress.eta_seconds) == (40, 100, 1.25, 5e4, 0.4, 600)
    assert states.progress_from_metrics([]) is None
    assert states.progress_from_metrics([{"key": "gpu_util", "value": 1.0, "step": 1}]) is None


def test_the_current_attempt_comes_from_the_status():
    job = aml_job()
    assert states.current_attempt(job) == 1
    job.status.backend_ref = BackendRef(kind="AzureMLJob", name="demo-0b5e6c7e1234-3")
    assert states.current_attempt(job) == 3
    job.status.backend_ref = BackendRef(kind="Job", name="demo")
    assert states.current_attempt(job) == 1


# --- what the reconciler makes of them ------------------------------------------------------

def test_queued_in_azure_ml_is_phase_queued_and_holds_the_startup_deadline():
    job = aml_job()
    now = T0 + timedelta(hours=2)  # far past startupDeadlineSeconds (1800)
    decision = reconcile(job, states.observe(job, azure("Queued")), now)
    assert decision.status.phase == "Queued" and decision.actions == []
    assert condition(decision.status, "Admitted").reason == "WaitingForCapacity"
    assert decision.status.launch_time == now
    job.status = decision.status
    running = reconcile(job, states.observe(job, azure("Running")), now)
    assert running.status.phase == "Running"
    assert condition(running.status, "Admitted").status == "True"
    assert running.status.backend_ref.url.startswith("https://ml.azure.com/runs/")


def test_not_responding_sets_degraded_and_recovery_clears_it():
    job = aml_job("Running")
    degraded = reconcile(job, states.observe(job, azure("NotResponding")), T0)
    assert condition(degraded.status, "Degraded").status == "True"
    assert degraded.status.phase == "Running" and degraded.actions == []
    assert [e.reason for e in degraded.events] == ["Degraded"]
    job.status = degraded.status
    again = reconcile(job, states.observe(job, azure("NotResponding")), T0)
    assert again.events == []  # one event per change, not per look
    recovered = reconcile(job, states.observe(job, azure("Running")), T0)
    assert condition(recovered.status, "Degraded").status == "False"


def test_an_unreachable_backend_decides_nothing():
    job = aml_job(phase=None)
    decision = reconcile(job, Observation(unreachable="identity refused — fix it"), T0)
    assert decision.actions == [] and decision.status.phase == "Pending"
    degraded = condition(decision.status, "Degraded")
    assert (degraded.status, degraded.reason, degraded.message) == (
        "True", "BackendUnreachable", "identity refused — fix it")
    assert "cannot reach the backend" in decision.status.message
