"""The kubernetes backend's objects, rendered (pure): the ConfigMap of the trainer config, the
headless Service and the Indexed Job of worker pods, from the job and the operator settings;
the containers and exit codes the Job's pod failure policy names, which `states` reads too.
"""

from __future__ import annotations

import json
from typing import Any

from finetune_operator import naming, yamlio
from finetune_operator.api import API_VERSION, KIND, FineTuneJob
from finetune_operator.backends import KUEUE_QUEUE_LABEL
from finetune_operator.settings import OperatorSettings, Taint
from finetune_operator.trainer_config import build_trainer_config, unreachable_locations
from finetune_operator.validation import PUSH_THE_TRAINER_IMAGE, Problem, placeholder_image
from finetune_trainer import exits
from finetune_trainer.config import TrainerConfig
from finetune_trainer.layout import export_secret_dir
from finetune_trainer.uris import SCHEME_EXAMPLES, SECTION_SCHEMES, Location, Unreachable

PODS_READY_ANNOTATION = "kueue.x-k8s.io/wait-for-pods-ready"
"""Kueue's own waitForPodsReady timeout for one workload (v0.20, alpha behind its
WorkloadLevelWaitForPodsReady gate; earlier versions ignore it): JSON, `timeoutSeconds`."""
PODS_READY_LONGEST = 7200
"""Kueue's default maxTimeoutOnWorkload: its webhook refuses a Job asking for longer."""
PODS_READY_MARGIN = 60
"""Seconds Kueue waits beyond the job's startupDeadlineSeconds: the operator's deadline
(which says the pods' reason and fails the job) acts first, Kueue's only where it is capped."""
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
COMPLETION_INDEX = f"metadata.annotations['{COMPLETION_INDEX_KEY}']"
CACHE_DIR = "/tmp/finetune"
WORKER_UID = 1000
TRAINER_CONTAINER = "trainer"
RESUME_CHECK_CONTAINER = "resume-check"
FETCH_MODEL_CONTAINER = "fetch-model"
STOPPED_EXIT_CODE = exits.STOPPED
"""The trainer's exit after SIGTERM, once it has written a checkpoint."""
OTHER_CHECKPOINTS_EXIT_CODE = exits.EXIT_OTHER_CHECKPOINTS
"""finetune-train's refusal: the output folder holds checkpoints trained with other
settings. No restart can help."""
BAD_INPUT_EXIT_CODE = exits.EXIT_BAD_INPUT
"""The trainer's refusal of the model or the data, passed on by the launcher; no restart
can help."""
SETUP_EXIT_CODE = exits.EXIT_SETUP
"""The trainer could not set itself up in the image (an import, an op that cannot be built):
the gang is restarted once at most (reconcile), as every attempt would fail the same way."""
FETCH_REFUSED_EXIT_CODE = exits.EXIT_BAD_INPUT
"""The fetch-model step's refusal: the hub has no such model or revision, or refuses the
token. No restart can help."""


def mount(location: Location) -> str:
    """Where the worker pods open a location: a claim's mount path for pvc://, the hub,
    https and paths inside the image as they are."""
    if location.scheme in ("relative", "azureml"):
        others = [SCHEME_EXAMPLES[s] if s != "path" else "an absolute path inside the image"
                  for s in SECTION_SCHEMES[location.section] if s not in ("relative", "azureml")]
        raise Unreachable(f"{location.scheme} locations cannot be reached from pods",
                          f"use {', '.join(others[:-1])} or {others[-1]}")
    return naming.pvc_mount_path(location.uri) if location.scheme == "pvc" else location.raw


def validate(job: FineTuneJob, settings: OperatorSettings | None = None) -> list[Problem]:
    """What this backend cannot run, beyond the API's own rules, and a warning where the
    workers' image would be the placeholder default. `settings`: the operator's (None:
    from the environment, where `finetune render` and the operator read them)."""
    k8s = job.spec.kubernetes
    image = None if k8s and k8s.image else placeholder_image(job, settings)
    registrations = [Problem(
        f"spec.output.export[{index}].uri", "registers a model in an Azure ML workspace, "
        "which only the azureml backend has", "push it to oci:// or hf://, or run the job "
        "with backend: azureml") for index, target in enumerate(job.spec.output.export)
        if not target.pushed_by_trainer]
    return unreachable_locations(job, mount) + registrations + ([] if image is None else [Problem(
        "spec.kubernetes.image", "is not set, so the workers run the trainer image of the "
        f"operator's settings, here {image}: a placeholder that no registry serves",
        f"{PUSH_THE_TRAINER_IMAGE}, or set spec.kubernetes.image", "warning",
        cluster_only=True)])


# --- metadata ----------------------------------------------------------------------------

def labels(job: FineTuneJob) -> dict[str, str]:
    return {naming.LABEL_JOB: job.name, naming.LABEL_MANAGED_BY: naming.MANAGER}


def owner_references(job: FineTuneJob) -> list[dict[str, Any]]:
    """Children are garbage-collected with their FineTuneJob (when its uid is known)."""
    if not job.metadata.uid:
        return []
    return [{"apiVersion": API_VERSION, "kind": KIND, "name": job.name,
             "uid": job.metadata.uid, "controller": True, "blockOwnerDeletion": True}]


def object_meta(job: FineTuneJob, name: str, extra_labels: dict[str, str] | None = None
                ) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": job.namespace,
                            "labels": {**labels(job), **(extra_labels or {})}}
    if owner := owner_references(job):
        meta["ownerReferences"] = owner
    return meta


# --- the three objects -------------------------------------------------------------------

def trainer_config_map(job: FineTuneJob, config: TrainerConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(job, naming.trainer_config_map(job.name)),
        "data": {naming.TRAINER_CONFIG_KEY: yamlio.dump(config.to_dict(), fast=True)},
    }


def headless_service(job: FineTuneJob, settings: OperatorSettings) -> dict[str, Any]:
    """Stable DNS for every worker (`<job>-<index>.<service>`), ready or not: rank 0 must be
    resolvable while its peers are still starting."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, naming.headless_service(job.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(job),
            "ports": [{"name": "rendezvous", "port": settings.rendezvous_port},
                      {"name": "metrics", "port": settings.metrics_port}],
        },
    }


def rank0_address(job: FineTuneJob) -> str:
    return (f"{naming.worker_hostname(job.name, 0)}.{naming.headless_service(job.name)}."
            f"{job.namespace}.svc")


def _toleration(taint: Taint) -> dict[str, Any]:
    toleration: dict[str, Any] = {"key": taint.key, "effect": taint.effect}
    if taint.value is None:
        toleration["operator"] = "Exists"
    else:
        toleration.update(operator="Equal", value=taint.value)
    return toleration

def _metrics_ports(processes: int, first: int) -> list[dict[str, Any]]:
    """Local rank k serves /metrics on first + k: ports `metrics`, `metrics-1`, ... so the
    chart's PodMonitor finds every rank of a node (it lists metrics-1 to metrics-7)."""
    return [{"name": "metrics" if k == 0 else f"metrics-{k}", "containerPort": first + k}
            for k in range(max(processes, 1))]


def shutdown_timeout(settings: OperatorSettings) -> int:
    """Seconds torchrun gives its workers after SIGTERM before it kills them: what is left
    of the pod's termination grace period once they have (the kubelet's SIGKILL ends the
    launcher itself)."""
    return max(settings.termination_grace_seconds - SHUTDOWN_MARGIN_SECONDS, 1)


SHUTDOWN_MARGIN_SECONDS = 15


def _env(job: FineTuneJob, settings: OperatorSettings) -> list[dict[str, Any]]:
    spec = job.spec
    resources = spec.resources
    env: list[dict[str, Any]] = [
        # torchrun reads PET_<FLAG> as its flags' defaults: the names Kubeflow users know
        {"name": "PET_NNODES", "value": str(resources.nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(resources.processes())},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
        {"name": "PET_MASTER_ADDR", "value": rank0_address(job)},
        {"name": "PET_MASTER_PORT", "value": str(settings.rendezvous_port)},
        {"name": "FINETUNE_CONFIG",
         "value": f"{naming.TRAINER_CONFIG_MOUNT}/{naming.TRAINER_CONFIG_KEY}"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        # the root filesystem is read-only: every cache goes to the writable scratch volume
        {"name": "XDG_CACHE_HOME", "value": f"{CACHE_DIR}/cache"},
        {"name": "TORCH_EXTENSIONS_DIR", "value": f"{CACHE_DIR}/torch_extensions"},
        {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
        # after SIGTERM (suspension, preemption, a drain) the workers finish their step and
        # checkpoint; torchrun kills them after 30 s unless told to wait (the pod's grace
        # period, less the launcher's own exit)
        {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(shutdown_timeout(settings))},
        {"name": "NCCL_DEBUG", "value": "WARN"},
        # where the kubelet reads how the container ended: a failure's reason, a finished
        # run's final record (terminationMessagePath, below)
        {"name": exits.TERMINATION_LOG_ENV, "value": exits.TERMINATION_LOG},
        # the trainer's finetune_restarts series: which attempt this is
        {"name": "FINETUNE_RESTARTS", "value": str(job.status.restarts if job.status else 0)},
        # the node in every metric's `node` label and the preflight's per-node figures
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    if not resources.on_gpus:
        # CPU workers: a GPU node's devices can be visible without a limit (an NVIDIA image's
        # NVIDIA_VISIBLE_DEVICES=all), and the trainer takes any GPU it sees
        env.append({"name": "CUDA_VISIBLE_DEVICES", "value": ""})
    if spec.model.token_secret_ref is not None:
        ref = spec.model.token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": ref.name, "key": ref.key}}})
    if spec.kubernetes and spec.kubernetes.infiniband:
        env += [{"name": "NCCL_IB_DISABLE", "value": "0"},
                {"name": "NCCL_NET_GDR_LEVEL", "value": "PHB"}]
    if spec.kubernetes:
        env += [e.to_dict() for e in spec.kubernetes.env]
    return env


def _pvc_volumes(job: FineTuneJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One volume per claim named in the job's locations; read-only unless it holds the output."""
    claims: dict[str, bool] = {}
    for location in job.spec.locations:
        if location.scheme == "pvc":
            writable = location.section == "output"
            claim = location.uri.pvc_claim
            claims[claim] = claims.get(claim, False) or writable
    volumes, mounts = [], []
    for index, (claim, writable) in enumerate(sorted(claims.items())):
        name = f"pvc-{index}"
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim,
                                                                 "readOnly": not writable}})
        mounts.append({"name": name, "mountPath": f"{naming.PVC_MOUNT_ROOT}/{claim}",
                       "readOnly": not writable})
    return volumes, mounts


def _user_volumes(job: FineTuneJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if job.spec.kubernetes is None:
        return [], []
    volumes, mounts = [], []
    for volume in job.spec.kubernetes.volumes:
        source = volume.to_dict()
        mounts.append({"name": volume.name, "mountPath": source.pop("mountPath"),
                       "readOnly": source.pop("readOnly", False)})
        volumes.append(source)
    return volumes, mounts


def _export_secret_volumes(job: FineTuneJob
                           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each `output.export[].secretName` Secret's keys its targets read (a Docker config, a
    hub token), read-only where the trainer reads them (layout.export_secret_dir)."""
    keys: dict[str, set[str]] = {}
    for target in job.spec.output.export:
        if target.secret_name:
            keys.setdefault(target.secret_name, set()).add(target.secret_key)
    volumes, mounts = [], []
    for index, (name, wanted) in enumerate(sorted(keys.items())):
        volume = f"export-secret-{index}"
        volumes.append({"name": volume, "secret": {
            "secretName": name, "items": [{"key": key, "path": key} for key in sorted(wanted)]}})
        mounts.append({"name": volume, "readOnly": True,
                       "mountPath": str(export_secret_dir(name))})
    return volumes, mounts


def _container_resources(job: FineTuneJob, settings: OperatorSettings
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trainer container's requests / limits (GPUs, RDMA), and its capabilities."""
    resources, k8s = job.spec.resources, job.spec.kubernetes
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if resources.cpu is not None:
        requests["cpu"] = resources.cpu
    if resources.memory is not None:
        requests["memory"] = limits["memory"] = resources.memory
    if resources.on_gpus:
        limits[settings.gpu_resource] = str(resources.gpus_per_node)
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if k8s and k8s.infiniband:
        limits[settings.infiniband_resource] = "1"
        capabilities["add"] = ["IPC_LOCK"]  # RDMA pins memory
    return ({k: v for k, v in (("requests", requests), ("limits", limits)) if v},
            capabilities)


def _worker_volumes(job: FineTuneJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trainer config, /dev/shm in memory, a writable /tmp (the root filesystem is
    read-only: Python's tempfile, which torch uses, finds no usable folder otherwise) holding
    the scratch folder of caches, the claims the locations name and the user's own volumes;
    and where each is mounted."""
    k8s = job.spec.kubernetes
    shm: dict[str, Any] = {"medium": "Memory"}
    if k8s and k8s.shm_size is not None:
        shm["sizeLimit"] = k8s.shm_size
    pvc_volumes, pvc_mounts = _pvc_volumes(job)
    user_volumes, user_mounts = _user_volumes(job)
    secret_volumes, secret_mounts = _export_secret_volumes(job)
    volumes = [
        {"name": "trainer-config",
         "configMap": {"name": naming.trainer_config_map(job.name)}},
        {"name": "dshm", "emptyDir": shm},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        *pvc_volumes, *secret_volumes, *user_volumes,
    ]
    mounts = [
        {"name": "trainer-config", "mountPath": naming.TRAINER_CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
        *pvc_mounts, *secret_mounts, *user_mounts,
    ]
    return volumes, mounts


def _trainer_container(job: FineTuneJob, settings: OperatorSettings,
                       mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """torchrun with the PET_* flags Kubeflow users know, non-root, read-only root; through
    finetune_trainer.launch, so the pod ends with the workers' own exit code where it names
    the cause (bad input, other settings' checkpoints; 143 after SIGTERM) and the termination
    message says which rank failed and why: torchrun says exit 1 for all of them."""
    k8s = job.spec.kubernetes
    resources, capabilities = _container_resources(job, settings)
    container: dict[str, Any] = {
        "name": TRAINER_CONTAINER,
        "image": (k8s.image if k8s and k8s.image else settings.trainer_image),
        "command": ["python", "-m", "finetune_trainer.launch"],
        "args": ["--nnodes=$(PET_NNODES)", "--nproc-per-node=$(PET_NPROC_PER_NODE)",
                 "--node-rank=$(PET_NODE_RANK)", "--master-addr=$(PET_MASTER_ADDR)",
                 "--master-port=$(PET_MASTER_PORT)", "-m", "finetune_trainer",
                 "--config=$(FINETUNE_CONFIG)"],
        "env": _env(job, settings),
        "ports": [{"name": "rendezvous", "containerPort": settings.rendezvous_port},
                  *_metrics_ports(job.spec.resources.processes(), settings.metrics_port)],
        "resources": resources,
        # a failed worker's last log lines land in its status, and so in our message
        "terminationMessagePath": exits.TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": capabilities,
        },
    }
    if k8s and k8s.image_pull_policy:
        container["imagePullPolicy"] = k8s.image_pull_policy
    return container


def _step_container(trainer: dict[str, Any], name: str, flag: str,
                    env: set[str]) -> dict[str, Any]:
    """An init container running one step of the trainer's entry point (`flag`) in the
    trainer's image, mounts and security context, with only the `env` it needs."""
    return {
        **{k: v for k, v in trainer.items() if k in (
            "image", "imagePullPolicy", "volumeMounts", "securityContext",
            "terminationMessagePath", "terminationMessagePolicy")},
        "name": name,
        "command": ["python", "-m", "finetune_trainer", flag, "--config=$(FINETUNE_CONFIG)"],
        "env": [e for e in trainer["env"] if e["name"] in env],
    }


def _resume_check_container(trainer: dict[str, Any]) -> dict[str, Any]:
    """Runs before torchrun (which reports any worker's failure as its own exit 1): a job
    changed after its first run must not resume from the old settings' checkpoints."""
    return _step_container(trainer, RESUME_CHECK_CONTAINER, "--check-resume",
                           {"FINETUNE_CONFIG", "HF_HOME", exits.TERMINATION_LOG_ENV})


def _fetches_model(job: FineTuneJob) -> bool:
    """hf:// models are fetched into the output volume by an init container."""
    return job.spec.model.location.scheme == "hf"


def _fetch_model_container(job: FineTuneJob, trainer: dict[str, Any]) -> dict[str, Any] | None:
    """For an hf:// model: download it once into the output volume (`model-cache/`), where
    every node and every restart reads it; a complete copy is reused without any request
    (finetune_trainer.fetch). Other locations are read where they are: None. It runs after
    resume-check, so a job refused for other settings downloads nothing."""
    if not _fetches_model(job):
        return None
    k8s = job.spec.kubernetes
    # the hub token, the caches on the scratch volume, and the user's own (HF_ENDPOINT,
    # proxies); none of torchrun's
    return _step_container(trainer, FETCH_MODEL_CONTAINER, "--fetch-model", {
        "FINETUNE_CONFIG", "HF_HOME", "XDG_CACHE_HOME", "HF_TOKEN", exits.TERMINATION_LOG_ENV,
        *(e.name for e in (k8s.env if k8s else []))})


def _fetch_refused_rule(job: FineTuneJob) -> list[dict[str, Any]]:
    """The hub's refusal ends the Job at once (a restart would only ask again); a rule may
    name only a container the pods have."""
    if not _fetches_model(job):
        return []
    return [{"action": "FailJob", "onExitCodes": {
        "containerName": FETCH_MODEL_CONTAINER, "operator": "In",
        "values": [FETCH_REFUSED_EXIT_CODE]}}]


def _init_containers(job: FineTuneJob, trainer: dict[str, Any]) -> list[dict[str, Any]]:
    return [container for container in (_resume_check_container(trainer),
                                        _fetch_model_container(job, trainer))
            if container is not None]


def _placement(job: FineTuneJob, settings: OperatorSettings) -> dict[str, Any]:
    """Where the pods may run: the GPU taint tolerated, spot nodes only on `spot`, the
    user's selector, tolerations, priority class and service account."""
    k8s = job.spec.kubernetes
    placement: dict[str, Any] = {}
    tolerations = []
    if job.spec.resources.on_gpus and settings.gpu_taint is not None:
        tolerations.append(_toleration(settings.gpu_taint))
    if k8s:
        if k8s.spot:
            tolerations.append(_toleration(settings.spot_taint))
            placement["affinity"] = {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
                    "matchExpressions": [{"key": settings.spot_node_label, "operator": "In",
                                          "values": [settings.spot_taint.value or "spot"]}]}]}}}
        tolerations += [t.to_dict() for t in k8s.tolerations]
        if k8s.node_selector:
            placement["nodeSelector"] = dict(k8s.node_selector)
        if k8s.priority_class_name:
            placement["priorityClassName"] = k8s.priority_class_name
        if k8s.service_account_name:
            placement["serviceAccountName"] = k8s.service_account_name
    if tolerations:
        placement["tolerations"] = tolerations
    return placement


def _pull_secrets(job: FineTuneJob, settings: OperatorSettings) -> dict[str, Any]:
    """The Secrets the kubelet pulls the trainer image with: the job's, else the operator's."""
    k8s = job.spec.kubernetes
    names = (k8s.image_pull_secrets if k8s and k8s.image_pull_secrets is not None
             else settings.trainer_pull_secrets)
    return {"imagePullSecrets": [{"name": name} for name in names]} if names else {}


def worker_pod_template(job: FineTuneJob, settings: OperatorSettings) -> dict[str, Any]:
    k8s = job.spec.kubernetes
    volumes, mounts = _worker_volumes(job)
    trainer = _trainer_container(job, settings, mounts)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a failed worker fails the gang; the operator restarts it
        "subdomain": naming.headless_service(job.name),
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "securityContext": {"runAsNonRoot": True, "runAsUser": WORKER_UID,
                            "runAsGroup": WORKER_UID, "fsGroup": WORKER_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": _init_containers(job, trainer),
        "containers": [trainer],
        "volumes": volumes,
        **_placement(job, settings),
        **_pull_secrets(job, settings),
    }
    pod_meta: dict[str, Any] = {"labels": {**(k8s.labels if k8s else {}), **labels(job)}}
    if k8s and k8s.annotations:
        pod_meta["annotations"] = dict(k8s.annotations)
    return {"metadata": pod_meta, "spec": pod_spec}


def pods_ready_timeout(startup_deadline_seconds: int) -> int:
    """Kueue's waitForPodsReady timeout for a queued job (`PODS_READY_ANNOTATION`): a little
    past its startupDeadlineSeconds (both count from admission), at most what Kueue allows;
    that most for a job without a deadline (0), not Kueue's cluster-wide 30 minutes (on by
    default since v0.19), which evicted slow model downloads."""
    if startup_deadline_seconds == 0:
        return PODS_READY_LONGEST
    return min(startup_deadline_seconds + PODS_READY_MARGIN, PODS_READY_LONGEST)


def worker_job(job: FineTuneJob, settings: OperatorSettings) -> dict[str, Any]:
    """The Indexed Job: one pod per node, completion index = node rank. It fails on the first
    pod failure (backoffLimit 0): gang restarts and their budget belong to the operator."""
    nodes = job.spec.resources.nodes
    k8s = job.spec.kubernetes
    queue = {KUEUE_QUEUE_LABEL: k8s.queue_name} if k8s and k8s.queue_name else {}
    meta = object_meta(job, naming.worker_job(job.name), queue)
    if queue:
        meta["annotations"] = {PODS_READY_ANNOTATION: json.dumps(
            {"timeoutSeconds": pods_ready_timeout(job.spec.run_policy.startup_deadline_seconds)})}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": 0,
            # the Job records why it failed, which outlives the pods: a disrupted pod
            # (eviction, preemption, spot reclaim) is gone soon after, and without this its
            # failure reads like any other, and would be charged to the restart budget
            "podFailurePolicy": {"rules": [
                {"action": "FailJob",
                 "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                # a trainer stopped by SIGTERM on a suspension (ours, or Kueue preempting)
                # exits 143 after its checkpoint: the Job controller applies this policy to
                # those pods too (seen on v1.36), and FailJob would end the suspended Job
                {"action": "Ignore", "onExitCodes": {
                    "containerName": TRAINER_CONTAINER, "operator": "In",
                    "values": [STOPPED_EXIT_CODE]}},
                {"action": "FailJob", "onExitCodes": {
                    "operator": "In", "values": [OTHER_CHECKPOINTS_EXIT_CODE]}},
                # the model or the data cannot be used: the same on every attempt
                {"action": "FailJob", "onExitCodes": {
                    "containerName": TRAINER_CONTAINER, "operator": "In",
                    "values": [BAD_INPUT_EXIT_CODE]}},
                # named in the Job's Failed condition, which outlives the pods
                {"action": "FailJob", "onExitCodes": {
                    "containerName": TRAINER_CONTAINER, "operator": "In",
                    "values": [SETUP_EXIT_CODE]}},
                *_fetch_refused_rule(job),
            ]},
            # Kueue admits a suspended Job by unsuspending it; a suspended FineTuneJob too
            "suspend": bool(queue) or job.spec.run_policy.suspend,
            "template": worker_pod_template(job, settings),
        },
    }


def render(job: FineTuneJob, settings: OperatorSettings) -> list[dict[str, Any]]:
    """Everything this backend creates for `job`, in creation order."""
    config = build_trainer_config(job, mount)
    if job.spec.kubernetes and job.spec.kubernetes.infiniband:  # the NCCL preflight checks it
        config = config.model_copy(update={"preflight": config.preflight.model_copy(
            update={"require_infiniband": True})})
    return [trainer_config_map(job, config), headless_service(job, settings),
            worker_job(job, settings)]
