"""`kubectl apply` to `Succeeded`, and every way in between, with the real kopf operator
against KMock's Kubernetes emulator; a simulated kubelet plays the Job controller."""

from __future__ import annotations

import aiohttp
import pytest

from finetune_trainer.progress import Progress
from tests.conftest import minimal_job
from tests.operator.conftest import eventually
from tests.operator.emulator import ApiServer

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.asyncio, pytest.mark.timeout(120)]
JOBS = "/apis/finetune.dev/v1alpha1/namespaces/default/finetunejobs"


def manifest(name: str = "demo", **spec) -> dict:
    doc = minimal_job(**{"resources": {"nodes": 2, "gpusPerNode": 8}, **spec})
    doc["metadata"] = {"name": name, "namespace": "default"}
    return doc


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


def ftj(cluster: ApiServer, name: str = "demo") -> dict:
    return cluster.get("finetune.dev/v1alpha1/finetunejobs", "default", name)


def status(cluster: ApiServer, name: str = "demo") -> dict:
    return (ftj(cluster, name) or {}).get("status", {})


def events(cluster: ApiServer) -> list[str]:
    return [e.get("reason") for e in cluster.live("v1/events")]


async def test_apply_creates_the_workers_and_reports_progress(cluster, kubelet, operator, rank0):
    await apply(cluster, manifest())
    await eventually(lambda: status(cluster).get("phase") == "Running", what="Running")

    job = cluster.get("batch/v1/jobs", "default", "demo")
    assert job["spec"]["completions"] == 2 and job["spec"]["completionMode"] == "Indexed"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["torchrun"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PET_NNODES"] == "2" and env["PET_MASTER_ADDR"] == "demo-0.demo.default.svc"
    uid = ftj(cluster)["metadata"]["uid"]
    for kind, name in (("batch/v1/jobs", "demo"), ("v1/services", "demo"),
                       ("v1/configmaps", "demo-trainer")):
        owner = cluster.get(kind, "default", name)["metadata"]["ownerReferences"][0]
        assert owner["uid"] == uid and owner["controller"] is True
    assert "finetune.dev/finalizer" in ftj(cluster)["metadata"]["finalizers"]

    rank0.publish(Progress(step=40, totalSteps=100, epoch=0.4, loss=1.25, learningRate=1e-4,
                           tokensPerSecond=52000.0, etaSeconds=600))
    await eventually(lambda: status(cluster).get("progress", {}).get("step") == 40,
                     what="progress in status")
    progress = status(cluster)["progress"]
    assert progress["totalSteps"] == 100 and progress["loss"] == 1.25
    assert progress["tokensPerSecond"] == 52000.0 and progress["etaSeconds"] == 600
    running = {c["type"]: c["status"] for c in status(cluster)["conditions"]}
    assert running["Validated"] == "True" and running["Running"] == "True"

    await kubelet.succeed("demo")
    await eventually(lambda: status(cluster).get("phase") == "Succeeded", what="Succeeded")
    assert status(cluster)["completionTime"]
    await eventually(lambda: {"Launching", "Running", "Succeeded"} <= set(events(cluster)),
                     what="an event for every transition")


async def test_a_worker_failure_restarts_the_gang_and_counts(cluster, kubelet, operator):
    await apply(cluster, manifest())
    await eventually(lambda: status(cluster).get("phase") == "Running")
    await kubelet.fail("demo", 1, message="torch.OutOfMemoryError: CUDA out of memory")
    await eventually(lambda: status(cluster).get("restarts") == 1, what="restart counted")
    await eventually(lambda: kubelet.created_jobs.count("demo") == 2, what="a new Job")
    await eventually(lambda: status(cluster).get("phase") == "Running", what="running again")
    assert status(cluster)["restarts"] == 1
    assert "Restarting" in events(cluster)


async def test_preemption_restarts_without_using_the_budget(cluster, kubelet, operator):
    await apply(cluster, manifest())
    await eventually(lambda: status(cluster).get("phase") == "Running")
    await kubelet.preempt("demo", 0)
    await eventually(lambda: kubelet.created_jobs.count("demo") == 2, what="a new Job")
    await eventually(lambda: status(cluster).get("phase") == "Running")
    assert status(cluster).get("restarts", 0) == 0


async def test_an_exhausted_budget_fails_with_the_cause(cluster, kubelet, operator):
    await apply(cluster, manifest(runPolicy={"backoffLimit": 0}))
    await eventually(lambda: status(cluster).get("phase") == "Running")
    await kubelet.fail("demo", 0, message="ValueError: bad batch")
    await eventually(lambda: status(cluster).get("phase") == "Failed", what="Failed")
    failed = next(c for c in status(cluster)["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "ValueError: bad batch" in status(cluster)["message"]
    await eventually(lambda: cluster.get("batch/v1/jobs", "default", "demo") is None,
                     what="workers stopped")


async def test_pods_stuck_past_the_startup_deadline_fail_with_their_reason(
        cluster, kubelet, operator):
    kubelet.stuck_reason = ("ImagePullBackOff", 'Back-off pulling image "trainer:typo"')
    await apply(cluster, manifest(runPolicy={"startupDeadlineSeconds": 2}))
    await eventually(lambda: status(cluster).get("phase") == "Failed", what="Failed")
    assert "ImagePullBackOff" in status(cluster)["message"]
    failed = next(c for c in status(cluster)["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "StartupDeadlineExceeded"


async def test_suspend_and_resume(cluster, kubelet, operator):
    await apply(cluster, manifest())
    await eventually(lambda: status(cluster).get("phase") == "Running")
    await patch_spec(cluster, "demo", {"runPolicy": {"suspend": True}})
    await eventually(lambda: status(cluster).get("phase") == "Suspended", what="Suspended")
    await eventually(lambda: cluster.get("batch/v1/jobs", "default", "demo")["spec"]["suspend"])
    await eventually(lambda: not kubelet.running_pods("demo"), what="pods stopped")
    await patch_spec(cluster, "demo", {"runPolicy": {"suspend": False}})
    await eventually(lambda: status(cluster).get("phase") == "Running", what="resumed")
    assert kubelet.created_jobs.count("demo") == 1  # the same Job, unsuspended


async def test_delete_removes_the_children_and_releases_the_finalizer(
        cluster, kubelet, operator):
    await apply(cluster, manifest())
    await eventually(lambda: status(cluster).get("phase") == "Running")
    await delete(cluster, "demo")
    await eventually(lambda: ftj(cluster) is None, what="FineTuneJob gone")
    for kind, name in (("batch/v1/jobs", "demo"), ("v1/services", "demo"),
                       ("v1/configmaps", "demo-trainer")):
        assert cluster.get(kind, "default", name) is None, kind


async def test_an_operator_restart_adopts_and_creates_nothing_twice(cluster, kubelet, operator):
    await apply(cluster, manifest())
    await eventually(lambda: status(cluster).get("phase") == "Running")
    await operator.kill()
    await operator.start()
    await kubelet.succeed("demo")
    await eventually(lambda: status(cluster).get("phase") == "Succeeded", what="Succeeded")
    assert kubelet.created_jobs == ["demo"]
    assert status(cluster).get("restarts", 0) == 0


async def test_invalid_spec_is_refused_with_a_condition(cluster, kubelet, operator):
    await apply(cluster, manifest(dataset={"uri": "./local/train.jsonl"}))
    await eventually(lambda: status(cluster).get("phase") == "Failed", what="Failed")
    validated = next(c for c in status(cluster)["conditions"] if c["type"] == "Validated")
    assert validated["status"] == "False"
    assert "spec.dataset.uri: relative locations cannot be reached from pods" in (
        validated["message"])
    assert cluster.get("batch/v1/jobs", "default", "demo") is None


async def test_a_backend_this_operator_does_not_serve_is_refused(cluster, kubelet, operator):
    doc = manifest(backend="azureml", azureml={
        "subscriptionId": "00000000-0000-0000-0000-000000000000", "resourceGroup": "rg",
        "workspace": "ws", "compute": "gpu"})
    await apply(cluster, doc)
    await eventually(lambda: status(cluster).get("phase") == "Failed", what="Failed")
    validated = next(c for c in status(cluster)["conditions"] if c["type"] == "Validated")
    assert "'azureml' is not served by this operator — use one of: kubernetes" in (
        validated["message"])


async def test_many_jobs_at_once_all_run(cluster, kubelet, operator):
    await operator.stop()
    operator.runtime.interval = 3.0  # 50 jobs: look at each every few seconds, as in production
    await operator.start()
    names = [f"job-{i:02d}" for i in range(50)]
    for name in names:
        await apply(cluster, manifest(name, resources={"nodes": 1, "gpusPerNode": 1}))
    await eventually(lambda: all(status(cluster, n).get("phase") == "Running" for n in names),
                     timeout=90, what="all 50 Running")
    assert sorted(kubelet.created_jobs) == names
