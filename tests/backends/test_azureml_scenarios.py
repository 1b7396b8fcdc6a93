"""`backend: azureml` end to end: the real kopf operator against KMock's Kubernetes emulator,
its azureml backend driving the real azure-ai-ml client, whose HTTP goes to a fake Azure ML
(tests/support/azureml_fake.py) that the test moves through Azure ML's job states."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time

import aiohttp
import pytest
import pytest_asyncio

from finetune_operator import planner
from finetune_operator.backends import BackendContext, load_backends
from finetune_operator.backends.azureml.jobspec import CONFIG_INPUT, require_sdk
from finetune_operator.controller import reconcilers
from finetune_operator.controller.pacing import LaunchPacer
from finetune_operator.kube import Kube
from finetune_operator.settings import OperatorSettings
from tests.conftest import minimal_job
from tests.support import waits
from tests.support.azureml_fake import (
    RESOURCE_GROUP,
    SUBSCRIPTION,
    WORKSPACE,
    FakeAzureML,
    StaticCredential,
)
from tests.support.emulator import ApiServer
from tests.support.operator_fixtures import Operator
from tests.support.testbed import condition_in, eventually

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.asyncio, pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:azure"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:marshmallow")]
JOBS = "/apis/finetune.dev/v1alpha1/namespaces/default/finetunejobs"
FTJ = "finetune.dev/v1alpha1/finetunejobs"


def azureml_job(name: str = "aml") -> dict:
    doc = minimal_job(
        backend="azureml",
        model={"uri": "azureml://registries/azureml/models/mistralai-Mistral-7B-v01/versions/19"},
        dataset={"uri": "azureml://datastores/workspaceblobstore/paths/data/train.jsonl"},
        output={"uri": f"azureml://datastores/workspaceblobstore/paths/out/{name}"},
        resources={"nodes": 2, "gpusPerNode": 8},
        azureml={"subscriptionId": SUBSCRIPTION, "resourceGroup": RESOURCE_GROUP,
                 "workspace": WORKSPACE, "compute": "gpu-cluster", "jobTier": "Spot"})
    doc["metadata"] = {"name": name, "namespace": "default"}
    return doc


@pytest.fixture()
def azure() -> FakeAzureML:
    return FakeAzureML()


@pytest_asyncio.fixture()
async def aml_operator(cluster: ApiServer, rank0, azure: FakeAzureML, request):
    """The operator, its azureml backend talking to the fake through the transport hook
    (launches paced by (rate, burst), on `running.clock`, when the test parametrizes it
    indirectly). azure-ai-ml
    is imported first: its first import (2-3 s of CPU, over 30 s on two busy cores) is the
    setup's cost, not a reconcile's inside the test's waits."""
    require_sdk()
    running = Operator(cluster, rank0)
    kube = Kube(running.kubeconfig)
    context = BackendContext(settings=OperatorSettings(), kube=kube,
                             azure_credential=StaticCredential(), azure_transport=azure)
    running.runtime = reconcilers.Runtime(backends=load_backends(context), kube=kube,
                                         interval=0.3)
    if (paced := getattr(request, "param", None)) is not None:
        running.clock = StoppableClock()
        running.runtime.launches = LaunchPacer(*paced, clock=running.clock)
    await running.start()
    yield running
    await running.stop()


class StoppableClock:
    """time.monotonic() for a LaunchPacer, which the test may stop and start again: while it
    stands, no turn comes due however long this machine takes to look. Started again, it
    runs on from its last reading as if it had stood only until then: the look that read it
    last timed the job's wake by that reading, so the turn it promised comes due when that
    wake does (run on from the start instead, the clock lagged the wake by however long the
    test took to see the status, and the wake found the turn not come yet)."""

    def __init__(self) -> None:
        self.behind, self.stopped_at, self.read_at = 0.0, None, 0.0

    def __call__(self) -> float:
        now = time.monotonic()
        if self.stopped_at is None:
            return now - self.behind
        self.read_at = now
        return self.stopped_at

    def stop(self) -> None:
        self.stopped_at = self()

    def start(self) -> None:
        assert self.stopped_at is not None
        self.behind, self.stopped_at = self.read_at - self.stopped_at, None


async def apply(cluster: ApiServer, doc: dict) -> None:
    async with aiohttp.ClientSession(base_url=str(cluster.url)) as session:
        async with session.post(JOBS, json=doc) as response:
            assert response.status == 200, await response.text()


async def patch_spec(cluster: ApiServer, name: str, spec: dict) -> None:
    async with aiohttp.ClientSession(base_url=str(cluster.url)) as session:
        async with session.patch(f"{JOBS}/{name}", json={"spec": spec},
                                 headers={"Content-Type": "application/merge-patch+json"}) as r:
            assert r.status == 200, await r.text()


async def delete(cluster: ApiServer, name: str) -> None:
    async with aiohttp.ClientSession(base_url=str(cluster.url)) as session:
        async with session.delete(f"{JOBS}/{name}") as response:
            assert response.status == 200, await response.text()


def status(cluster: ApiServer, name: str = "aml") -> dict:
    return (cluster.get(FTJ, "default", name) or {}).get("status", {})


def condition(cluster: ApiServer, type_: str, name: str = "aml") -> dict:
    return condition_in(status(cluster, name), type_, name)


def phase_is(cluster: ApiServer, phase: str, name: str = "aml"):
    return lambda: status(cluster, name).get("phase") == phase


async def submitted(cluster: ApiServer, azure: FakeAzureML, name: str = "aml") -> str:
    """The Azure ML job name the operator submitted for FineTuneJob `name` (first attempt)."""
    await eventually(lambda: azure.jobs, what="a job PUT to Azure ML")
    uid = cluster.get(FTJ, "default", name)["metadata"]["uid"].replace("-", "")
    return f"{name}-{uid[:12]}"


async def test_launching_queued_running_succeeded(cluster, aml_operator, azure):
    await apply(cluster, azureml_job())
    await eventually(phase_is(cluster, "Launching"), what="Launching")
    name = await submitted(cluster, azure)
    assert list(azure.jobs) == [name]
    sent = azure.jobs[name]["properties"]
    assert sent["jobType"] == "Command" and sent["distribution"] == {
        "distributionType": "PyTorch", "processCountPerInstance": 8}
    assert sent["resources"]["instanceCount"] == 2
    assert sent["queueSettings"]["jobTier"] == "Spot"
    assert sent["inputs"]["model"]["uri"].startswith("azureml://registries/azureml/models/")
    assert sent["outputs"]["output"]["uri"] == (
        "azureml://datastores/workspaceblobstore/paths/out/aml")
    assert all(c.authorization == "Bearer fake-token" for c in azure.calls)
    await eventually(lambda: status(cluster).get("backendRef", {}).get("name") == name,
                     what="backendRef")
    ref = status(cluster)["backendRef"]
    assert ref["kind"] == "AzureMLJob" and ref["url"].startswith(f"https://ml.azure.com/runs/{name}")

    azure.set_state(name, "Queued")
    await eventually(phase_is(cluster, "Queued"), what="Queued")
    assert condition(cluster, "Admitted")["status"] == "False"
    assert "waiting for capacity" in condition(cluster, "Admitted")["message"]

    azure.set_state(name, "Running")
    azure.log_metrics(name, 40, loss=1.25, total_steps=100, tokens_per_second=52000.0,
                      epoch=0.4, eta_seconds=600)
    await eventually(phase_is(cluster, "Running"), what="Running")
    await eventually(lambda: status(cluster).get("progress", {}).get("step") == 40,
                     what="progress from the job's MLflow metrics")
    progress = status(cluster)["progress"]
    assert progress["totalSteps"] == 100 and progress["loss"] == 1.25
    assert progress["tokensPerSecond"] == 52000.0 and progress["etaSeconds"] == 600

    azure.set_state(name, "NotResponding")
    await eventually(lambda: condition(cluster, "Degraded")["status"] == "True",
                     what="Degraded")
    assert "NotResponding" in condition(cluster, "Degraded")["message"]
    assert status(cluster)["phase"] == "Running"  # not an end: it may recover
    azure.set_state(name, "Running")
    await eventually(lambda: condition(cluster, "Degraded")["status"] == "False",
                     what="recovered")

    azure.set_state(name, "Completed")
    await eventually(phase_is(cluster, "Succeeded"), what="Succeeded")
    assert azure.requests_to("PUT", "/jobs/") and len(azure.jobs) == 1  # submitted once
    assert not azure.requests_to("POST", "/cancel")


@pytest.mark.parametrize("workspace", ["takes it", "refuses it"])
async def test_a_succeeded_job_registers_its_model_in_the_workspace_once(
        cluster, aml_operator, azure, workspace):
    """`output.export: [azureml://models/NAME]`: once the Azure ML job has completed, the
    operator registers the output's final/ (on its datastore: nothing uploaded) as the next
    version of NAME, said by `Exported` and an event; refused (no role on the workspace),
    the job stays Succeeded and the status says how to register it by hand."""
    doc = azureml_job()
    doc["spec"]["output"]["export"] = [{"uri": "azureml://models/support-bot"}]
    await apply(cluster, doc)
    name = await submitted(cluster, azure)
    if workspace == "refuses it":
        azure.fail("PUT", "/models/support-bot/versions/", 403, "AuthorizationFailed",
                   "no write permission on models")
    azure.set_state(name, "Completed")
    await eventually(lambda: condition(cluster, "Exported").get("status") in ("True", "False"),
                     what="Exported")
    exported = condition(cluster, "Exported")
    assert status(cluster)["phase"] == "Succeeded"
    final = "azureml://datastores/workspaceblobstore/paths/out/aml/final"
    if workspace == "refuses it":
        assert exported["status"] == "False" and exported["reason"] == "ExportFailed"
        assert "AuthorizationFailed" in exported["message"] or "403" in exported["message"]
        assert (f"az ml model create --name support-bot --path {final}"
                in exported["message"])
        assert not azure.models.get("support-bot")
        return
    assert exported["status"] == "True" and exported["reason"] == "Pushed"
    assert exported["message"] == "pushed azureml://models/support-bot/versions/1"
    (version,) = azure.models["support-bot"].values()
    sent = version["properties"]
    assert sent["modelType"] == "custom_model" and sent["modelUri"].endswith(
        "/datastores/workspaceblobstore/paths/out/aml/final")
    assert sent["tags"]["finetune.dev/job"] == "default/aml"
    await asyncio.sleep(2)  # more reconciles of the succeeded job register nothing again
    assert len(azure.requests_to("PUT", "/models/support-bot/versions/")) == 1


async def test_deleting_a_running_job_cancels_it_then_releases_the_finalizer(
        cluster, aml_operator, azure):
    await apply(cluster, azureml_job())
    name = await submitted(cluster, azure)
    azure.set_state(name, "Running")
    await eventually(phase_is(cluster, "Running"), what="Running")
    assert "finetune.dev/finalizer" in cluster.get(FTJ, "default", "aml")["metadata"][
        "finalizers"]

    await delete(cluster, "aml")
    await eventually(lambda: cluster.get(FTJ, "default", "aml") is None,
                     what="FineTuneJob gone")
    cancels = azure.requests_to("POST", "/cancel")
    assert [c.path.rsplit("/", 2)[-2] for c in cancels] == [name]
    assert azure.state(name) == "CancelRequested"


async def suspended_while_running(cluster: ApiServer, azure: FakeAzureML) -> str:
    """The job's first attempt running, then suspended: Azure ML is asked to cancel it
    (CancelRequested) and the phase is Suspended. The attempt's name."""
    await apply(cluster, azureml_job())
    first = await submitted(cluster, azure)
    azure.set_state(first, "Running")
    await eventually(phase_is(cluster, "Running"), what="Running")
    await patch_spec(cluster, "aml", {"runPolicy": {"suspend": True}})
    await eventually(lambda: azure.state(first) == "CancelRequested", what="cancel requested")
    await eventually(phase_is(cluster, "Suspended"), what="Suspended")
    return first


async def test_suspend_cancels_and_resume_submits_the_next_attempt(cluster, aml_operator, azure):
    first = await suspended_while_running(cluster, azure)
    azure.set_state(first, "Canceled")

    await patch_spec(cluster, "aml", {"runPolicy": {"suspend": False}})
    second = f"{first}-2"
    await eventually(lambda: second in azure.jobs, what="the next attempt submitted")
    # same output folder: the trainer resumes from the newest checkpoint it holds
    assert azure.jobs[second]["properties"]["outputs"] == azure.jobs[first]["properties"][
        "outputs"]
    azure.set_state(second, "Running")
    await eventually(lambda: status(cluster).get("backendRef", {}).get("name") == second,
                     what="backendRef on the new attempt")
    await eventually(phase_is(cluster, "Running"), what="Running again")
    assert sorted(azure.jobs) == [first, second]


async def test_a_resume_while_azure_ml_still_cancels_waits_for_it(cluster, aml_operator, azure):
    """suspend, then resume before Azure ML has cancelled (its workers write their
    checkpoint): the next attempt waits for the old one to end. Before, the resume found it
    alive and submitted nothing, then read its Canceled as a failure: a restart used up, and
    the message blamed Studio."""
    first = await suspended_while_running(cluster, azure)
    await patch_spec(cluster, "aml", {"runPolicy": {"suspend": False}})
    await eventually(lambda: "suspended workers have stopped" in status(cluster).get(
        "message", ""), what="waiting for the cancel")
    assert list(azure.jobs) == [first]
    azure.set_state(first, "Canceled")
    second = f"{first}-2"
    await eventually(lambda: second in azure.jobs, what="the next attempt submitted")
    azure.set_state(second, "Running")
    await eventually(phase_is(cluster, "Running"), what="Running again")
    assert status(cluster).get("restarts", 0) == 0


async def test_a_refused_identity_is_a_condition_not_a_crash(cluster, aml_operator, azure):
    azure.fail("GET", "/jobs/", 401, "InvalidAuthenticationToken",
               "The access token is invalid.", times=10_000)
    await apply(cluster, azureml_job())
    await eventually(lambda: condition(cluster, "Degraded")["status"] == "True",
                     what="Degraded")
    degraded = condition(cluster, "Degraded")
    assert degraded["reason"] == "BackendUnreachable"
    assert "azureWorkloadIdentity.clientId" in degraded["message"]
    assert "AzureML Data Scientist" in degraded["message"]
    assert status(cluster)["phase"] == "Pending" and not azure.jobs
    # asked again after six intervals (1.8 s here, a minute by default), not at every one:
    # each look without an identity cost a token request and the SDK's 15-line warning
    asked = len(azure.requests_to("GET", "/jobs/"))
    await asyncio.sleep(1.2)
    assert len(azure.requests_to("GET", "/jobs/")) - asked <= 1

    azure.failures.clear()  # the identity is fixed
    await submitted(cluster, azure)
    await eventually(lambda: condition(cluster, "Degraded")["status"] == "False",
                     what="Degraded cleared")


def sent_strategy(azure: FakeAzureML, name: str) -> str:
    """The strategy in the trainer config an attempt was submitted with."""
    literal = azure.jobs[name]["properties"]["inputs"][CONFIG_INPUT]["value"]
    return json.loads(base64.b64decode(literal))["strategy"]["type"]


async def test_a_restart_renders_the_strategy_recorded_at_launch(
        cluster, aml_operator, azure, monkeypatch):
    """#16: `strategy: auto` is decided once and recorded in status.plan; a gang restart after
    the planner's answer changed (an operator upgrade) still runs what the job launched with,
    whose checkpoints it can read."""
    await apply(cluster, azureml_job())
    first = await submitted(cluster, azure)
    await eventually(lambda: status(cluster).get("plan"), what="status.plan")
    launched = status(cluster)["plan"]["strategy"]
    assert sent_strategy(azure, first) == launched
    other = "zero3" if launched != "zero3" else "fsdp"
    monkeypatch.setattr(planner, "resolve_strategy", lambda job, model=None, machine=None: other)

    azure.set_state(first, "Running")
    await eventually(phase_is(cluster, "Running"), what="Running")
    azure.set_state(first, "Failed")
    second = f"{first}-2"
    await eventually(lambda: second in azure.jobs, what="the restart submitted")
    assert sent_strategy(azure, second) == launched
    assert status(cluster)["plan"]["strategy"] == launched
    # the planner's new answer is what a new job gets: the record, not chance, kept it
    await apply(cluster, azureml_job("fresh"))
    await eventually(lambda: status(cluster, "fresh").get("plan"), what="the new job's plan")
    assert status(cluster, "fresh")["plan"]["strategy"] == other


@pytest.mark.parametrize("aml_operator", [(0.5, 1)], indirect=True, ids=["paced"])
async def test_a_job_waiting_for_its_turn_is_not_polled_meanwhile(cluster, aml_operator, azure):
    """Azure ML jobs are polled every --interval (0.3 s here) once submitted; one waiting for
    its turn to launch has nothing to poll: it says when its turn comes, once (a time of day:
    a countdown was written again by any look before the turn), nothing asks Azure ML for it
    before then, and it is submitted at its turn. The second is applied once the first has
    taken the one turn at hand (two applied together race for it: the reconcilers look at
    both at once). The pacer's clock stands until the second has been told its turn: on a
    busy machine the 2 s to the next turn passed before the second was looked at, and it
    launched at once."""
    aml_operator.clock.stop()
    await apply(cluster, azureml_job("first"))
    await eventually(lambda: len(azure.jobs) == 1, what="the first submitted")
    await apply(cluster, azureml_job("second"))
    await eventually(lambda: "its turn" in status(cluster, "second").get("message", ""),
                     what="the second told when its turn comes")
    told = status(cluster, "second")["message"]
    assert re.fullmatch(r"waiting for its turn to launch at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ "
                        r"\(the operator paces launches: --launch-rate, the chart's "
                        r"launchRate\)", told), told
    since = len(azure.calls)
    aml_operator.clock.start()
    turn = time.monotonic() + aml_operator.runtime.launches.promised(("default", "second"))
    messages, deadline = set(), time.monotonic() + waits.seconds_left()
    while len(azure.jobs) < 2:
        assert time.monotonic() < deadline, f"submitted: {list(azure.jobs)}"
        if status(cluster, "second").get("phase") == "Pending":
            messages.add(status(cluster, "second")["message"])
        await asyncio.sleep(0.05)
    assert messages <= {told}, messages  # not counted down in the status at each look
    assert [name.split("-")[0] for name in azure.jobs] == ["first", "second"]
    # not looked at before its turn: a polled look asks Azure ML for the job at each interval
    second = next(name for name in azure.jobs if name.startswith("second-"))
    early = [turn - c.at for c in azure.calls[since:] if second in c.path and c.at < turn]
    assert not early, f"Azure ML asked for the second this many seconds before its turn: {early}"
    await eventually(phase_is(cluster, "Launching", "second"), what="second Launching")
