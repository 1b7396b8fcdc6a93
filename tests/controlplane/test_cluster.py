"""What only a real control plane can show: the scheduler's and the Job controller's own words,
admission (a missing PriorityClass), kubectl's view of a FineTuneJob, Kueue's contract, and
which bad manifests the API server refuses by itself."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from tests.conftest import minimal_job
from tests.controlplane import kueue
from tests.controlplane.testbed import ControlPlaneTestbed
from tests.unit.test_bad_manifests import CASES, edit

pytestmark = pytest.mark.timeout(300)


@pytest.mark.asyncio
async def test_a_forbidden_pod_is_named_in_a_condition(control_plane_testbed):
    """The PriorityClass does not exist: admission refuses every pod and only the Job
    controller's FailedCreate event says so. The operator reads it into a condition, and the
    startup deadline ends the job with it."""
    bed: ControlPlaneTestbed = control_plane_testbed
    await bed.apply(bed.manifest(kubernetes={"priorityClassName": "training-high",
                                             "annotations": {"fake.finetune.dev/run-time": "1h"}},
                                 runPolicy={"startupDeadlineSeconds": 8}))
    await bed.until(lambda: "no PriorityClass with name training-high" in bed.condition(
        "Running").get("message", ""), "the refusal in the Running condition")
    assert bed.condition("Running")["status"] == "False"
    assert bed.status()["phase"] == "Launching"
    assert "FailedCreate" in bed.status()["message"]
    await bed.until_phase("Failed")
    assert bed.condition("Failed")["reason"] == "StartupDeadlineExceeded"
    assert "no PriorityClass with name training-high was found" in bed.status()["message"]


@pytest.mark.asyncio
async def test_more_gpus_than_any_node_has_fails_with_the_schedulers_words(
        control_plane_testbed):
    bed: ControlPlaneTestbed = control_plane_testbed
    await bed.apply(bed.manifest(resources={"nodes": 1, "gpusPerNode": 16},
                                 runPolicy={"startupDeadlineSeconds": 6}))
    await bed.until(lambda: "Unschedulable" in bed.condition("Running").get("message", ""),
                    "the scheduler's reason in the Running condition")
    await bed.until_phase("Failed")
    message = bed.status()["message"]
    assert "Unschedulable: 0/5 nodes are available" in message
    assert "Insufficient nvidia.com/gpu" in message
    await bed.until(lambda: bed.get("batch/v1/jobs", "demo") is None, "workers removed")


@pytest.mark.asyncio
async def test_pods_land_on_the_pool_their_spec_asks_for(control_plane_testbed):
    """The real scheduler: GPU pods tolerate the GPU taint and fit the 8-GPU pool; spot pods
    go to the spot node; CPU pods to the untainted CPU node."""
    bed: ControlPlaneTestbed = control_plane_testbed
    await bed.apply(bed.manifest("gpu"))
    await bed.apply(bed.manifest("spot", resources={"nodes": 1, "gpusPerNode": 8},
                                 kubernetes={"spot": True, "annotations": {
                                     "fake.finetune.dev/run-time": "1h"}}))
    await bed.apply(bed.manifest("cpu", resources={"nodes": 1, "gpusPerNode": 0}))
    for name in ("gpu", "spot", "cpu"):
        await bed.until_phase("Running", name)
    nodes = {name: {p["spec"]["nodeName"] for p in bed.running_pods(name)}
             for name in ("gpu", "spot", "cpu")}
    assert nodes == {"gpu": {"aks-ndasrv4-0", "aks-ndasrv4-1"}, "spot": {"aks-a100spot-0"},
                     "cpu": {"aks-cpu-0"}}


@pytest.mark.asyncio
async def test_kubectl_shows_columns_conditions_and_events(control_plane_testbed):
    bed: ControlPlaneTestbed = control_plane_testbed
    await bed.apply(bed.manifest())
    await bed.until_phase("Running")
    await bed.report_progress("demo")
    await bed.until(lambda: bed.status().get("progress", {}).get("step") == 40, "progress")
    kubectl = bed.installation.kubectl
    table = kubectl("get", "ftj", "-n", bed.namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "BACKEND", "NODES", "GPUS", "STEP", "LOSS",
                                "AGE"]
    assert table[1].split()[:7] == ["demo", "Running", "kubernetes", "2", "8", "40", "1.25"]
    wide = kubectl("get", "finetunejobs", "-o", "wide", "-n", bed.namespace).stdout
    assert wide.splitlines()[0].split()[6:8] == ["TOTAL", "LOSS"]
    assert "52000" in wide  # tokens/s
    described = kubectl("describe", "ftj", "demo", "-n", bed.namespace).stdout
    assert "Conditions:" in described and "WorkersRunning" in described
    await bed.until(lambda: "Running" in bed.installation.kubectl(
        "describe", "ftj", "demo", "-n", bed.namespace).stdout.split("Events:")[-1],
        "our events in describe")
    events = kubectl("describe", "ftj", "demo", "-n", bed.namespace).stdout.split("Events:")[1]
    assert "Launching" in events and "creating workers" in events


@pytest.mark.asyncio
async def test_kueue_contract_to_queued_then_admitted_by_a_stand_in(control_plane_testbed):
    """Up to Queued on the real API server; admission by tests/controlplane/kueue.py, a
    stand-in doing what Kueue documents (the real Kueue cannot be built here)."""
    bed: ControlPlaneTestbed = control_plane_testbed
    await bed.apply(bed.manifest(kubernetes={"queueName": "team-a", "annotations": {
        "fake.finetune.dev/run-time": "1h"}}))
    await bed.until_phase("Queued")
    job = bed.get("batch/v1/jobs", "demo")
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"][kueue.QUEUE_LABEL] == "team-a"
    assert bed.condition("Admitted")["reason"] == "WaitingForQueue"
    await asyncio.sleep(2)
    assert not await asyncio.to_thread(bed.running_pods, "demo")  # held while suspended

    kubectl = bed.installation.kubectl
    assert [j["metadata"]["name"] for j in kueue.queued_jobs(kubectl, bed.namespace)] == ["demo"]
    await asyncio.to_thread(kueue.admit, kubectl, bed.namespace, "demo",
                            {"agentpool": "ndasrv4"})
    await bed.until_phase("Running")
    assert bed.condition("Admitted")["status"] == "True"
    assert {p["spec"]["nodeSelector"]["agentpool"] for p in bed.running_pods("demo")} == {
        "ndasrv4"}
    assert bed.jobs_created("demo") == 1

    # preempted by a job of higher priority: Queued again, saying so, nothing counted (#24)
    original = job["spec"]["template"]["spec"].get("nodeSelector") or {}
    await asyncio.to_thread(kueue.preempt, kubectl, bed.namespace, "demo", original)
    await bed.until(lambda: bed.condition("Admitted")["reason"] == "Preempted", "Preempted")
    assert bed.status()["phase"] == "Queued"
    assert bed.condition("Running")["status"] == "False"
    await bed.until(lambda: not bed.running_pods("demo"), "the preempted pods stopped")
    await asyncio.to_thread(kueue.admit, kubectl, bed.namespace, "demo",
                            {"agentpool": "ndasrv4"})
    await bed.until_phase("Running")
    assert bed.status().get("restarts", 0) == 0
    assert bed.jobs_created("demo") == 1  # the same Job, admitted again


# Cases of tests/unit/test_bad_manifests.py that the CRD cannot see, and what the API server
# says instead: only `finetune validate` (or the operator's Validated condition) names them.
NOT_THE_CRDS_TO_SAY = {
    "wrong-api-version": "no matches for kind",
    "wrong-kind": "no matches for kind",
    "missing-name": "name",
}


def test_the_api_server_refuses_what_the_crd_can_see(installation):
    """Every bad manifest whose problem the CRD's schema or CEL rules can see is refused at
    `kubectl apply` (server-side dry run: the full validation, nothing stored), naming the
    field `finetune validate` names; the others are accepted, and the operator refuses them
    with a Validated=False condition (tests/operator/test_scenarios.py)."""
    assert installation.kubectl("apply", "--dry-run=server", "-f", "-",
                                input=json.dumps(minimal_job())).returncode == 0
    wrong = []
    for case in CASES:
        doc = edit(minimal_job(), case.changes)
        result = installation.kubectl("apply", "--dry-run=server", "-n", "default", "-f", "-",
                                      input=json.dumps(doc), check=False)
        said = result.stdout + result.stderr
        if case.server is not None:
            field = case.path.split("[")[0].rsplit(".", 1)[-1]
            if result.returncode == 0 or field not in said:
                wrong.append(f"{case.id}: expected a refusal naming {case.path}: {said}")
        elif case.id in NOT_THE_CRDS_TO_SAY:
            if result.returncode == 0 or NOT_THE_CRDS_TO_SAY[case.id] not in said:
                wrong.append(f"{case.id}: {said}")
        elif result.returncode != 0:
            wrong.append(f"{case.id}: refused, but the table says only the operator can: "
                         f"{said}")
    assert wrong == []


def test_kubectl_is_the_version_it_was_built_as(control_plane):
    version = subprocess.run([str(control_plane.kubectl), "version", "--client", "-o", "json"],
                             capture_output=True, text=True, check=True)
    assert json.loads(version.stdout)["clientVersion"]["gitVersion"] == "v1.36.3"


def test_every_example_is_accepted_by_the_api_server(installation):
    from tests.conftest import EXAMPLES, load_yaml

    for path in EXAMPLES:
        doc = load_yaml(path)
        doc["metadata"].pop("namespace", None)  # the examples' namespaces need not exist here
        result = installation.kubectl("apply", "--dry-run=server", "-n", "default", "-f", "-",
                                      input=json.dumps(doc), check=False)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"


@pytest.mark.asyncio
async def test_a_multi_node_job_is_not_launched_onto_a_claim_of_one_node(
        control_plane_testbed):
    """#19, item 3: the output claim is ReadWriteOnce (AKS's managed-disk default): the
    second node's pods could never mount it. The operator reads the claim (the chart's
    Role lets it), says why in a Warning event, and creates nothing."""
    bed: ControlPlaneTestbed = control_plane_testbed
    kubectl = bed.installation.kubectl
    volume = f"{bed.namespace}-single"
    await asyncio.to_thread(kubectl, "apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
             "spec": {"capacity": {"storage": "1Ti"}, "accessModes": ["ReadWriteOnce"],
                      "hostPath": {"path": f"/fake/{volume}"}, "storageClassName": "",
                      "claimRef": {"namespace": bed.namespace, "name": "single"}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "single", "namespace": bed.namespace},
             "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "",
                      "volumeName": volume, "resources": {"requests": {"storage": "1Ti"}}}}]}))
    try:
        await bed.apply(bed.manifest(output={"uri": "pvc://single/out"}))

        def warned() -> bool:
            listed = json.loads(kubectl("get", "events", "-n", bed.namespace, "-o", "json").stdout)
            return any("claim 'single' is ReadWriteOnce" in (e.get("message") or "")
                       for e in listed["items"])

        await bed.until(warned, "the Warning event naming the claim")
        assert bed.jobs_created("demo") == 0
        assert bed.create_attempts("jobs", "demo") == 0
        assert not bed.operator_denials()
    finally:
        await asyncio.to_thread(kubectl, "delete", "pv", volume, "--wait=false")
