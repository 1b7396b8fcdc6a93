"""What only a real control plane can show: the scheduler's and the Job controller's own words,
admission (a missing PriorityClass), kubectl's view of a FineTuneJob, and which bad
manifests the API server refuses by itself (Kueue's part: test_kueue.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess

import pytest

from tests.api.test_bad_manifests import CASES, edit
from tests.conftest import minimal_job
from tests.support.cluster_testbed import RUN_TIME, ControlPlaneTestbed


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
async def test_a_job_that_ran_longer_than_its_startup_deadline_succeeds(control_plane_testbed):
    """The Job controller says SuccessCriteriaMet when the last pod succeeds and Complete only
    later; the workers of each node end one by one. Between them, a job that ran past its
    startupDeadlineSeconds had read as never started and was failed (#49). The deadline
    leaves a loaded machine time to start the pods (10 s did not, once: the job failed
    before Running), and the run outlasts it."""
    bed: ControlPlaneTestbed = control_plane_testbed
    await bed.apply(bed.manifest(kubernetes={"nodeSelector": {"agentpool": "ndasrv4"},
                                             "annotations": {RUN_TIME: "45s"}},
                                 runPolicy={"startupDeadlineSeconds": 30}))
    await bed.until_phase("Running")
    await bed.until(lambda: bed.status().get("phase") in ("Succeeded", "Failed"),
                    "the job ended")
    assert bed.status()["phase"] == "Succeeded", bed.status()
    assert bed.condition("Complete")["status"] == "True"


def unanswered_webhook(namespace: str) -> dict:
    """A mutating webhook for Jobs in `namespace` whose server does not run: what the API
    server meets when Kueue's controller manager is down (its Service an ExternalName to
    localhost, as make cluster reaches a webhook on this machine; nothing on the port)."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "webhook-down", "namespace": namespace},
               "spec": {"type": "ExternalName", "externalName": "localhost",
                        "ports": [{"port": port}]}}
    webhook = {"apiVersion": "admissionregistration.k8s.io/v1",
               "kind": "MutatingWebhookConfiguration", "metadata": {"name": namespace},
               "webhooks": [{
                   "name": "mjob.down.finetune.dev", "failurePolicy": "Fail",
                   "sideEffects": "None", "admissionReviewVersions": ["v1"],
                   "clientConfig": {"service": {"namespace": namespace, "name": "webhook-down",
                                                "port": port, "path": "/mutate"}},
                   "rules": [{"operations": ["CREATE"], "apiGroups": ["batch"],
                              "apiVersions": ["v1"], "resources": ["jobs"]}],
                   "namespaceSelector": {"matchLabels": {
                       "kubernetes.io/metadata.name": namespace}}}]}
    return {"apiVersion": "v1", "kind": "List", "items": [service, webhook]}


@pytest.mark.asyncio
async def test_a_webhook_that_does_not_answer_is_in_the_status_until_it_does(
        control_plane_testbed):
    """Every Job create is refused while an admission webhook is down (Kueue's, when its
    manager stops): the job says so, Pending, with the API server's words and what to do,
    instead of showing no phase at all; it launches once the webhook is gone (#49)."""
    bed: ControlPlaneTestbed = control_plane_testbed
    await bed.apply(unanswered_webhook(bed.namespace))
    try:
        await bed.apply(bed.manifest())
        await bed.until(lambda: "failed calling webhook" in bed.status().get("message", ""),
                        "the refusal in the status")
        status = bed.status()
        assert status["phase"] == "Pending"
        assert status["message"].startswith("not launched yet (retried with a backoff): "
                                            "create Job demo: 500")
        assert '"mjob.down.finetune.dev"' in status["message"]
        assert "does not answer" in status["message"]
        assert "kubectl -n kueue-system get pods" in status["message"]
        assert bed.get("batch/v1/jobs", "demo") is None
    finally:
        await asyncio.to_thread(bed.installation.kubectl, "delete",
                                "mutatingwebhookconfiguration", bed.namespace)
    await bed.until(lambda: bed.status().get("phase") in ("Launching", "Running"),
                    "launched once the webhook is gone")


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
    await bed.until_phase("Running")


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
    assert failed["reason"] == "InputRefused", failed
    assert "does not exist on the hub" in failed["message"]
    job = bed.get("batch/v1/jobs", "demo")
    # the Job controller's own verdict: FailureTarget, then Failed once the pods are gone
    assert any(c["type"] in ("FailureTarget", "Failed") and c["reason"] == "PodFailurePolicy"
               for c in job["status"].get("conditions", [])), job["status"]
    assert bed.status().get("restarts", 0) == 0
    assert bed.jobs_created("demo") == 1
