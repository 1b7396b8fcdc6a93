"""What only a real control plane can show: the scheduler's and the Job controller's own words,
admission (a missing PriorityClass), kubectl's view of a FineTuneJob, Kueue's contract, and
which bad manifests the API server refuses by itself."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from tests.api.test_bad_manifests import CASES, edit
from tests.conftest import minimal_job
from tests.support import kueue
from tests.support.cluster_testbed import ControlPlaneTestbed

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
    assert wide.splitlines()[0].split()[5:9] == ["STRATEGY", "STEP", "TOTAL", "LOSS"]
    assert wide.splitlines()[1].split()[5] == bed.status()["plan"]["strategy"]  # auto, decided
    assert "52000" in wide  # tokens/s
    described = kubectl("describe", "ftj", "demo", "-n", bed.namespace).stdout
    assert "Conditions:" in described and "WorkersRunning" in described
    await bed.until(lambda: "Running" in bed.installation.kubectl(
        "describe", "ftj", "demo", "-n", bed.namespace).stdout.split("Events:")[-1],
        "our events in describe")
    events = kubectl("describe", "ftj", "demo", "-n", bed.namespace).stdout.split("Events:")[1]
    assert "Launching" in events and "creating workers" in events


FLAVOR = {"agentpool": "ndasrv4"}
UNPLACEABLE = ("couldn't assign flavors to pod set main: flavor ndasrv4 doesn't match node "
               "affinity")


def _queued_manifest(bed: ControlPlaneTestbed) -> dict:
    return bed.manifest(kubernetes={"queueName": "team-a", "annotations": {
        "fake.finetune.dev/run-time": "1h"}})


@pytest.mark.asyncio
async def test_kueue_queues_admits_and_preempts(control_plane_testbed):
    """Queued from the first look, with Kueue's reason when it cannot place the job; admitted
    onto the flavor's nodes; preempted and admitted again without a new Job or a counted
    restart. Kueue is tests/support/kueue.py, a stand-in doing what Kueue documents
    (the real Kueue cannot be built here)."""
    bed: ControlPlaneTestbed = control_plane_testbed
    with kueue.KueueStandIn(bed.installation.kubectl, bed.namespace) as stand_in:
        await bed.apply(_queued_manifest(bed))
        await bed.until_phase("Queued")
        job = bed.get("batch/v1/jobs", "demo")
        assert job["spec"]["suspend"] is True
        assert job["metadata"]["labels"][kueue.QUEUE_LABEL] == "team-a"
        assert bed.condition("Admitted")["reason"] == "WaitingForQueue"

        await asyncio.to_thread(stand_in.pend, "demo", UNPLACEABLE)
        await bed.until(lambda: UNPLACEABLE in bed.condition("Admitted")["message"],
                        "Kueue's reason in the Admitted condition", timeout=30)
        assert UNPLACEABLE in bed.status()["message"]
        assert not await asyncio.to_thread(bed.running_pods, "demo")  # held while suspended

        await asyncio.to_thread(stand_in.admit, "demo", FLAVOR)
        await bed.until_phase("Running")
        assert bed.condition("Admitted")["status"] == "True"
        assert {p["spec"]["nodeSelector"]["agentpool"] for p in bed.running_pods("demo")} == {
            "ndasrv4"}

        # preempted by a job of higher priority: Queued again, saying so, nothing counted
        await asyncio.to_thread(stand_in.preempt, "demo")
        await bed.until(lambda: bed.condition("Admitted")["reason"] == "Preempted", "Preempted")
        assert "higher priority" in bed.condition("Admitted")["message"]  # Kueue's words
        assert bed.status()["phase"] == "Queued"
        assert bed.condition("Running")["status"] == "False"
        assert "Preempted" in bed.event_reasons()
        await bed.until(lambda: not bed.running_pods("demo"), "the preempted pods stopped")
        await asyncio.to_thread(stand_in.admit, "demo", FLAVOR)
        await bed.until_phase("Running")
        assert bed.status().get("restarts", 0) == 0
        assert bed.jobs_created("demo") == 1  # the same Job, admitted again
        assert stand_in.errors == []


@pytest.mark.asyncio
async def test_kueue_suspend_frees_the_quota_and_resume_queues_again(control_plane_testbed):
    """runPolicy.suspend on an admitted job goes through Kueue's switch (the Workload's
    spec.active): Kueue evicts it and frees its quota, and does not undo the suspension
    (a suspended Job it would unsuspend at once); resume puts it back in its queue."""
    bed: ControlPlaneTestbed = control_plane_testbed
    with kueue.KueueStandIn(bed.installation.kubectl, bed.namespace) as stand_in:
        await bed.apply(_queued_manifest(bed))
        await asyncio.to_thread(stand_in.admit, "demo", FLAVOR)
        await bed.until_phase("Running")

        await bed.patch_spec("demo", {"runPolicy": {"suspend": True}})
        await bed.until_phase("Suspended")
        await bed.until(lambda: stand_in.workload("demo")["spec"]["active"] is False,
                        "the Workload deactivated")
        await bed.until(lambda: not bed.running_pods("demo"), "the workers stopped")
        await asyncio.sleep(2)  # Kueue would unsuspend a Job still admitted: it must not
        assert bed.get("batch/v1/jobs", "demo")["spec"]["suspend"] is True
        assert not bed.running_pods("demo")
        reserved = kueue._condition(stand_in.workload("demo"), "QuotaReserved")
        assert reserved["status"] == "False"  # the quota is free for other jobs
        assert bed.status()["phase"] == "Suspended"

        await bed.patch_spec("demo", {"runPolicy": {"suspend": False}})
        await bed.until(lambda: stand_in.workload("demo")["spec"]["active"] is True,
                        "the Workload active again")
        await bed.until_phase("Queued")
        assert bed.condition("Admitted")["status"] == "False"
        await asyncio.to_thread(stand_in.admit, "demo", FLAVOR)
        await bed.until_phase("Running")
        assert bed.jobs_created("demo") == 1
        assert bed.status().get("restarts", 0) == 0
        assert stand_in.errors == []


@pytest.mark.asyncio
async def test_kueue_gang_restart_queues_again_and_says_so(control_plane_testbed):
    """A worker failure of an admitted job restarts the gang as a new Job, which Kueue queues
    as a new Workload (the documented alternative to restarting inside the admitted Job,
    docs/kueue.md): Restarting, then Queued with the reason, then admitted and counted."""
    bed: ControlPlaneTestbed = control_plane_testbed
    with kueue.KueueStandIn(bed.installation.kubectl, bed.namespace) as stand_in:
        await bed.apply(_queued_manifest(bed))
        await asyncio.to_thread(stand_in.admit, "demo", FLAVOR)
        await bed.until_phase("Running")
        await bed.fail_worker("demo", 1, "CUDA error: an illegal memory access")
        await bed.until(lambda: bed.condition("Admitted")["reason"] == "RequeuedByRestart",
                        "queued again by the restart", timeout=60)
        assert bed.status()["phase"] == "Queued"
        assert "new Job" in bed.condition("Admitted")["message"]
        await bed.until(lambda: bed.jobs_created("demo") == 2, "the second Job")
        await asyncio.to_thread(stand_in.admit, "demo", FLAVOR)
        await bed.until_phase("Running")
        assert bed.status()["restarts"] == 1
        assert stand_in.errors == []


# Cases of tests/api/test_bad_manifests.py that the CRD cannot see, and what the API server
# says instead: only `finetune validate` (or the operator's Validated condition) names them.
NOT_THE_CRDS_TO_SAY = {
    "wrong-api-version": "no matches for kind",
    "wrong-kind": "no matches for kind",
    "missing-name": "name",
    # refused before the API server's validation looks (kubectl: the object's namespace
    # against the request's): the operator never sees it either
    "namespace-not-a-label": "namespace",
    "namespace-too-long": "namespace",
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
    from tests.conftest import EXAMPLES, SWEEP_EXAMPLES, load_yaml

    for path in EXAMPLES + SWEEP_EXAMPLES:
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
    await bed.make_claims("single", mode="ReadWriteOnce")
    await bed.apply(bed.manifest(output={"uri": "pvc://single/out"}))

    def warned() -> bool:
        listed = json.loads(kubectl("get", "events", "-n", bed.namespace, "-o", "json").stdout)
        return any("claim 'single' is ReadWriteOnce" in (e.get("message") or "")
                   for e in listed["items"])

    await bed.until(warned, "the Warning event naming the claim")
    assert bed.jobs_created("demo") == 0
    assert bed.create_attempts("jobs", "demo") == 0
    assert not bed.operator_denials()
    # said in the status too (it was empty), and an edit is looked at at once (not after
    # the 5 minutes a retried failure waits)
    status = bed.status()
    assert status["phase"] == "Pending", status
    assert "claim 'single' is ReadWriteOnce" in status["message"]
    await bed.make_claims("shared")
    await bed.patch_spec("demo", {"output": {"uri": "pvc://shared/out"}})
    await bed.until_phase("Running", timeout=60)


@pytest.mark.asyncio
async def test_a_claim_that_does_not_exist_is_named_by_its_field_until_it_is_made(
        control_plane_testbed):
    """The scheduler says only 'persistentvolumeclaim "later" not found': the status says
    which field names it and what to do. The job waits (a claim made after the job is a
    normal order) and runs once the claim is made."""
    bed: ControlPlaneTestbed = control_plane_testbed
    await bed.apply(bed.manifest(output={"uri": "pvc://later/out"}))
    named = (f"namespace {bed.namespace} has no PersistentVolumeClaim 'later', which "
             "spec.output.uri (pvc://later/out) names")
    await bed.until_waiting_says(named)
    assert f"kubectl get pvc -n {bed.namespace}" in bed.status()["message"]
    await bed.until(lambda: job_warnings(bed, "Unschedulable"), "the job's Warning event")
    wide = bed.installation.kubectl("get", "ftj", "demo", "-n", bed.namespace, "-o", "wide")
    assert "has no PersistentVolumeClaim 'later'" in wide.stdout  # the MESSAGE column
    await bed.make_claims("later")
    await bed.until_phase("Running")
    assert bed.jobs_created("demo") == 1
    [warned] = job_warnings(bed, "Unschedulable")  # once, however often the scheduler retried
    assert named in warned["message"], warned


def job_warnings(bed: ControlPlaneTestbed, reason: str, name: str = "demo") -> list[dict]:
    """The Warning events on the FineTuneJob `name` of `reason`: what `kubectl describe ftj`
    and `kubectl get events` show."""
    listed = json.loads(bed.installation.kubectl(
        "get", "events", "-n", bed.namespace, "-o", "json", "--field-selector",
        f"involvedObject.kind=FineTuneJob,involvedObject.name={name},type=Warning,"
        f"reason={reason}").stdout)
    return listed["items"]


@pytest.mark.asyncio
async def test_a_volume_that_does_not_mount_is_named_from_the_kubelets_event(
        control_plane_testbed):
    """A ConfigMap volume the namespace lacks: the pod stays ContainerCreating, and only the
    kubelet's FailedMount event says why. KWOK's nodes mount nothing, so the test posts the
    event a kubelet posts; the operator finds it (a field-selected list of the namespace's
    pod warnings), names the volume and the fix, and the job runs once the pod mounts."""
    bed: ControlPlaneTestbed = control_plane_testbed
    kubectl, ns = bed.installation.kubectl, bed.namespace
    await bed.apply(bed.manifest(resources={"nodes": 1, "gpusPerNode": 8}, kubernetes={
        "labels": {"fake.finetune.dev/outcome": "mounting"},
        "annotations": {"fake.finetune.dev/run-time": "1h"},
        "volumes": [{"name": "cfg", "mountPath": "/cfg", "configMap": {"name": "train-cfg"}}]}))
    placed: list[dict] = []

    def on_a_node() -> bool:
        listed = json.loads(kubectl("get", "pods", "-n", ns, "-l", "finetune.dev/job=demo",
                                    "-o", "json").stdout)["items"]
        placed[:] = [p for p in listed if p["spec"].get("nodeName")]
        return bool(placed)

    await bed.until(on_a_node, "the worker on a node")
    worker = placed[0]
    now = worker["metadata"]["creationTimestamp"]
    await asyncio.to_thread(kubectl, "create", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{worker['metadata']['name']}.", "namespace": ns},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": ns,
                           "name": worker["metadata"]["name"],
                           "uid": worker["metadata"]["uid"]},
        "type": "Warning", "reason": "FailedMount", "count": 1,
        "message": 'MountVolume.SetUp failed for volume "cfg" : configmap "train-cfg" not found',
        "source": {"component": "kubelet", "host": worker["spec"]["nodeName"]},
        "firstTimestamp": now, "lastTimestamp": now}))
    named = (f"namespace {ns} has no ConfigMap 'train-cfg', which spec.kubernetes.volumes[0] "
             "(cfg) names")
    await bed.until_waiting_says(named)
    assert f"kubectl create configmap train-cfg -n {ns}" in bed.status()["message"]
    await bed.until(lambda: job_warnings(bed, "FailedMount"), "the job's Warning event")
    await asyncio.to_thread(kubectl, "label", "pod", "-n", ns, worker["metadata"]["name"],
                            "fake.finetune.dev/outcome-")
    await bed.until_phase("Running")
    assert not bed.operator_denials()  # the chart's Role lets it list the events


@pytest.mark.asyncio
async def test_a_model_the_hub_refuses_fails_the_job_at_once_through_the_job_controller(
        control_plane_testbed):
    """The fetch-model init container's exit 2 (no such model, a gated one without a token)
    meets the pod failure policy's FailJob rule in the real Job controller: the Job fails
    without a restart, and the FineTuneJob says what the fetch said."""
    bed = control_plane_testbed
    await bed.apply(bed.manifest())  # an hf:// model: the pods have the fetch-model container
    await bed.until_phase("Running")
    job = bed.get("batch/v1/jobs", "demo")
    assert [c["name"] for c in job["spec"]["template"]["spec"]["initContainers"]] == [
        "resume-check", "fetch-model"]
    said = ("fetch-model: spec.model.uri: hf://Qwen/Qwen2.5-0.5B does not exist on the hub, "
            "or is private — check the name")
    await bed.fail_init_container("demo", 0, "fetch-model", said, exit_code=2)
    await bed.until_phase("Failed")
    failed = bed.condition("Failed")
    assert failed["reason"] == "ModelRefused", failed
    assert "does not exist on the hub" in failed["message"]
    job = bed.get("batch/v1/jobs", "demo")
    # the Job controller's own verdict: FailureTarget, then Failed once the pods are gone
    assert any(c["type"] in ("FailureTarget", "Failed") and c["reason"] == "PodFailurePolicy"
               for c in job["status"].get("conditions", [])), job["status"]
    assert bed.status().get("restarts", 0) == 0
    assert bed.jobs_created("demo") == 1
