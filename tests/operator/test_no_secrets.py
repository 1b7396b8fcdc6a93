"""No credential leaves the place it belongs, with the real operator at work.

A FineTuneJob that reads a gated hub model with a token Secret, and one that runs on Azure
ML with the operator's workload-identity token, go through launch, a failure, progress and
the end. Then every place the operator writes is searched for the credential: its log (at
DEBUG, every logger: kopf, aiohttp, azure-core's HTTP logging), the Kubernetes events, the
FineTuneJob status, every object it created, what it sent to Azure ML, and its /metrics.
The token belongs only in the Secret (workers get a secretKeyRef) and in the Authorization
header of the Azure calls.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.request

import aiohttp
import kmock
import pytest
import pytest_asyncio
from azure.core.credentials import AccessToken

from finetune_operator.backends import BackendContext, load_backends
from finetune_operator.controller import reconcilers
from finetune_operator.kube import Kube
from finetune_operator.settings import OperatorSettings
from tests.backends.test_azureml_scenarios import FTJ, azureml_job, phase_is, submitted
from tests.support import waits
from tests.support.azureml_fake import FakeAzureML, StaticCredential
from tests.support.emulator import VERBS, ApiServer
from tests.support.operator_fixtures import Operator
from tests.support.testbed import EmulatedTestbed, eventually

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.asyncio, pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:azure"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:marshmallow")]

HF_TOKEN = "hf_LeakCanaryQ7x9RmZt2WvKp4NsYb8Jd3Hc6Gf"  # distinctive, found nowhere else
AZURE_TOKEN = "eyJ0eXAiOiJKV1QiLeakCanary.aXNzIjoiaHR0cHM6Ly9zdHMud2luZG93cy5uZXQv.c2ln"


def forms(secret: str) -> list[str]:
    """The secret as it could show up: itself and base64 (a Secret's `data`)."""
    return [secret, base64.b64encode(secret.encode()).decode()]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                timeout=waits.seconds_left()) as response:
        return response.read().decode()


def assert_nowhere(secret: str, places: dict[str, str]) -> None:
    assert all(len(text) > 0 for text in places.values()), places.keys()  # really searched
    for form in forms(secret):
        leaked = [where for where, text in places.items() if form in text]
        assert not leaked, f"the credential shows in: {', '.join(leaked)}"


async def test_the_hub_token_stays_in_its_secret(emulated_testbed: EmulatedTestbed, caplog):
    caplog.set_level(logging.DEBUG)
    testbed, server = emulated_testbed, emulated_testbed.server
    port = testbed.operator.runtime.metrics.serve(0, host="127.0.0.1")
    async with aiohttp.ClientSession(base_url=str(server.url)) as session:
        server.resources["v1/secrets"] = kmock.ResourceInfo(
            kind="Secret", singular="secret", namespaced=True, verbs=VERBS, subresources=set())
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": {"name": "hf-token", "namespace": testbed.namespace},
                  "data": {"token": base64.b64encode(HF_TOKEN.encode()).decode()}}
        async with session.post(f"/api/v1/namespaces/{testbed.namespace}/secrets",
                                json=secret) as response:
            assert response.status == 200, await response.text()

    await testbed.apply(testbed.manifest(model={
        "uri": "hf://meta-llama/Llama-3.1-8B", "revision": "main",
        "tokenSecretRef": {"name": "hf-token", "key": "token"}}))
    await testbed.until_phase("Running")
    await testbed.report_progress("demo")
    await testbed.until(lambda: testbed.status().get("progress"), "progress in status")
    await testbed.fail_worker("demo", 1, "OSError: 401 Client Error: Unauthorized for url: "
                              "https://huggingface.co/meta-llama/Llama-3.1-8B/resolve/main/"
                              "config.json")
    await testbed.until(lambda: testbed.status().get("restarts") == 1, "a gang restart")
    await testbed.until_phase("Running")
    await testbed.finish("demo")
    await testbed.until_phase("Succeeded")

    # the workers get the token from the Secret, by reference
    container = testbed.get("batch/v1/jobs", "demo")["spec"]["template"]["spec"][
        "containers"][0]
    hf = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
    assert hf == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token",
                                                                      "key": "token"}}}]
    assert testbed.get("v1/secrets", "hf-token")["data"]["token"]  # the token was there
    created = {f"{kind} {obj['metadata']['name']}": json.dumps(obj)
               for kind in ("batch/v1/jobs", "v1/pods", "v1/services", "v1/configmaps")
               for obj in server.live(kind)}
    assert len(created) >= 4  # the Job, its two pods, the Service, the trainer ConfigMap
    assert_nowhere(HF_TOKEN, {
        "the operator's log": caplog.text,
        "events": json.dumps(server.live("v1/events")),
        "the FineTuneJob": json.dumps(testbed.ftj()),
        "/metrics": scrape(port),
        **created,
    })


class CanaryCredential(StaticCredential):
    """The operator's Azure identity, with a token that is easy to look for."""

    def get_token(self, *scopes: str, **_: object) -> AccessToken:
        self.scopes.append(scopes)
        return AccessToken(AZURE_TOKEN, int(time.time()) + 3600)


@pytest_asyncio.fixture()
async def aml_operator(cluster: ApiServer, rank0, azure: FakeAzureML):
    running = Operator(cluster, rank0)
    kube = Kube(running.kubeconfig)
    context = BackendContext(settings=OperatorSettings(), kube=kube,
                             azure_credential=CanaryCredential(), azure_transport=azure)
    backends = load_backends(context)
    running.runtime = reconcilers.Runtime(backends=backends, kube=kube, interval=0.3)
    await running.start()
    yield running
    await running.stop()


@pytest.fixture()
def azure() -> FakeAzureML:
    return FakeAzureML()


async def test_the_azure_token_stays_in_the_authorization_header(cluster, aml_operator, azure,
                                                                 caplog):
    caplog.set_level(logging.DEBUG)
    port = aml_operator.runtime.metrics.serve(0, host="127.0.0.1")
    azure.fail("GET", "/jobs/", 401, "InvalidAuthenticationToken",
               "The access token is invalid.", times=3)
    async with aiohttp.ClientSession(base_url=str(cluster.url)) as session:
        async with session.post("/apis/finetune.dev/v1alpha1/namespaces/default/finetunejobs",
                                json=azureml_job()) as response:
            assert response.status == 200, await response.text()
    name = await submitted(cluster, azure)
    azure.set_state(name, "Running")
    azure.log_metrics(name, 40, loss=1.25, total_steps=100, tokens_per_second=52000.0,
                      epoch=0.4, eta_seconds=600)
    await eventually(phase_is(cluster, "Running"), what="Running")
    azure.set_state(name, "Completed")
    await eventually(phase_is(cluster, "Succeeded"), what="Succeeded")

    assert {c.authorization for c in azure.calls} == {f"Bearer {AZURE_TOKEN}"}  # in use
    assert [f.times for f in azure.failures] == [0]  # the 401s were all answered
    assert_nowhere(AZURE_TOKEN, {
        "the operator's log": caplog.text,
        "events": json.dumps(cluster.live("v1/events")),
        "the FineTuneJob": json.dumps(cluster.get(FTJ, "default", "aml")),
        "/metrics": scrape(port),
        "the job sent to Azure ML": json.dumps(azure.jobs),
    })
