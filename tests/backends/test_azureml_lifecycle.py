"""The azureml backend's lifecycle through the real azure-ai-ml client: only the HTTP
transport is fake (canned REST answers), so request building, the SDK's error mapping and
azure-core's retry policy all run as they would against a workspace."""

from __future__ import annotations

import asyncio

import pytest

from finetune_operator.api import BackendRef, FineTuneJobStatus
from finetune_operator.backends import BackendContext, BackendError
from finetune_operator.backends.azureml.backend import AzureMLBackend
from finetune_operator.backends.azureml.client import ARM_SCOPE, RetrySettings
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import parse_job
from tests.conftest import minimal_job
from tests.support.azureml_fake import (
    RESOURCE_GROUP,
    SUBSCRIPTION,
    WORKSPACE,
    FakeAzureML,
    StaticCredential,
)

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:azure"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:marshmallow")]
UID = "0b5e6c7e-1234-4abc-9def-001122334455"
NAME = "demo-0b5e6c7e1234"
FAST = RetrySettings(total=3, backoff_factor=0.01, backoff_max=0.05, longest_wait=2.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def aml_job(phase: str | None = None, ref: str | None = None, suspend: bool = False):
    doc = minimal_job(backend="azureml", runPolicy={"suspend": suspend},
                      dataset={"uri": "azureml://datastores/blob/paths/data/train.jsonl"},
                      output={"uri": "azureml://datastores/blob/paths/out/demo"},
                      azureml={"subscriptionId": SUBSCRIPTION, "resourceGroup": RESOURCE_GROUP,
                               "workspace": WORKSPACE, "compute": "gpu"})
    doc["metadata"]["uid"] = UID
    job = parse_job(doc)
    if phase or ref:
        job.status = FineTuneJobStatus(phase=phase, backend_ref=BackendRef(
            kind="AzureMLJob", name=ref) if ref else None)
    return job


@pytest.fixture()
def azure() -> FakeAzureML:
    return FakeAzureML()


@pytest.fixture()
def credential() -> StaticCredential:
    return StaticCredential()


@pytest.fixture()
def backend(azure, credential) -> AzureMLBackend:
    context = BackendContext(settings=OperatorSettings(), azure_credential=credential,
                             azure_transport=azure)
    made = AzureMLBackend(context, retry=FAST)
    made.gate.clock = Clock()
    return made


def run(coroutine):
    return asyncio.run(coroutine)


def test_launch_puts_the_job_once_and_observe_reads_it(backend, azure, credential):
    assert run(backend.observe(aml_job())).exists is False  # 404: nothing submitted yet
    run(backend.launch(aml_job()))
    run(backend.launch(aml_job()))  # a re-reconcile: get before create finds it
    assert list(azure.jobs) == [NAME] and len(azure.requests_to("PUT", "/jobs/")) == 1
    assert len(azure.requests_to("PUT", "/environments/")) == 1
    body = azure.jobs[NAME]["properties"]
    assert body["computeId"].endswith("/computes/gpu")
    assert body["inputs"]["dataset"] == {"jobInputType": "uri_file", "mode": "ReadOnlyMount",
                                         "uri": "azureml://datastores/blob/paths/data/train.jsonl"}
    assert body["outputs"]["output"]["mode"] == "ReadWriteMount"
    assert all(c.authorization == "Bearer fake-token" for c in azure.calls)
    assert (ARM_SCOPE,) in credential.scopes
    seen = run(backend.observe(aml_job()))
    assert seen.exists and seen.waiting == f"Azure ML job {NAME} is NotStarted"
    assert seen.backend_ref.url.startswith(f"https://ml.azure.com/runs/{NAME}")


@pytest.mark.parametrize(("state", "field"), [
    ("Preparing", "waiting"), ("Queued", "queued"), ("Running", "running"),
    ("Finalizing", "running"), ("NotResponding", "degraded"), ("CancelRequested", "deleting"),
    ("Completed", "succeeded"), ("Failed", "failure"), ("Canceled", "failure")])
def test_every_state_read_through_the_sdk(backend, azure, state, field):
    run(backend.launch(aml_job()))
    azure.set_state(NAME, state)
    assert getattr(run(backend.observe(aml_job())), field)


def test_running_jobs_mirror_their_mlflow_metrics(backend, azure):
    run(backend.launch(aml_job()))
    azure.set_state(NAME, "Running")
    azure.log_metrics(NAME, 40, loss=1.25, total_steps=100)
    progress = run(backend.observe(aml_job())).progress
    assert (progress.step, progress.total_steps, progress.loss) == (40, 100, 1.25)
    metrics_call = azure.requests_to("GET", "/api/2.0/mlflow/runs/get")[-1]
    assert metrics_call.query == {"run_id": [NAME]}
    assert metrics_call.path.startswith("/mlflow/v1.0/subscriptions/")
    azure.fail("GET", "/mlflow/", 500, times=10)  # tracking down: still running, no progress
    seen = run(backend.observe(aml_job()))
    assert seen.running and seen.progress is None
    assert seen.progress_unreadable == (f"the progress of Azure ML job {NAME} cannot be read "
                                        "from its MLflow run (the tracking service answered "
                                        "HTTP 500)")


def test_cancel_posts_cancel_and_tolerates_gone_or_ended_jobs(backend, azure):
    run(backend.cancel(aml_job()))  # nothing submitted: nothing to cancel
    assert not azure.requests_to("POST", "/cancel")
    run(backend.launch(aml_job()))
    azure.set_state(NAME, "Running")
    run(backend.cancel(aml_job()))
    assert [c.path.endswith(f"/jobs/{NAME}/cancel") for c in
            azure.requests_to("POST", "/cancel")] == [True]
    assert azure.state(NAME) == "CancelRequested"
    azure.set_state(NAME, "Canceled")
    run(backend.cancel(aml_job()))  # ended: no second POST
    assert len(azure.requests_to("POST", "/cancel")) == 1
    azure.set_state(NAME, "Running")
    azure.fail("POST", "/cancel", 404, "ResourceNotFound")  # gone between get and cancel
    run(backend.cancel(aml_job()))


def test_suspend_cancels_and_resume_submits_the_next_attempt(backend, azure):
    run(backend.launch(aml_job()))
    azure.set_state(NAME, "Running")
    run(backend.suspend(aml_job("Running", NAME, suspend=True)))
    azure.set_state(NAME, "Canceled")
    assert run(backend.observe(aml_job("Suspended", NAME))).suspended
    run(backend.resume(aml_job("Suspended", NAME)))
    run(backend.resume(aml_job("Suspended", NAME)))  # again: finds the second attempt
    assert sorted(azure.jobs) == [NAME, f"{NAME}-2"]
    # the status still names attempt 1: observe follows to the newest one
    seen = run(backend.observe(aml_job("Launching", NAME)))
    assert seen.backend_ref.name == f"{NAME}-2" and seen.waiting


def test_a_restart_after_a_failure_submits_the_next_attempt(backend, azure):
    run(backend.launch(aml_job()))
    azure.set_state(NAME, "Failed")
    assert run(backend.observe(aml_job("Running", NAME))).failure is not None
    run(backend.restart(aml_job("Running", NAME)))
    assert not azure.requests_to("POST", "/cancel")  # an ended job needs no cancel
    gone = run(backend.observe(aml_job("Restarting", NAME)))
    assert not gone.exists
    run(backend.launch(aml_job("Restarting", NAME)))
    assert f"{NAME}-2" in azure.jobs


def test_a_run_that_stopped_early_says_why_from_its_run(backend, azure, tmp_path):
    """Rank 0's tracker tags the job's run with why it stopped before its last step; the
    operator reads it with the metrics into the progress the status's message quotes."""
    from finetune_trainer.progress import Reporter
    from finetune_trainer.tracking import MlflowTracker
    from tests.trainer.test_tracking import FakeMlflow

    mlflow = FakeMlflow()  # what the trainer sends, as mlflow's fluent API receives it
    reporter = Reporter(tmp_path, total_steps=20, start_step=0, enabled=True,
                        trackers=(MlflowTracker(mlflow),))
    reporter.report(6, 0.3, 1.9, 1e-4)
    reporter.evaluated(6, 2.25)  # the last evaluation; the best, exported, was 2.1
    why = "stopped early at step 6 of 20: 2 evaluations in a row did not improve ..."
    reporter.finish("Succeeded", why, eval_loss=2.1)
    run(backend.launch(aml_job()))
    azure.set_state(NAME, "Completed")
    for step, values in mlflow.logged:
        azure.log_metrics(NAME, step, **values)
    azure.set_tags(NAME, **mlflow.tags)
    seen = run(backend.observe(aml_job("Running", NAME)))
    assert seen.succeeded and seen.progress.step == 6 and seen.progress.stopped_early == why
    assert seen.progress.eval_loss == 2.1  # the export's, as on Kubernetes


def test_a_failed_attempt_is_read_with_what_its_workers_said_on_its_run(backend, azure):
    """A worker's refusal reaches the operator as a tag on the job's MLflow run, read with
    the metrics (`runs/get` → data.tags)."""
    run(backend.launch(aml_job()))
    azure.set_state(NAME, "Failed")
    azure.set_tags(NAME, **{"finetune.refused": "2 /mnt/data/chats.jsonl:2: is not valid "
                            "JSON — fix or remove that line"})
    failure = run(backend.observe(aml_job("Running", NAME))).failure
    assert (failure.kind, failure.reason) == ("refused", "InputRefused")
    assert "/mnt/data/chats.jsonl:2: is not valid JSON" in failure.message
    azure.fail("GET", "/mlflow/", 500, times=10)  # tracking down: a plain failed attempt
    failure = run(backend.observe(aml_job("Running", NAME))).failure
    assert failure.kind == "worker" and "its logs are in Azure ML Studio" in failure.message


@pytest.mark.parametrize("answer", ["409", "400 already exists"])
def test_a_job_created_meanwhile_is_adopted(backend, azure, answer):
    """The service answers a taken name with a 400 UserError (MicrosoftDocs/azure-docs
    #122250), not only a 409: either way the job there is ours, by its name."""
    other = AzureMLBackend(BackendContext(settings=OperatorSettings(),
                                          azure_credential=StaticCredential(),
                                          azure_transport=azure), retry=FAST)
    run(other.launch(aml_job()))  # another operator replica got there first
    azure.fail("GET", f"/jobs/{NAME}", 404, "ResourceNotFound")  # our look missed it
    if answer != "409":
        azure.fail("PUT", "/jobs/", 400, "UserError", "A job with this name already exists. "
                   "Please use a different name.")
    run(backend.launch(aml_job()))
    puts = azure.requests_to("PUT", "/jobs/")
    assert len(puts) == 2 and list(azure.jobs) == [NAME]  # the second PUT refused, adopted
    assert run(backend.observe(aml_job())).failure is None


def test_a_refused_identity_is_reported_with_the_fix(backend, azure):
    azure.fail("GET", "/jobs/", 401, "InvalidAuthenticationToken", "The token is invalid.",
               times=100)
    seen = run(backend.observe(aml_job()))
    assert not seen.exists and "The token is invalid." in seen.unreachable
    assert "azureWorkloadIdentity.clientId" in seen.unreachable
    with pytest.raises(BackendError, match="AzureML Data Scientist") as error:
        run(backend.launch(aml_job()))
    assert error.value.retry_after == 300


def test_a_missing_role_is_reported_with_the_fix(backend, azure):
    azure.fail("PUT", "/jobs/", 403, "AuthorizationFailed",
               "The client does not have authorization to perform action", times=100)
    with pytest.raises(BackendError, match="may not use workspace rg-ml/ws-finetune") as error:
        run(backend.launch(aml_job()))
    assert "does not have authorization to perform action" in str(error.value)
    assert "grant it the AzureML Data Scientist role" in str(error.value)


def test_a_short_retry_after_is_waited_out_and_retried(backend, azure):
    run(backend.launch(aml_job()))
    azure.fail("GET", f"/jobs/{NAME}", 429, "TooManyRequests", headers={"Retry-After": "1"})
    before = len(azure.requests_to("GET", f"/jobs/{NAME}"))
    assert run(backend.observe(aml_job())).exists
    assert len(azure.requests_to("GET", f"/jobs/{NAME}")) == before + 2  # 429, then 200


def test_a_long_retry_after_closes_the_workspace_until_then(backend, azure):
    run(backend.launch(aml_job()))
    azure.fail("GET", f"/jobs/{NAME}", 429, "TooManyRequests", headers={"Retry-After": "120"})
    seen = run(backend.observe(aml_job()))
    assert "throttling" in seen.unreachable and "120s" in seen.unreachable
    calls = len(azure.calls)
    assert run(backend.observe(aml_job())).unreachable  # still closed: no request at all
    with pytest.raises(BackendError) as error:
        run(backend.launch(aml_job()))
    assert 0 < error.value.retry_after <= 120
    assert len(azure.calls) == calls
    backend.gate.clock.now += 121
    assert run(backend.observe(aml_job())).exists


def test_transient_errors_are_retried_with_backoff(backend, azure):
    azure.fail("PUT", "/jobs/", 503, "ServiceUnavailable", times=2)
    run(backend.launch(aml_job()))
    assert len(azure.requests_to("PUT", "/jobs/")) == 3 and NAME in azure.jobs
    azure.fail("GET", "/jobs/", 500, "InternalServerError", times=100)
    seen = run(backend.observe(aml_job()))
    assert "is not answering" in seen.unreachable


def test_a_workspace_that_does_not_answer_is_left_alone_for_a_while(backend, azure):
    """Each look at each of its jobs held a worker thread and a reconciler for the SDK's
    whole timeout: after one unanswered call, the others wait without asking."""
    run(backend.launch(aml_job()))
    azure.fail("GET", "/jobs/", 503, "ServiceUnavailable", times=100)
    seen = run(backend.observe(aml_job()))
    assert "is not answering" in seen.unreachable
    calls = len(azure.calls)
    again = run(backend.observe(aml_job()))
    assert again.unreachable == seen.unreachable and len(azure.calls) == calls
    backend.gate.clock.now += 31
    run(backend.observe(aml_job()))
    assert len(azure.calls) > calls  # asked again once the spell is over


def test_a_job_azure_ml_refuses_becomes_a_failed_attempt(backend, azure):
    azure.fail("PUT", "/jobs/", 400, "UserError",
               "Compute gpu not found in workspace ws-finetune")
    run(backend.launch(aml_job()))  # no exception: the refusal is the attempt's outcome
    seen = run(backend.observe(aml_job("Launching")))
    assert seen.failure.kind == "worker"
    assert "Azure ML refused the job" in seen.failure.message
    assert "Compute gpu not found" in seen.failure.message
    run(backend.restart(aml_job("Launching")))
    assert run(backend.observe(aml_job("Restarting"))).exists is False


def test_a_refused_later_attempt_is_what_the_status_says(backend, azure):
    """After a worker failed, the next attempt is refused (the compute was deleted): the
    refusal is reported, not the first attempt's failure again."""
    run(backend.launch(aml_job()))
    azure.set_tags(NAME, **{"finetune.failure": "rank 3: CUDA out of memory"})
    azure.set_state(NAME, "Failed")
    assert "CUDA out of memory" in run(backend.observe(aml_job("Running", NAME))).failure.message
    run(backend.restart(aml_job("Running", NAME)))
    azure.fail("PUT", "/jobs/", 400, "UserError", "Compute gpu-cluster not found", times=100)
    run(backend.launch(aml_job("Restarting", NAME)))
    seen = run(backend.observe(aml_job("Launching", NAME)))
    assert seen.failure.kind == "worker"
    assert seen.failure.message == (
        "Azure ML refused the job: (UserError) Compute gpu-cluster not found")


def test_a_job_the_sdk_refuses_as_it_submits_is_refused_in_one_clean_line(backend, azure):
    """The SDK validates some references only as it submits, and re-raises that as a plain
    MlException whose message is coloured and spread over a list: it was read as an outage
    with an empty message, and retried every 30 s for ever."""
    job = aml_job()
    job.spec.azureml.environment = "my-env"  # no version: `finetune validate` says so too
    run(backend.launch(job))  # no exception: the refusal is the attempt's outcome
    seen = run(backend.observe(job))
    assert seen.failure.message == (
        "Azure ML refused the job: At least one required parameter is missing: Failed to "
        "extract version when parsing asset azureml:my-env of type environments as arm id. "
        "Version must be provided.")
    assert azure.requests_to("PUT", "/jobs/") == []


def test_deleting_a_never_submitted_job_needs_no_azure_but_a_submitted_one_does(backend, azure):
    azure.fail("GET", "/jobs/", 401, "InvalidAuthenticationToken", times=100)
    run(backend.cancel(aml_job()))  # nothing was launched: the finalizer can go
    launched = aml_job("Running", NAME)
    with pytest.raises(BackendError, match="azureWorkloadIdentity"):
        run(backend.cancel(launched))  # it may run in Azure: keep trying
