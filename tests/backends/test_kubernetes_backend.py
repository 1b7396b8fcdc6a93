"""The kubernetes backend's objects: what torchrun pods need, valid Kubernetes, least privilege."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import kubernetes_validate
import pytest

from finetune_operator.api import FineTuneJobStatus
from finetune_operator.backends import BackendContext
from finetune_operator.backends.kubernetes import backend as k8s_backend
from finetune_operator.backends.kubernetes import states, workers
from finetune_operator.reconcile import Observation
from finetune_operator.settings import OperatorSettings, Taint
from finetune_operator.validation import parse_job
from tests.conftest import CLUSTER_EXAMPLES, load_yaml, minimal_job

SETTINGS = OperatorSettings()
PUSHED = OperatorSettings(trainer_image="registry.example/finetune-trainer:1.2.3")
"""An operator given the image it runs (the chart's trainer.image)."""
K8S_EXAMPLES = [p for p in CLUSTER_EXAMPLES
                if load_yaml(p)["spec"].get("backend", "kubernetes") == "kubernetes"]


def objects(doc, settings=SETTINGS):
    rendered = workers.render(parse_job(doc), settings)
    return {o["kind"]: o for o in rendered}


def pod(doc, settings=SETTINGS):
    return objects(doc, settings)["Job"]["spec"]["template"]["spec"]


def env(doc) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in
            pod(doc)["containers"][0]["env"]}


@pytest.mark.parametrize("version", ["1.30", "1.37"])
@pytest.mark.parametrize("path", K8S_EXAMPLES, ids=lambda p: p.name)
def test_rendered_objects_are_valid_kubernetes(path, version):
    doc = load_yaml(path)
    doc["metadata"]["uid"] = "6c1f0d52-1c1a-4a8e-9d47-0f6a1b2c3d4e"
    for obj in workers.render(parse_job(doc), SETTINGS):
        kubernetes_validate.validate(obj, version, strict=True)


def test_one_indexed_job_one_pod_per_node_failing_fast():
    job = objects(minimal_job(resources={"nodes": 4, "gpusPerNode": 8}))["Job"]["spec"]
    assert job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == 4
    assert job["backoffLimit"] == 0  # gang restarts are the operator's
    assert job["suspend"] is False
    assert job["template"]["spec"]["restartPolicy"] == "Never"


def test_torchrun_rendezvous_at_rank_zero():
    doc = minimal_job(resources={"nodes": 2, "gpusPerNode": 8})
    values = env(doc)
    assert values["PET_NNODES"] == "2" and values["PET_NPROC_PER_NODE"] == "8"
    assert values["PET_NODE_RANK"] == {"fieldRef": {"fieldPath": workers.COMPLETION_INDEX}}
    assert values["PET_MASTER_ADDR"] == "demo-0.demo.default.svc"
    container = pod(doc)["containers"][0]
    assert container["command"] == ["python", "-m", "finetune_trainer.launch"]
    assert "--node-rank=$(PET_NODE_RANK)" in container["args"]
    assert container["args"][-3:] == ["-m", "finetune_trainer", "--config=$(FINETUNE_CONFIG)"]
    service = objects(doc)["Service"]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    assert pod(doc)["subdomain"] == "demo"


def test_cpu_workers_get_their_process_count_and_no_gpu():
    spec = pod(minimal_job(resources={"gpusPerNode": 0, "processesPerNode": 2, "cpu": 4}))
    container = spec["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert container["resources"]["requests"] == {"cpu": "4"}
    assert "tolerations" not in spec
    assert env(minimal_job(resources={"gpusPerNode": 0, "processesPerNode": 2}))[
        "PET_NPROC_PER_NODE"] == "2"


def test_gpu_limits_and_the_aks_gpu_taint():
    spec = pod(minimal_job(resources={"gpusPerNode": 4}))
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in (
        spec["tolerations"])
    custom = OperatorSettings(gpu_taint=Taint(key="nvidia.com/gpu"))
    assert pod(minimal_job(), custom)["tolerations"] == [
        {"key": "nvidia.com/gpu", "effect": "NoSchedule", "operator": "Exists"}]


def test_spot_nodes_are_tolerated_and_required():
    spec = pod(minimal_job(kubernetes={"spot": True}))
    assert {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal",
            "value": "spot", "effect": "NoSchedule"} in spec["tolerations"]
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"][0]
    assert term == {"key": "kubernetes.azure.com/scalesetpriority", "operator": "In",
                    "values": ["spot"]}


def test_infiniband_resources_capability_and_nccl_env():
    doc = minimal_job(resources={"gpusPerNode": 8}, kubernetes={"infiniband": True})
    container = pod(doc)["containers"][0]
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                            "add": ["IPC_LOCK"]}
    assert env(doc)["NCCL_IB_DISABLE"] == "0"
    plain = pod(minimal_job())["containers"][0]["securityContext"]["capabilities"]
    assert plain == {"drop": ["ALL"]}


def test_cpu_workers_see_no_gpu_of_their_node():
    """Without a GPU limit a GPU node's devices can still be visible (an NVIDIA image's
    NVIDIA_VISIBLE_DEVICES=all), and the trainer takes the GPU of each local rank."""
    cpu = env(minimal_job(resources={"gpusPerNode": 0, "processesPerNode": 4}))
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in env(minimal_job(resources={"gpusPerNode": 8}))


def test_non_root_read_only_root_and_shared_memory():
    spec = pod(minimal_job(kubernetes={"shmSize": "32Gi"}))
    assert spec["securityContext"]["runAsNonRoot"] is True
    container = spec["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    values = env(minimal_job())
    for cache in ("HF_HOME", "XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR"):
        assert values[cache].startswith("/tmp/finetune/"), cache  # the writable scratch volume
    dshm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # a read-only root leaves Python's tempfile no folder: /tmp is an emptyDir (seen on the
    # real node: "No usable temporary directory found in ['/tmp', '/var/tmp', ...]")
    tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert next(v for v in spec["volumes"] if v["name"] == tmp["name"])["emptyDir"] == {}


def test_claims_are_mounted_where_the_trainer_config_points():
    doc = minimal_job(model={"uri": "pvc://models/llama"},
                      dataset={"uri": "pvc://data/train.jsonl"},
                      output={"uri": "pvc://data/runs/demo"})
    rendered = objects(doc)
    spec = rendered["Job"]["spec"]["template"]["spec"]
    claims = {v["persistentVolumeClaim"]["claimName"]: v["persistentVolumeClaim"]["readOnly"]
              for v in spec["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"models": True, "data": False}  # data also holds the output
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert {"/mnt/pvc/models", "/mnt/pvc/data"} <= mounts
    trainer = load_yaml_text(rendered["ConfigMap"]["data"]["trainer.yaml"])
    assert trainer["model"]["uri"] == "/mnt/pvc/models/llama"
    assert trainer["output"]["uri"] == "/mnt/pvc/data/runs/demo"


def test_each_export_secret_is_mounted_where_the_trainer_reads_a_targets_credentials():
    """`output.export[].secretName`: each Secret once, only the keys its targets read (an
    OCI target's Docker config, an hf:// target's `token`), read-only, at
    layout.export_credentials (what the trainer reads for that target)."""
    from finetune_trainer.layout import export_credentials

    doc = minimal_job(output={"uri": "pvc://data/runs/demo", "export": [
        {"uri": "oci://myreg.azurecr.io/adapters/demo:v1", "secretName": "regcred"},
        {"uri": "oci://myreg.azurecr.io/adapters/demo:latest", "secretName": "regcred"},
        {"uri": "oci://ghcr.io/team/demo:v1", "secretName": "ghcr"},
        {"uri": "hf://team/demo", "secretName": "hub"},
        {"uri": "hf://team/demo-copy", "secretName": "ghcr"},
        {"uri": "oci://registry.internal:5000/demo:v1", "plainHttp": True}]})
    spec = objects(doc)["Job"]["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
    keys = {s["secretName"]: [item["key"] for item in s["items"]] for s in secrets.values()}
    assert keys == {"ghcr": [".dockerconfigjson", "token"], "hub": ["token"],
                    "regcred": [".dockerconfigjson"]}
    assert all(item["key"] == item["path"] for s in secrets.values() for item in s["items"])
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    for name, secret in secrets.items():
        assert mounts[name]["readOnly"] is True
        for key in keys[secret["secretName"]]:
            assert (Path(mounts[name]["mountPath"]) / key
                    == export_credentials(secret["secretName"], key))
    trainer = load_yaml_text(objects(doc)["ConfigMap"]["data"]["trainer.yaml"])
    assert [t["uri"] for t in trainer["output"]["export"]] == [
        t["uri"] for t in doc["spec"]["output"]["export"]]


def load_yaml_text(text: str):
    import yaml

    return yaml.safe_load(text)


def test_kueue_queue_label_and_suspended_job():
    job = objects(minimal_job(kubernetes={"queueName": "team-a"}))["Job"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["spec"]["suspend"] is True
    assert objects(minimal_job(runPolicy={"suspend": True}))["Job"]["spec"]["suspend"] is True


@pytest.mark.parametrize(("deadline", "timeout"), [
    (1800, 1860), (4, 64), (7190, 7200), (86400, 7200), (0, 7200)])
def test_a_queued_job_asks_kueue_to_wait_for_its_pods_past_its_own_startup_deadline(
        deadline, timeout):
    """Kueue v0.19 turned waitForPodsReady on (30 minutes, cluster-wide): a job whose model
    download takes longer was evicted and requeued. The worker Job carries Kueue's
    per-workload timeout (v0.20): a minute past startupDeadlineSeconds, so the operator's
    deadline, which says the pods' reason, acts first; capped at Kueue's default most."""
    job = objects(minimal_job(kubernetes={"queueName": "team-a"},
                              runPolicy={"startupDeadlineSeconds": deadline}))["Job"]
    annotation = job["metadata"]["annotations"]["kueue.x-k8s.io/wait-for-pods-ready"]
    assert json.loads(annotation) == {"timeoutSeconds": timeout}
    unqueued = objects(minimal_job(runPolicy={"startupDeadlineSeconds": deadline}))["Job"]
    assert "annotations" not in unqueued["metadata"]  # not Kueue's: nothing to say to it


def test_hub_token_comes_from_the_secret_and_user_env_follows():
    doc = minimal_job(model={"uri": "hf://meta-llama/Llama-3.1-8B",
                             "tokenSecretRef": {"name": "hf-token"}},
                      kubernetes={"env": [{"name": "LOG_LEVEL", "value": "debug"}]})
    values = env(doc)
    assert values["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert values["LOG_LEVEL"] == "debug"


def test_children_are_owned_by_the_job():
    doc = minimal_job()
    doc["metadata"]["uid"] = "uid-1"
    for obj in workers.render(parse_job(doc), SETTINGS):
        owner = obj["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "FineTuneJob" and owner["uid"] == "uid-1"
        assert owner["controller"] is True
        assert obj["metadata"]["labels"]["finetune.dev/job"] == "demo"


def test_user_pod_settings_pass_through():
    spec = pod(minimal_job(kubernetes={
        "nodeSelector": {"agentpool": "gpunp"}, "priorityClassName": "high",
        "serviceAccountName": "trainer", "image": "registry.example.com/trainer:1",
        "tolerations": [{"key": "team", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "extra", "mountPath": "/extra", "readOnly": True,
                     "configMap": {"name": "cm"}}]}))
    assert spec["nodeSelector"] == {"agentpool": "gpunp"}
    assert spec["priorityClassName"] == "high" and spec["serviceAccountName"] == "trainer"
    assert spec["containers"][0]["image"] == "registry.example.com/trainer:1"
    assert {"key": "team", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert {"name": "extra", "configMap": {"name": "cm"}} in spec["volumes"]
    assert {"name": "extra", "mountPath": "/extra", "readOnly": True} in (
        spec["containers"][0]["volumeMounts"])


def test_locations_pods_cannot_reach_are_refused():
    problems = workers.validate(parse_job(minimal_job(
        dataset={"uri": "./data.jsonl"},
        output={"uri": "azureml://datastores/blob/paths/out"})), PUSHED)
    assert [p.path for p in problems] == ["spec.dataset.uri", "spec.output.uri"]
    assert all("cannot be reached from pods" in p.message for p in problems)


def test_settings_from_the_environment():
    settings = OperatorSettings.from_env({
        "FINETUNE_TRAINER_IMAGE": "acr.io/trainer:2", "FINETUNE_GPU_TAINT": "null",
        "FINETUNE_RENDEZVOUS_PORT": "23456"})
    assert settings.trainer_image == "acr.io/trainer:2"
    assert settings.gpu_taint is None and settings.rendezvous_port == 23456


def test_every_local_rank_has_a_named_metrics_port_and_the_node_and_attempt():
    ports = pod(minimal_job(resources={"gpusPerNode": 4}))["containers"][0]["ports"]
    assert [(p["name"], p["containerPort"]) for p in ports if p["name"] != "rendezvous"] == [
        ("metrics", 9108), ("metrics-1", 9109), ("metrics-2", 9110), ("metrics-3", 9111)]
    doc = minimal_job()
    assert env(doc)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env(doc)["FINETUNE_RESTARTS"] == "0"
    job = parse_job(doc)
    job.status = FineTuneJobStatus(restarts=2)
    rendered = {o["kind"]: o for o in workers.render(job, SETTINGS)}
    container = rendered["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "FINETUNE_RESTARTS", "value": "2"} in container["env"]


def test_the_trainers_mfu_and_preflight_reach_the_observation():
    record = {"step": 5, "totalSteps": 10, "mfu": 0.43, "tokensPerSecond": 5e4,
              "preflight": {"busBandwidthGBps": 180.5, "slowNodes": []}}
    progress = states.progress_from_record(record)
    assert progress.mfu == 0.43 and progress.preflight["busBandwidthGBps"] == 180.5
    assert "preflight" not in progress.to_dict()  # a condition, not status.progress


def test_a_resume_check_runs_before_torchrun_and_its_refusal_fails_the_job():
    """torchrun reports a worker's exit as its own exit 1; the init container's exit 4
    reaches the Job controller, whose pod failure policy records it."""
    job = objects(minimal_job(resources={"nodes": 2, "gpusPerNode": 8}))["Job"]["spec"]
    check = job["template"]["spec"]["initContainers"][0]
    trainer = job["template"]["spec"]["containers"][0]
    assert check["name"] == "resume-check"
    assert check["command"][-2:] == ["--check-resume", "--config=$(FINETUNE_CONFIG)"]
    assert check["image"] == trainer["image"]
    assert check["volumeMounts"] == trainer["volumeMounts"]  # the config and the output
    assert check["securityContext"] == trainer["securityContext"]
    assert "resources" not in check  # nothing requested beyond the trainer's
    rules = job["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [4]}} in rules
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    # a suspension's SIGTERM (exit 143) must not end the Job: it is resumed later
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                "values": [143]}} in rules


def test_an_hf_model_is_fetched_into_the_output_volume_once_before_torchrun():
    """#17: the fetch-model init container downloads the model into the output claim (every
    node and restart reads it there); it runs after resume-check, so a job refused for
    other settings downloads nothing."""
    doc = minimal_job(resources={"nodes": 2, "gpusPerNode": 8},
                      model={"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "main",
                             "tokenSecretRef": {"name": "hf-token"}},
                      kubernetes={"env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]})
    spec = pod(doc)
    init, trainer = spec["initContainers"], spec["containers"][0]
    assert [c["name"] for c in init] == ["resume-check", "fetch-model"]
    fetcher = init[1]
    assert fetcher["command"] == ["python", "-m", "finetune_trainer", "--fetch-model",
                                  "--config=$(FINETUNE_CONFIG)"]
    assert fetcher["image"] == trainer["image"]
    assert fetcher["securityContext"] == trainer["securityContext"]
    assert "resources" not in fetcher  # nothing requested beyond the trainer's
    # the output claim, writable, where the trainer config points
    assert fetcher["volumeMounts"] == trainer["volumeMounts"]
    output = next(m for m in fetcher["volumeMounts"] if m["mountPath"] == "/mnt/pvc/ckpt")
    assert output["readOnly"] is False
    names = {e["name"]: e.get("value", e.get("valueFrom")) for e in fetcher["env"]}
    assert names["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert names["HTTPS_PROXY"] == "http://proxy:3128"  # the user's own reach the hub too
    assert {"FINETUNE_CONFIG", "HF_HOME", "XDG_CACHE_HOME"} <= set(names)
    assert not any(name.startswith(("PET_", "NCCL_")) for name in names)


@pytest.mark.parametrize("uri", ["pvc://models/llama-8b", "/models/in-the-image"])
def test_models_read_where_they_are_render_no_fetch(uri):
    spec = pod(minimal_job(model={"uri": uri}))
    assert [c["name"] for c in spec["initContainers"]] == ["resume-check"]
    rules = objects(minimal_job(model={"uri": uri}))["Job"]["spec"]["podFailurePolicy"]["rules"]
    assert all(r.get("onExitCodes", {}).get("containerName") != "fetch-model" for r in rules)


def test_the_hubs_refusal_of_the_model_ends_the_job_without_a_restart():
    rules = objects(minimal_job(model={"uri": "hf://Qwen/Qwen2.5-0.5B"}))["Job"]["spec"][
        "podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "fetch-model",
                                                 "operator": "In", "values": [2]}} in rules


@pytest.mark.parametrize("version", ["1.30", "1.37"])
@pytest.mark.parametrize("uri", ["hf://Qwen/Qwen2.5-0.5B", "pvc://models/qwen"])
def test_pods_with_and_without_the_fetch_are_valid_kubernetes(uri, version):
    doc = minimal_job(model={"uri": uri, **({"tokenSecretRef": {"name": "hf"}}
                                            if uri.startswith("hf://") else {})},
                      resources={"nodes": 2, "gpusPerNode": 8})
    doc["metadata"]["uid"] = "6c1f0d52-1c1a-4a8e-9d47-0f6a1b2c3d4e"
    for obj in workers.render(parse_job(doc), SETTINGS):
        kubernetes_validate.validate(obj, version, strict=True)


def test_a_multi_node_jobs_output_claim_must_be_read_write_many():
    """#19, item 3: every rank writes checkpoints into the output claim; one that attaches
    to a single node would leave the other nodes' pods waiting forever."""
    from finetune_operator.api import FineTuneJob
    from finetune_operator.backends.kubernetes.states import output_claim_problem

    job = FineTuneJob.model_validate(minimal_job(resources={"nodes": 2, "gpusPerNode": 8}))

    def claim(*modes):
        return {"metadata": {"name": "ckpt"}, "spec": {"accessModes": list(modes)}}

    assert output_claim_problem(job, claim("ReadWriteMany")) is None
    assert output_claim_problem(job, None) is None  # not multi-node, not pvc, or unreadable
    problem = output_claim_problem(job, claim("ReadWriteOnce"))
    assert problem.startswith("spec.output.uri: claim 'ckpt' is ReadWriteOnce, but the 2 "
                              "nodes' ranks all write checkpoints into it — use a "
                              "ReadWriteMany claim")


def test_a_refusal_in_a_namespace_being_deleted_is_told_apart():
    """The API server's answer to a create in a terminating namespace (its Status as v1.36
    writes it): the worker stops relaunching instead of retrying into every 403 (seen at
    1,000 jobs: their namespace's children went before the jobs did)."""
    import json

    from finetune_operator.kube import KubeError

    body = json.dumps({
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
        "message": 'configmaps "demo-trainer" is forbidden: unable to create new content in '
                   "namespace t-1 because it is being terminated",
        "details": {"name": "demo-trainer", "kind": "configmaps", "causes": [
            {"reason": "NamespaceTerminating", "message": "namespace t-1 is being terminated",
             "field": "metadata.namespace"}]}, "code": 403})
    assert KubeError("create ConfigMap demo-trainer", 403, "Forbidden",
                     body).namespace_terminating
    rbac = json.dumps({"kind": "Status", "reason": "Forbidden", "code": 403,
                       "message": "configmaps is forbidden: User cannot create"})
    refused = KubeError("create ConfigMap demo-trainer", 403, "Forbidden", rbac)
    assert not refused.namespace_terminating
    assert refused.message == "configmaps is forbidden: User cannot create"


def test_a_webhook_that_does_not_answer_is_named_with_what_to_do():
    """The API server's words when Kueue's webhook is down (v1.36, #49), and a refusal that
    is not a webhook's, which gets no hint."""
    import json

    from finetune_operator.kube import KubeError, webhook_hint

    said = ('Internal error occurred: failed calling webhook "mjob.kb.io": failed to call '
            'webhook: Post "https://kueue-webhook-service.kueue-system.svc:443/mutate-batch-'
            'v1-job?timeout=10s": dial tcp 127.0.0.1:443: connect: connection refused')
    down = KubeError("create Job demo", 500, "Internal Server Error",
                     json.dumps({"kind": "Status", "code": 500, "message": said}))
    hint = webhook_hint(down)
    assert hint.startswith(" — the admission webhook mjob.kb.io does not answer")
    assert "kubectl -n kueue-system get pods" in hint
    assert webhook_hint(KubeError("create Job demo", 409, "Conflict")) == ""


def test_kueues_word_on_a_queued_job_is_read_from_its_workload():
    why = "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu"
    waiting = {"spec": {"active": True}, "status": {"conditions": [
        {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": why}]}}
    assert states.queue_state(waiting, 5.0) == (True, why, None)
    admitted = {"spec": {}, "status": {"conditions": [
        {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "x"}]}}
    assert states.queue_state(admitted, 5.0) == (True, None, None)  # active unless set false
    assert states.queue_state({"spec": {"active": False}}, 5.0) == (False, None, None)
    assert states.queue_state(None, 5.0) == (None, None, None)  # Kueue makes it in a second
    active, message, _ = states.queue_state(None, 300.0)
    assert active is None and "is Kueue installed" in message


PREEMPTED = ("Preempted to accommodate a workload (UID: 5f0c, JobUID: 77ab) due to "
             "prioritization in the ClusterQueue")


FLAVORS = "couldn't assign flavors to pod set main: insufficient unused quota"
DEACTIVATED = "The workload is deactivated"


@pytest.mark.parametrize(("active", "evicted", "reserved", "concluded"), [
    # preempted: Evicted says why, and QuotaReserved=False repeats it
    (True, ("True", "Preempted", PREEMPTED), ("False", PREEMPTED), (PREEMPTED, PREEMPTED)),
    # still evicted, the scheduler has looked again with its own words
    (True, ("True", "Preempted", PREEMPTED), ("False", FLAVORS), (FLAVORS, PREEMPTED)),
    # admitted again: the eviction is history
    (True, ("False", "QuotaReserved", f"Previously: {PREEMPTED}"), ("True", "Quota reserved"),
     (None, None)),
    # runPolicy.suspend (spec.active false): the job's own doing, not an eviction to report
    (False, ("True", "Deactivated", DEACTIVATED), ("False", DEACTIVATED), (DEACTIVATED, None)),
    # resumed: Kueue repeats the suspension's words until its scheduler looks again
    (True, ("True", "Deactivated", DEACTIVATED), ("False", DEACTIVATED), (None, None)),
], ids=["preempted", "preempted-waiting", "readmitted", "suspended", "resumed"])
def test_kueues_eviction_is_told_apart_from_why_it_waits(active, evicted, reserved, concluded):
    """Kueue v0.17's conditions as it writes them (pkg/workload): an eviction sets Evicted
    with its reason, and QuotaReserved=False repeats it until the scheduler looks again with
    its own words (#49: the Preempted event quoted a flavor message from before)."""
    conditions = [{"type": "Evicted", "status": evicted[0], "reason": evicted[1],
                   "message": evicted[2]},
                  {"type": "QuotaReserved", "status": reserved[0], "reason": "Pending",
                   "message": reserved[1]}]
    workload = {"spec": {"active": active}, "status": {"conditions": conditions}}
    assert states.queue_state(workload, 500.0) == (active, *concluded)


def test_a_queued_jobs_workload_is_read_seldom_once_kueue_has_had_its_minute():
    """#23's steady state: 1,000 queued jobs must not cost a Workload read per job per look
    (100 requests/s at the default interval); admission arrives through the Job's watch."""
    class CountingKube:
        reads = 0

        async def kueue_workload(self, namespace, uid):
            self.reads += 1
            return {"metadata": {"name": "job-demo-1", "labels": {
                "kueue.x-k8s.io/job-uid": uid}}, "spec": {"active": True}}

    kube = CountingKube()
    k8s = k8s_backend.KubernetesBackend(BackendContext(settings=OperatorSettings(), kube=kube))
    queued = parse_job(minimal_job(kubernetes={"queueName": "team-a"}))
    created = (datetime.now(UTC) - timedelta(minutes=10)).isoformat()
    workload = {"metadata": {"uid": "u1", "creationTimestamp": created}}
    waiting = Observation(exists=True, suspended=True)

    async def looks(job, count):
        return [await k8s._with_queue(job, workload, waiting) for _ in range(count)]

    seen = asyncio.run(looks(queued, 5))
    assert kube.reads == 1 and all(s.queue_active is True and s.polled for s in seen)
    young = {"metadata": {"uid": "u2", "creationTimestamp": datetime.now(UTC).isoformat()}}
    asyncio.run(k8s._with_queue(queued, young, waiting))
    asyncio.run(k8s._with_queue(queued, young, waiting))
    assert kube.reads == 3  # Kueue answers a new Job within its first minutes: each look
    suspend = parse_job(minimal_job(kubernetes={"queueName": "team-a"},
                                    runPolicy={"suspend": True}))
    asyncio.run(looks(suspend, 2))
    assert kube.reads == 5  # to be suspended: the switch's state is read every time


def test_an_earlier_jobs_children_are_not_taken_for_this_ones_before_the_watches_are_up():
    """Read from the API server (the watches not up yet), the children of a deleted job of
    the same name, owned by its uid, are waited out, as the watched path does."""
    class LeftoversKube:
        async def get(self, kind, namespace, name):
            return {"kind": kind, "metadata": {"name": name, "namespace": namespace,
                                               "ownerReferences": [{"controller": True,
                                                                    "uid": "deleted-uid"}]}}

        async def pods(self, namespace, selector):
            return []

        async def events(self, namespace, kind, name, uid):
            return []

    k8s = k8s_backend.KubernetesBackend(BackendContext(settings=OperatorSettings(),
                                                   kube=LeftoversKube()))
    manifest = minimal_job()
    manifest["metadata"]["uid"] = "new-uid"
    seen = asyncio.run(k8s.observe(parse_job(manifest)))
    assert seen.exists and seen.deleting and not seen.failure
    assert seen.waiting.startswith("waiting for the workers of a deleted job of this name to "
                                   "stop and go (Job demo, Service demo, ConfigMap demo-trainer)")
    manifest["metadata"]["uid"] = "deleted-uid"  # its own children: observed as usual
    assert asyncio.run(k8s.observe(parse_job(manifest))).deleting is False


def test_workers_pull_with_the_jobs_secrets_else_the_operators():
    """#51, item 8: a private registry's pull secrets on the worker pods: the job's
    `spec.kubernetes.imagePullSecrets`, else the operator's setting (the chart's
    trainer.imagePullSecrets); an empty list pulls with none."""
    private = OperatorSettings(trainer_pull_secrets=["acr-pull"])
    assert "imagePullSecrets" not in pod(minimal_job())
    assert pod(minimal_job(), private)["imagePullSecrets"] == [{"name": "acr-pull"}]
    own = minimal_job(kubernetes={"imagePullSecrets": ["team-registry"]})
    assert pod(own, private)["imagePullSecrets"] == [{"name": "team-registry"}]
    assert "imagePullSecrets" not in pod(minimal_job(kubernetes={"imagePullSecrets": []}),
                                         private)
    assert OperatorSettings.from_env({"FINETUNE_TRAINER_PULL_SECRETS": '["a", "b"]'}
                                     ).trainer_pull_secrets == ["a", "b"]


def test_the_placeholder_trainer_image_is_a_warning_naming_the_setting(monkeypatch):
    """`finetune render` printed `image: finetune-trainer:0.1.0`, an image no registry
    serves, without a word: the workers would never start (ErrImagePull)."""
    job = parse_job(minimal_job())
    (warning,) = workers.validate(job, SETTINGS)
    assert (warning.path, warning.severity) == ("spec.kubernetes.image", "warning")
    assert warning.message == ("is not set, so the workers run the trainer image of the "
                               "operator's settings, here finetune-trainer:0.1.0: a "
                               "placeholder that no registry serves")
    assert warning.fix == (
        "set FINETUNE_TRAINER_IMAGE to the image you pushed, built from trainer/Dockerfile "
        "(the chart sets it for the operator from trainer.image.repository and "
        "trainer.image.tag), or set spec.kubernetes.image")
    assert workers.validate(job, PUSHED) == []
    own = parse_job(minimal_job(kubernetes={"image": "registry.example/mine:1"}))
    assert workers.validate(own, SETTINGS) == []
    here = parse_job(minimal_job(output={"uri": "./out"}))  # `finetune run`'s: no image
    assert [p.path for p in workers.validate(here, SETTINGS)] == ["spec.output.uri"]
    # without settings, those `finetune render` and the operator read from the environment
    monkeypatch.setenv("FINETUNE_TRAINER_IMAGE", "registry.example/finetune-trainer:1.2.3")
    assert workers.validate(job) == []
    monkeypatch.delenv("FINETUNE_TRAINER_IMAGE")
    assert workers.validate(job) == [warning]


def test_the_operator_acts_on_errors_only_so_the_placeholder_image_is_not_its_word(
        monkeypatch):
    from finetune_operator.admission import admit, offline_backends

    monkeypatch.delenv("FINETUNE_TRAINER_IMAGE", raising=False)
    admission = admit(minimal_job(), offline_backends(SETTINGS))
    assert admission.admitted and admission.errors == []
    assert [p.path for p in admission.problems] == ["spec.kubernetes.image"]
