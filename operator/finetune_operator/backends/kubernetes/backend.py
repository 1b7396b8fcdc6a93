"""The kubernetes backend: torchrun pods on this cluster (AKS GPU node pools or any other).

One FineTuneJob becomes a ConfigMap (the trainer config), a headless Service (stable DNS
for rank 0) and an Indexed Job with one pod per node: the Job controller is the engine,
the completion index is the node rank. `render` is a pure function of the job and the
operator settings; the kopf handlers create what it returns.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import aiohttp

from finetune_operator import naming, yamlio
from finetune_operator.api import API_VERSION, KIND, BackendRef, FineTuneJob, Progress
from finetune_operator.backends import BackendContext, LaunchBlocked
from finetune_operator.backends.children import (
    CONTROLLER_UID_KEY,
    ORPHANED,
    Children,
    foreign,
    owner_uid,
)
from finetune_operator.kube import KUEUE_JOB_UID_LABEL, KubeError, timestamp
from finetune_operator.reconcile import INPUT_REFUSED, Failure, Observation, queued
from finetune_operator.settings import OperatorSettings, Taint
from finetune_operator.trainer_config import build_trainer_config, unreachable_locations
from finetune_operator.validation import Problem
from finetune_trainer import errors
from finetune_trainer.config import TrainerConfig
from finetune_trainer.record import ProgressRecord
from finetune_trainer.uris import SCHEME_EXAMPLES, SECTION_SCHEMES, Location, Unreachable

logger = logging.getLogger("finetune_operator.kubernetes")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
CREATION_GRACE_SECONDS = 3.0
"""How long a Job may lack pods before the operator asks the events why."""
CREATION_EVENTS_SECONDS = 10.0
"""How long one read of a namespace's FailedCreate (or pods' Warning) events serves every
job in it that waits for pods: a burst of a thousand Jobs the Job controller is slow to fill
costs one list per namespace this often, not one per job."""
MOUNT_GRACE_SECONDS = 10.0
"""How long a scheduled pod may be on its way (its volumes mounting) before the operator
asks the kubelet's events why (a ConfigMap or Secret the namespace lacks, a disk attached
to another node): nothing in the pod's status says so."""
JOB_WARNINGS = "involvedObject.kind=Job,reason=FailedCreate"
POD_WARNINGS = "involvedObject.kind=Pod,type=Warning"
COMPLETION_INDEX = f"metadata.annotations['{COMPLETION_INDEX_KEY}']"
QUEUE_LOOK_SECONDS = 120.0
"""How often a queued Job's Kueue Workload is read once the Job is older than that: its
message (why Kueue waits) changes seldom, admission itself arrives through the Job's watch,
and a read every look would cost 1,000 queued jobs 100 requests/s at the default interval."""
DEACTIVATED = "Deactivated"
"""The reason (a prefix: `Deactivated` or `DeactivatedDueTo...`) of Kueue's Evicted condition
when the Workload's `spec.active` is false: a suspension the operator asked for."""
NO_WORKLOAD_GRACE_SECONDS = 30.0
"""How long a queued Job may wait for Kueue to make its Workload before the status asks
whether Kueue is there at all."""
CACHE_DIR = "/tmp/finetune"
WORKER_UID = 1000


def mount(location: Location) -> str:
    """Where the worker pods open a location: a claim's mount path for pvc://, the hub,
    https and paths inside the image as they are."""
    if location.scheme in ("relative", "azureml"):
        others = [SCHEME_EXAMPLES[s] if s != "path" else "an absolute path inside the image"
                  for s in SECTION_SCHEMES[location.section] if s not in ("relative", "azureml")]
        raise Unreachable(f"{location.scheme} locations cannot be reached from pods",
                          f"use {', '.join(others[:-1])} or {others[-1]}")
    return naming.pvc_mount_path(location.uri) if location.scheme == "pvc" else location.raw


def validate(job: FineTuneJob) -> list[Problem]:
    """What this backend cannot run, beyond the API's own rules."""
    return unreachable_locations(job, mount)


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


def progress_from_record(record: dict[str, Any]) -> Progress:
    """Rank 0's /progress JSON (finetune_trainer.record.ProgressRecord) as the status model."""
    return Progress.from_record(ProgressRecord.model_validate(record))


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
        {"name": errors.TERMINATION_LOG_ENV, "value": errors.TERMINATION_LOG},
        # the trainer's finetune_restarts series: which attempt this is
        {"name": "FINETUNE_RESTARTS", "value": str(job.status.restarts if job.status else 0)},
        # the node in every metric's `node` label and the preflight's per-node figures
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    if not resources.gpus_per_node:
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
    if resources.gpus_per_node:
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
    volumes = [
        {"name": "trainer-config",
         "configMap": {"name": naming.trainer_config_map(job.name)}},
        {"name": "dshm", "emptyDir": shm},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        *pvc_volumes, *user_volumes,
    ]
    mounts = [
        {"name": "trainer-config", "mountPath": naming.TRAINER_CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
        *pvc_mounts, *user_mounts,
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
        "terminationMessagePath": errors.TERMINATION_LOG,
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
                           {"FINETUNE_CONFIG", "HF_HOME", errors.TERMINATION_LOG_ENV})


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
        "FINETUNE_CONFIG", "HF_HOME", "XDG_CACHE_HOME", "HF_TOKEN", errors.TERMINATION_LOG_ENV,
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
    if job.spec.resources.gpus_per_node and settings.gpu_taint is not None:
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
    }
    pod_meta: dict[str, Any] = {"labels": {**(k8s.labels if k8s else {}), **labels(job)}}
    if k8s and k8s.annotations:
        pod_meta["annotations"] = dict(k8s.annotations)
    return {"metadata": pod_meta, "spec": pod_spec}


def worker_job(job: FineTuneJob, settings: OperatorSettings) -> dict[str, Any]:
    """The Indexed Job: one pod per node, completion index = node rank. It fails on the first
    pod failure (backoffLimit 0): gang restarts and their budget belong to the operator."""
    nodes = job.spec.resources.nodes
    k8s = job.spec.kubernetes
    queue = {QUEUE_LABEL: k8s.queue_name} if k8s and k8s.queue_name else {}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_meta(job, naming.worker_job(job.name), queue),
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
    return [trainer_config_map(job, config), headless_service(job, settings),
            worker_job(job, settings)]


# --- observation: the Job and its pods → what the reconciler needs ------------------------

TRAINER_CONTAINER = "trainer"
RESUME_CHECK_CONTAINER = "resume-check"
FETCH_MODEL_CONTAINER = "fetch-model"
STOPPED_EXIT_CODE = errors.STOPPED
"""The trainer's exit after SIGTERM, once it has written a checkpoint."""
OTHER_CHECKPOINTS_EXIT_CODE = errors.EXIT_OTHER_CHECKPOINTS
"""finetune-train's refusal: the output folder holds checkpoints trained with other
settings. No restart can help."""
BAD_INPUT_EXIT_CODE = errors.EXIT_BAD_INPUT
"""The trainer's refusal of the model or the data, passed on by the launcher; no restart
can help."""
MODEL_REFUSED = "ModelRefused"
"""The Failed condition's reason when the hub refused the model."""
FETCH_REFUSED_EXIT_CODE = errors.EXIT_BAD_INPUT
"""The fetch-model step's refusal: the hub has no such model or revision, or refuses the
token. No restart can help."""

# Pod conditions and reasons that mean the pod was taken away, not that training failed.
DISRUPTION_REASONS = frozenset({"Evicted", "NodeLost", "Preempting", "Shutdown", "Terminated",
                                "NodeShutdown"})


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions") or []
                 if c.get("type") == type_ and c.get("status") == "True"), None)


def _terminated(pod: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """Which container ended the pod and how: a failed init container, else the first
    container that terminated ((None, {}) when none did)."""
    status = pod.get("status", {})
    for container in status.get("initContainerStatuses") or []:
        state = container.get("state", {}).get("terminated")
        if state and state.get("exitCode"):  # the main containers never ran
            return container.get("name"), state
    for container in status.get("containerStatuses") or []:
        if state := container.get("state", {}).get("terminated"):
            return container.get("name"), state
    return None, {}


def _ended_at(pod: dict[str, Any]) -> str:
    """When the container that ended the pod terminated (RFC 3339, so it sorts as text)."""
    return _terminated(pod)[1].get("finishedAt") or "~"


def _made_by(pod: dict[str, Any], workload: dict[str, Any]) -> bool:
    """The pod belongs to this Job, not to an earlier one of the same name (a gang restart
    recreates the Job; a pod of the old one still seen must not fail the new one)."""
    uid = (pod["metadata"].get("labels") or {}).get(CONTROLLER_UID_KEY)
    return uid is None or uid == workload["metadata"].get("uid")


def pod_failure(pod: dict[str, Any]) -> Failure | None:
    """Why a failed pod failed, classified for the restart budget."""
    status = pod.get("status", {})
    if status.get("phase") != "Failed":
        return None
    name = pod["metadata"]["name"]
    disruption = _condition(pod, "DisruptionTarget")
    if disruption is not None or status.get("reason") in DISRUPTION_REASONS:
        why = (disruption or {}).get("reason") or status.get("reason")
        detail = (disruption or {}).get("message") or status.get("message") or ""
        return Failure("preempted", f"{name} was {why}: {detail}".rstrip(": "))
    container, terminated = _terminated(pod)
    code = terminated.get("exitCode")
    if code == STOPPED_EXIT_CODE:
        return Failure("stopped", f"{name} stopped after SIGTERM (exit {code})")
    reason = terminated.get("reason") or status.get("reason") or "Error"
    tail = (terminated.get("message") or "").strip().splitlines()[-1:] or [""]
    if code == OTHER_CHECKPOINTS_EXIT_CODE:
        return Failure("refused", tail[0].removeprefix("finetune-train: ")[:1000]
                       or f"{name}: the output folder holds checkpoints of other settings")
    if (container, code) == (TRAINER_CONTAINER, BAD_INPUT_EXIT_CODE):
        return Failure("refused", tail[0].removeprefix("finetune-train: ")[:1000]
                       or f"{name}: the trainer refused the model or the data (its log "
                       "says which field)", reason=INPUT_REFUSED)
    if (container, code) == (FETCH_MODEL_CONTAINER, FETCH_REFUSED_EXIT_CODE):
        return Failure("refused", tail[0].removeprefix("finetune-train: ")[:1000]
                       or f"{name}: the hub refused spec.model (its name, revision or token)",
                       reason=MODEL_REFUSED)
    if reason == "OOMKilled":  # the kernel's word, and what to change
        return Failure("worker", f"{name} exited {code} (OOMKilled): its processes needed more "
                       "memory than the container's limit, spec.resources.memory; raise it, "
                       "or lower hyperparameters.batchSizePerDevice or dataset.maxSeqLength")
    detail = f": {tail[0][:300]}" if tail[0] else ""
    return Failure("worker", f"{name} exited {code} ({reason}){detail}")


def final_progress(pods: list[dict[str, Any]]) -> Progress | None:
    """Rank 0's final record, from its succeeded pod's termination message: its trainer has
    gone, so /progress no longer answers, and only this says the last step's figures and
    why the run stopped early. None where the message is no record (another version's)."""
    rank0 = next((p for p in pods
                  if p["metadata"].get("annotations", {}).get(COMPLETION_INDEX_KEY) == "0"
                  and p.get("status", {}).get("phase") == "Succeeded"), None)
    if rank0 is None:
        return None
    container, terminated = _terminated(rank0)
    if container != TRAINER_CONTAINER or not terminated.get("message"):
        return None
    try:
        return Progress.from_record(ProgressRecord.model_validate_json(terminated["message"]))
    except ValueError:
        return None


_STARTING = (None, "ContainerCreating", "PodInitializing")
"""Waiting reasons of a container on its way: no cause for a user to act on."""


def pod_waiting(pod: dict[str, Any]) -> str | None:
    """Why a pod is not running yet, in its own words. The init containers come first: while
    one waits (an image it cannot pull, a Secret it cannot read), the kubelet says only
    PodInitializing of the trainer."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    scheduled = next((c for c in status.get("conditions") or []
                      if c.get("type") == "PodScheduled"), None)
    if scheduled and scheduled.get("status") == "False":
        return f"{name}: {scheduled.get('reason', 'Unschedulable')}: {scheduled.get('message', '')}"
    for container in status.get("initContainerStatuses") or []:
        state = container.get("state") or {}
        if container.get("name") == FETCH_MODEL_CONTAINER and "running" in state:
            # a first start of a large model: the startup deadline covers this download
            return f"{name}: fetching the model into the output volume ({FETCH_MODEL_CONTAINER})"
        if (waiting := state.get("waiting")) and waiting.get("reason") not in _STARTING:
            return f"{name}: {_said(waiting)} (init container {container.get('name')})"
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") not in _STARTING:
            return f"{name}: {_said(waiting)}"
    return None


def _said(waiting: dict[str, Any]) -> str:
    return f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")


_UNPULLABLE = re.compile(
    r"^[^:]+: (ErrImagePull|ImagePullBackOff|InvalidImageName|ErrImageNeverPull):")
_MISSING_CLAIM = re.compile(r'persistentvolumeclaim "([^"]+)" not found')
_MISSING_OBJECT = re.compile(r'(secret|configmap)s? "([^"]+)" not found')
_MISSING_KEY = re.compile(r"couldn't find key (\S+) in (Secret|ConfigMap) [^/\s]+/([^\s:]+)")
_NO_PRIORITY_CLASS = re.compile(r"no PriorityClass with name (\S+) was found")
_NO_NODE_MATCHES = "didn't match Pod's node affinity/selector"
_INSUFFICIENT = re.compile(r"Insufficient ([\w./-]+)")


def named_by_field(job: FineTuneJob, waiting: str | None) -> str | None:
    """`waiting` with the spec field behind it, where the pods wait for an image they cannot
    pull, or a claim, a Secret or a Secret's key the namespace lacks: the scheduler's and the
    kubelet's words ('persistentvolumeclaim "x" not found', 'secret "x" not found') name
    neither the field nor the fix. The pods wait on: one made after the job is a normal
    order."""
    if waiting is None:
        return None
    ns, k8s = job.namespace, job.spec.kubernetes
    if (match := _NO_PRIORITY_CLASS.search(waiting)) and k8s and (
            k8s.priority_class_name == match[1]):
        return (f"{waiting} — spec.kubernetes.priorityClassName names it: create the "
                "PriorityClass (cluster-wide, an admin's: kubectl get priorityclasses lists "
                "those there are) or name one that exists")
    if _NO_NODE_MATCHES in waiting and k8s and k8s.node_selector:
        labels = ", ".join(f"{k}={v}" for k, v in k8s.node_selector.items())
        if short := _INSUFFICIENT.findall(waiting):
            # the scheduler checks resources only on nodes the selector let through: those
            # match, and are full (on a cluster of several pools, some node always differs)
            lacking = ", ".join(dict.fromkeys(r.rstrip(".") for r in short))
            return (f"{waiting} — the nodes spec.kubernetes.nodeSelector ({labels}) matches "
                    f"have no free {lacking} now: the workers start when some frees up (or "
                    "when the node pool scales up)")
        return (f"{waiting} — spec.kubernetes.nodeSelector ({labels}) is what those nodes "
                f"lack: check it against their labels (kubectl get nodes -L "
                f"{','.join(k8s.node_selector)})")
    if match := _UNPULLABLE.search(waiting):
        if match[1] == "ErrImageNeverPull":  # imagePullPolicy Never: only what nodes hold
            where = ("spec.kubernetes.image names it" if k8s and k8s.image else
                     "it is the operator's trainer image (Helm value trainer.image)")
            return (f"{waiting} — {where}, and spec.kubernetes.imagePullPolicy Never lets "
                    "the kubelet use only images already on the node: load it there, or name "
                    "one the nodes hold")
        if job.spec.kubernetes is not None and job.spec.kubernetes.image:
            return (f"{waiting} — spec.kubernetes.image names the image: check its name and "
                    "tag, and that the nodes may pull from its registry (on AKS: az aks "
                    "update --attach-acr)")
        return (f"{waiting} — the operator's trainer image (Helm value trainer.image): set "
                "spec.kubernetes.image to one the nodes can pull, or fix the chart's value")
    if match := _MISSING_CLAIM.search(waiting):
        fields = _claim_fields(job, match[1])
        lacking = f"namespace {ns} has no PersistentVolumeClaim {match[1]!r}"
        fix = ("create the claim (the workers start once it is bound) or name one that "
               f"exists (kubectl get pvc -n {ns})")
    elif match := _MISSING_OBJECT.search(waiting):
        kind = "Secret" if match[1] == "secret" else "ConfigMap"
        refs = _object_refs(job, kind, match[2])
        fields = [field for field, _ in refs]
        sources = " ".join(f"--from-literal={key}=..." if key else "--from-file=..."
                           for key in dict.fromkeys(key for _, key in refs))
        make = "secret generic" if kind == "Secret" else "configmap"
        lacking = f"namespace {ns} has no {kind} {match[2]!r}"
        fix = (f"create it (kubectl create {make} {match[2]} -n {ns} {sources}) or name one "
               f"that exists (kubectl get {kind.lower()}s -n {ns})")
    elif match := _MISSING_KEY.search(waiting):
        fields = [field for field, key in _object_refs(job, match[2], match[3])
                  if key == match[1]]
        lacking = f"{match[2]} {match[3]!r} has no key {match[1]!r}"
        fix = (f"add the key to the {match[2]} or name a key it has (kubectl describe "
               f"{match[2].lower()} {match[3]} -n {ns})")
    else:
        return waiting
    if not fields:
        return waiting  # not one the job names (the pods' own service account's, say)
    pod = waiting.split(":", 1)[0]  # pod_waiting's words start with the pod's name
    verb = "names" if len(fields) == 1 else "name"
    return f"{pod}: {lacking}, which {' and '.join(fields)} {verb} — {fix}"


def _claim_fields(job: FineTuneJob, claim: str) -> list[str]:
    fields = [f"{location.field} ({location.raw})" for location in job.spec.locations
              if location.scheme == "pvc" and location.uri.pvc_claim == claim]
    volumes = job.spec.kubernetes.volumes if job.spec.kubernetes else []
    return fields + [f"spec.kubernetes.volumes[{index}] ({volume.name})"
                     for index, volume in enumerate(volumes)
                     if volume.persistent_volume_claim is not None
                     and volume.persistent_volume_claim.claim_name == claim]


def _object_refs(job: FineTuneJob, kind: str, name: str) -> list[tuple[str, str | None]]:
    """(field, key) of each reference to the Secret or ConfigMap `name`: the hub token and
    the user's env name a key, the user's volumes the whole object (None)."""
    refs: list[tuple[str, str | None]] = []
    token = job.spec.model.token_secret_ref
    if kind == "Secret" and token is not None and token.name == name:
        refs.append(("spec.model.tokenSecretRef", token.key))
    k8s = job.spec.kubernetes
    for index, variable in enumerate(k8s.env if k8s else []):
        source = variable.value_from
        ref = source and (source.secret_key_ref if kind == "Secret"
                          else source.config_map_key_ref)
        if ref is not None and ref.name == name:
            refs.append((f"spec.kubernetes.env[{index}] ({variable.name})", ref.key))
    for index, volume in enumerate(k8s.volumes if k8s else []):
        if (kind == "Secret" and volume.secret is not None
                and volume.secret.secret_name == name) or (
                kind == "ConfigMap" and volume.config_map is not None
                and volume.config_map.name == name):
            refs.append((f"spec.kubernetes.volumes[{index}] ({volume.name})", None))
    return refs


def job_failure(failed: dict[str, Any]) -> Failure:
    """Why the Job failed, when its pods no longer say: the rule of its pod failure policy
    that matched (the Job controller names it in the message), else a worker failure."""
    reason, message = failed.get("reason", ""), failed.get("message", "")
    text = f"{reason}: {message}".rstrip(": ")
    if reason == "PodFailurePolicy" and "DisruptionTarget" in message:
        return Failure("preempted", text)
    if reason == "PodFailurePolicy" and f"exit code {STOPPED_EXIT_CODE}" in message:
        return Failure("stopped", text)
    if reason == "PodFailurePolicy" and f"exit code {OTHER_CHECKPOINTS_EXIT_CODE}" in message:
        return Failure("refused", f"{text}: the output folder holds checkpoints trained with "
                       "other settings — set spec.output.uri to a new folder")
    if reason == "PodFailurePolicy" and (
            f"Container {TRAINER_CONTAINER} " in message
            and f"exit code {BAD_INPUT_EXIT_CODE}" in message):
        return Failure("refused", f"{text}: the trainer refused the model or the data — "
                       "its log names the field", reason=INPUT_REFUSED)
    if reason == "PodFailurePolicy" and f"Container {FETCH_MODEL_CONTAINER} " in message:
        return Failure("refused", f"{text}: the hub refused spec.model (no such model or "
                       "revision, or a token it does not accept) — the fetch-model "
                       "container's log names the field", reason=MODEL_REFUSED)
    return Failure("worker", text)


def output_claim_problem(job: FineTuneJob, claim: dict[str, Any] | None) -> str | None:
    """Every rank of a multi-node job writes its shard of each checkpoint into the output
    claim: a claim that is not ReadWriteMany attaches to one node, and the other nodes'
    pods wait for it forever. The message says which claim and what to use instead."""
    if claim is None:
        return None
    modes = (claim.get("spec") or {}).get("accessModes") or []
    if "ReadWriteMany" in modes:
        return None
    name = claim["metadata"]["name"]
    return (f"spec.output.uri: claim {name!r} is {' / '.join(modes) or 'of no access mode'}, "
            f"but the {job.spec.resources.nodes} nodes' ranks all write checkpoints into it — "
            "use a ReadWriteMany claim (on AKS: the azurefile-csi or azurefile-csi-premium "
            "storage class, or Blob CSI); checked again when the job changes, else every 5 "
            "minutes")


def creation_failure(events: list[dict[str, Any]]) -> str | None:
    """The Job controller's newest `FailedCreate` event: why it could not create the pods
    (a missing PriorityClass, a quota, a policy), which no pod can say, as none exists."""
    failed = [e for e in events if e.get("reason") == "FailedCreate"]
    if not failed:
        return None
    newest = max(failed, key=_event_time)
    return f"FailedCreate: {newest.get('message') or newest.get('note') or ''}".rstrip(": ")


def _event_time(event: dict[str, Any]) -> str:
    """When an event last happened (core/v1 events, events.k8s.io ones, else its making)."""
    return (event.get("lastTimestamp") or event.get("eventTime")
            or event["metadata"].get("creationTimestamp") or "")


def mounting(pod: dict[str, Any]) -> bool:
    """On a node, and none of its containers started nor waiting for a reason of its own:
    the kubelet is still setting up its volumes (kubectl: ContainerCreating)."""
    status = pod.get("status") or {}
    if status.get("phase") != "Pending" or not (pod.get("spec") or {}).get("nodeName"):
        return False
    states = [c.get("state") or {} for c in (status.get("initContainerStatuses") or [])
              + (status.get("containerStatuses") or [])]
    return not any("running" in s or "terminated" in s for s in states) and \
        pod_waiting(pod) is None


MOUNT_REASONS = ("FailedMount", "FailedAttachVolume")
"""The kubelet's and the attach controller's events for a volume a pod cannot have."""


def mount_failure(pod: dict[str, Any], events: list[dict[str, Any]]) -> str | None:
    """Why `pod` cannot mount its volumes, from the newest of its FailedMount /
    FailedAttachVolume events; the kubelet's 'Unable to attach or mount volumes ... timed
    out' comes after the specific one and says less, so it counts only alone."""
    mine = [e for e in events if e.get("reason") in MOUNT_REASONS]
    if not mine:
        return None
    specific = [e for e in mine if not (e.get("message") or "").startswith("Unable to attach")]
    newest = max(specific or mine, key=_event_time)
    return f"{pod['metadata']['name']}: {newest['reason']}: {newest.get('message') or ''}"


def needs_creation_events(workload: dict[str, Any] | None, pods: list[dict[str, Any]],
                          nodes: int) -> bool:
    """Pods are missing from a Job that should have them: worth asking the events why."""
    if workload is None or workload["metadata"].get("deletionTimestamp"):
        return False
    if workload.get("spec", {}).get("suspend") or _condition(workload, "Complete"):
        return False
    return sum(not p["metadata"].get("deletionTimestamp") for p in pods) < nodes


def observe(workload: dict[str, Any] | None, pods: list[dict[str, Any]], nodes: int,
            progress: Progress | None = None, not_created: str | None = None,
            not_mounted: str | None = None) -> Observation:
    """What the reconciler needs from the Job and its pods (pure: the caller fetches them).
    `not_created`: why the Job controller could not create pods (`creation_failure`);
    `not_mounted`: why a pod's volumes do not mount (`mount_failure`). The Job is the job's
    `status.backendRef`: what `kubectl describe` and `finetune status` point a user to."""
    if workload is None:
        return Observation()
    seen = _observe_job(workload, pods, nodes, progress, not_created, not_mounted)
    return replace(seen, backend_ref=BackendRef(kind="Job", name=workload["metadata"]["name"]))


def _observe_job(workload: dict[str, Any], pods: list[dict[str, Any]], nodes: int,
                 progress: Progress | None, not_created: str | None,
                 not_mounted: str | None) -> Observation:
    if workload["metadata"].get("deletionTimestamp"):
        return Observation(exists=True, deleting=True)
    pods = [p for p in pods if _made_by(p, workload)]  # not a previous gang's leftovers
    current = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    seen = [(f, _ended_at(p)) for p in current if (f := pod_failure(p)) is not None]
    # an evicted pod fails and goes: seen while it goes, it says it was preempted (other
    # pods being deleted were stopped by the Job controller, on suspend or a restart)
    seen += [(f, _ended_at(p)) for p in pods if p not in current
             if (f := pod_failure(p)) is not None and f.kind == "preempted"]
    # a worker failure outranks a preemption seen at the same time: it must be counted; of
    # two failed workers the first to end is the cause (the other lost its peer)
    seen.sort(key=lambda pair: ({"refused": 0, "worker": 1, "preempted": 2,
                                 "stopped": 3}[pair[0].kind], pair[1]))
    failures = [f for f, _ in seen]
    # The Job controller (1.31+) says its verdict at once (SuccessCriteriaMet, FailureTarget)
    # and its final word (Complete, Failed) only once every pod has terminated: the verdict
    # is the answer, else a job that ran past its startup deadline reads as not started.
    if _condition(workload, "Complete") or _condition(workload, "SuccessCriteriaMet"):
        return Observation(exists=True, succeeded=True,
                           progress=final_progress(current) or progress)
    if failures:
        return Observation(exists=True, failure=failures[0], progress=progress)
    if ended := _condition(workload, "Failed") or _condition(workload, "FailureTarget"):
        return Observation(exists=True, failure=job_failure(ended))
    if workload.get("spec", {}).get("suspend"):
        # the pods of a suspended Job go only once their trainers have checkpointed
        return Observation(exists=True, suspended=True, stopping=bool(pods))
    running = sum(p.get("status", {}).get("phase") == "Running" for p in current)
    waiting = next((w for w in map(pod_waiting, current) if w), None) or not_mounted or (
        not_created if len(current) < nodes else None)
    return Observation(exists=True, running=running >= nodes, waiting=waiting,
                       blocked=blocking_reason(waiting), progress=progress)


_REASON = re.compile(r"^(?:[a-z0-9][a-z0-9.-]*: )?([A-Z][A-Za-z]+)(?::|$)")
_SAME_CAUSE = {"ImagePullBackOff": "ErrImagePull", "InvalidImageName": "ErrImagePull"}
"""The kubelet's retries of one pull alternate ErrImagePull and ImagePullBackOff: one cause."""


def blocking_reason(waiting: str | None) -> str | None:
    """The reason word of a wait that lasts until someone acts, from the words this module
    writes (`[pod: ]Reason: message`: pod_waiting, mount_failure, creation_failure); None
    for one on its way (`pod: fetching the model ...`)."""
    match = _REASON.match(waiting or "")
    return _SAME_CAUSE.get(match[1], match[1]) if match else None


def waiting_for_leftovers(job: FineTuneJob, leftovers: list[str]) -> Observation:
    """An earlier job of this name was deleted and this one made before the garbage collector
    took its children (`Kind name` each): they are not this job's, and it waits for them to
    go rather than adopt them or fail on their name."""
    logger.info("%s/%s waits for the children of a deleted job of its name to go: %s",
                job.namespace, job.name, ", ".join(leftovers))
    orphans = [f"{kind.lower()}/{name}" for kind, name, *_ in (
        left.removesuffix(ORPHANED).split(" ") for left in leftovers if left.endswith(ORPHANED))]
    if orphans:
        return Observation(exists=True, deleting=True, waiting=(
            f"children of a deleted job of this name remain ({', '.join(leftovers)}): it was "
            "deleted with --cascade=orphan, so nothing removes them, and they are not this "
            f"job's — delete them (kubectl delete -n {job.namespace} {' '.join(orphans)}); "
            "it launches once they are gone"))
    return Observation(exists=True, deleting=True, waiting=(
        "waiting for the workers of a deleted job of this name to stop and go ("
        f"{', '.join(leftovers)}); it launches once the garbage collector has removed them"))


def queue_state(kueue_workload: dict[str, Any] | None, job_age: float
                ) -> tuple[bool | None, str | None, str | None]:
    """Kueue's word on a queued Job (pure): whether its Workload is active, why it is not
    admitted (the scheduler's message, such as no flavor fitting), and why it was evicted
    (a preemption, a pods-ready timeout) until admitted again, if Kueue says."""
    if kueue_workload is None:
        if job_age > NO_WORKLOAD_GRACE_SECONDS:
            return None, ("Kueue has made no Workload for the Job: is Kueue installed, with "
                          "its batch/job integration enabled?"), None
        return None, None, None
    active = kueue_workload.get("spec", {}).get("active") is not False
    said = {c.get("type"): c for c in kueue_workload.get("status", {}).get("conditions") or []}
    reserved, evicted = said.get("QuotaReserved") or {}, said.get("Evicted") or {}
    waiting = (reserved.get("message") or None) if reserved.get("status") == "False" else None
    if evicted.get("status") != "True":
        return active, waiting, None
    if evicted.get("reason", "").startswith(DEACTIVATED):  # the job's own suspend
        # resumed, Kueue repeats the suspension's words until its scheduler looks again
        return active, None if active and waiting == evicted.get("message") else waiting, None
    return active, waiting, evicted.get("message") or None


# --- the backend: the pure parts above, plus the API calls ------------------------------

class KubernetesBackend:
    """torchrun pods in an Indexed Job on this cluster."""

    name = "kubernetes"
    cleanup_on_delete = False
    """Every child is owned by its FineTuneJob: the garbage collector removes them, and a
    deleted job needs no finalizer (nor this operator running) to go."""

    def __init__(self, context: BackendContext):
        self.settings = context.settings
        self.kube = context.kube  # None offline: then only validate and render are used
        self.progress_port = context.progress_port or context.settings.metrics_port
        self._queue_looks: dict[str, tuple[float, bool | None, str | None, str | None]] = {}
        """Job uid → (when, active, waiting, evicted) of its Kueue Workload's last read."""
        self._events: dict[tuple[str, str], tuple[float, asyncio.Future]] = {}
        """(namespace, field selector) → (when, the read) of those events (`_warnings`)."""
        self.children = Children()
        """The workers as the operator's watches see them; until the controller attaches its
        indexes (and outside the operator), `observe` asks the API server instead."""

    def mount(self, location: Location) -> str:
        return mount(location)

    def validate(self, job: FineTuneJob) -> list[Problem]:
        return validate(job)

    def render(self, job: FineTuneJob) -> list[dict[str, Any]]:
        return render(job, self.settings)

    async def launch(self, job: FineTuneJob) -> None:
        if (unshared := output_claim_problem(job, await self._output_claim(job))) is not None:
            raise LaunchBlocked(unshared, retry_after=300)
        config_map, service, workload = self.render(job)
        # the pods mount the ConfigMap and resolve rank 0 through the Service: both first
        await asyncio.gather(self._create(job, config_map), self._create(job, service))
        await self._create(job, workload)

    async def _create(self, job: FineTuneJob, obj: dict[str, Any]) -> None:
        created = await self.kube.create(obj)
        if not created and obj["kind"] == "ConfigMap":
            await self._refresh_config(job, obj)
        self.children.created(obj)
        logger.info("%s %s %s/%s", "created" if created else "found", obj["kind"],
                    job.namespace, obj["metadata"]["name"])

    async def _refresh_config(self, job: FineTuneJob, config_map: dict[str, Any]) -> None:
        """A relaunch finds the job's ConfigMap from before: the workers get the trainer
        config rendered now (the spec as launched after a restart, the edited one after an
        edit before any worker ran)."""
        name = config_map["metadata"]["name"]
        current = await self.kube.get("ConfigMap", job.namespace, name)
        if current is None or owner_uid(current) != job.metadata.uid or (
                current.get("data") == config_map["data"]):
            return
        await self.kube.patch("ConfigMap", job.namespace, name, {"data": config_map["data"]})
        logger.info("updated ConfigMap %s/%s to the config launched now", job.namespace, name)

    async def _output_claim(self, job: FineTuneJob) -> dict[str, Any] | None:
        """The output's PersistentVolumeClaim of a multi-node job (None otherwise, or when it
        cannot be read: the pods then say what is wrong with it)."""
        uri = job.spec.output.location.uri
        if job.spec.resources.nodes < 2 or uri.scheme != "pvc":
            return None
        try:
            return await self.kube.get("PersistentVolumeClaim", job.namespace, uri.pvc_claim)
        except KubeError as error:
            logger.warning("cannot read claim %s/%s (%s): launching without checking that it "
                           "is ReadWriteMany", job.namespace, uri.pvc_claim, error)
            return None

    async def observe(self, job: FineTuneJob) -> Observation:
        seen = await (self._observe_watched(job) if self.children.ready
                      else self._observe_asking(job))
        return replace(seen, waiting=named_by_field(job, seen.waiting)) if seen.waiting else seen

    async def _observe_asking(self, job: FineTuneJob) -> Observation:
        """The observation read from the API server: until the watches are up, and outside
        the operator."""
        children = (("Job", naming.worker_job(job.name)),
                    ("Service", naming.headless_service(job.name)),
                    ("ConfigMap", naming.trainer_config_map(job.name)))
        workload, *others = await asyncio.gather(
            *(self.kube.get(kind, job.namespace, name) for kind, name in children))
        found = [(kind, obj) for (kind, _), obj in zip(children, (workload, *others),
                                                        strict=True) if obj is not None]
        if leftovers := foreign(found, job.metadata.uid):
            return waiting_for_leftovers(job, leftovers)
        if workload is None:
            return Observation()
        selector = f"{naming.LABEL_JOB}={job.name}"
        pods = [p for p in await self.kube.pods(job.namespace, selector)
                if p["metadata"].get("labels", {}).get(naming.LABEL_JOB) == job.name]
        nodes = job.spec.resources.nodes
        not_created = None
        if needs_creation_events(workload, pods, nodes):
            not_created = creation_failure(await self.kube.events(
                job.namespace, "Job", naming.worker_job(job.name),
                workload["metadata"].get("uid")))
        not_mounted = await self._not_mounted(job.namespace, pods)
        seen = await self._with_queue(job, workload, observe(
            workload, pods, nodes, await self.progress(pods), not_created, not_mounted))
        missing = tuple(f"{kind} {name}" for (kind, name), found
                        in zip(children[1:], others, strict=True) if found is None)
        return replace(seen, missing=missing) if missing and not seen.deleting else seen

    async def _observe_watched(self, job: FineTuneJob) -> Observation:
        """The same observation from the watches: no API call, except the Job controller's
        events while pods are missing (nothing else says why) and rank 0's /progress."""
        children, ns = self.children, job.namespace
        if leftovers := children.foreign(ns, job.name, job.metadata.uid):
            return waiting_for_leftovers(job, leftovers)  # their deletion wakes it
        workload = children.get("Job", ns, job.name, naming.worker_job(job.name))
        if workload is None:
            return Observation()
        pods = children.of("Pod", ns, job.name)
        nodes = job.spec.resources.nodes
        not_created, polled = None, False
        if needs_creation_events(workload, pods, nodes):
            # the Job controller creates pods within a second; later, only its events say why
            # not (a refused PriorityClass, a quota), and no watch event says when to ask
            polled = True
            if self._age(workload) > CREATION_GRACE_SECONDS:
                failed = await self._warnings(ns, JOB_WARNINGS)
                not_created = creation_failure(failed.get(workload["metadata"].get("uid"), []))
        # nor does a watch event say when the kubelet gives up on a pod's volumes
        polled = polled or any(map(mounting, pods))
        not_mounted = await self._not_mounted(ns, pods)
        progress = await self.progress(pods)
        seen = await self._with_queue(job, workload, observe(
            workload, pods, nodes, progress, not_created, not_mounted))
        missing = tuple(f"{kind} {name}" for kind, name in (
            ("Service", naming.headless_service(job.name)),
            ("ConfigMap", naming.trainer_config_map(job.name)))
            if children.get(kind, ns, job.name, name) is None)
        # rank 0's progress is read, never told: look again while it can be read
        polled = polled or seen.polled or (
            (seen.running or progress is not None) and not seen.succeeded)
        seen = replace(seen, polled=polled)
        return replace(seen, missing=missing) if missing and not seen.deleting else seen

    async def _not_mounted(self, namespace: str, pods: list[dict[str, Any]]) -> str | None:
        """Why the first pod on its way for MOUNT_GRACE_SECONDS cannot mount its volumes,
        from its Warning events (one list per namespace, `_warnings`)."""
        late = [p for p in pods if mounting(p) and self._age(p) > MOUNT_GRACE_SECONDS
                and not p["metadata"].get("deletionTimestamp")]
        if not late:
            return None
        warnings = await self._warnings(namespace, POD_WARNINGS)
        return next((why for pod in late if (why := mount_failure(
            pod, warnings.get(pod["metadata"].get("uid"), [])))), None)

    async def _warnings(self, namespace: str, fields: str
                        ) -> dict[str | None, list[dict[str, Any]]]:
        """The events in `namespace` that `fields` selects (the Job controller's
        FailedCreate, the pods' Warnings), by the uid of their object: one list, shared by
        every look within CREATION_EVENTS_SECONDS (and by the looks that ask while it is on
        its way)."""
        now = time.monotonic()
        cached = self._events.get((namespace, fields))
        if cached is None or now - cached[0] > CREATION_EVENTS_SECONDS or (
                cached[1].done() and cached[1].exception() is not None):
            cached = (now, asyncio.ensure_future(self._read_events(namespace, fields)))
            self._events[namespace, fields] = cached
        return await asyncio.shield(cached[1])

    async def _read_events(self, namespace: str, fields: str
                           ) -> dict[str | None, list[dict[str, Any]]]:
        events = await self.kube.list("Event", namespace, fields=fields,
                                      action=f"list the events of {namespace} ({fields})")
        by_uid: dict[str | None, list[dict[str, Any]]] = {}
        for event in events:
            by_uid.setdefault((event.get("involvedObject") or {}).get("uid"), []).append(event)
        return by_uid

    async def _with_queue(self, job: FineTuneJob, workload: dict[str, Any],
                          seen: Observation) -> Observation:
        """Add Kueue's word while it matters: the job waits to be admitted, or is to be
        suspended (one API call; the Workload is not watched)."""
        if not queued(job) or seen.deleting:
            return seen
        uid, now = workload["metadata"]["uid"], time.monotonic()
        if not (seen.suspended or job.spec.run_policy.suspend):
            # admitted: what Kueue said before is old news when it evicts the job
            self._queue_looks.pop(uid, None)
            return seen
        last = self._queue_looks.get(uid)
        if last is None or job.spec.run_policy.suspend or now - last[0] > QUEUE_LOOK_SECONDS \
                or self._age(workload) < QUEUE_LOOK_SECONDS:
            try:
                found = await self.kube.kueue_workload(job.namespace, uid)
            except KubeError as error:  # 403: a chart without the Workload rule
                logger.warning("cannot read the Kueue Workload of %s/%s: %s", job.namespace,
                               job.name, error)
                return seen
            last = (now, *queue_state(found, self._age(workload)))
            self._queue_looks[uid] = last
        # no watch event says when Kueue's answer changes: look again while it is awaited
        return replace(seen, queue_active=last[1], queue_message=last[2], queue_evicted=last[3],
                       polled=seen.polled or not job.spec.run_policy.suspend)

    async def _kueue_workload(self, job: FineTuneJob) -> dict[str, Any] | None:
        if not queued(job):
            return None
        name = naming.worker_job(job.name)
        workload = (self.children.get("Job", job.namespace, job.name, name)
                    if self.children.ready else await self.kube.get("Job", job.namespace, name))
        if workload is None:
            return None
        return await self.kube.kueue_workload(job.namespace, workload["metadata"]["uid"])

    def _forget_queue_look(self, job: FineTuneJob) -> None:
        """The Job goes (a restart, a deletion): its Workload's last read with it."""
        workload = self.children.get("Job", job.namespace, job.name, naming.worker_job(job.name))
        if workload is not None:
            self._queue_looks.pop(workload["metadata"]["uid"], None)

    @staticmethod
    def _age(obj: dict[str, Any]) -> float:
        created = timestamp(obj["metadata"].get("creationTimestamp"))
        return (datetime.now(UTC) - created).total_seconds() if created else 0.0

    async def progress(self, pods: list[dict[str, Any]]) -> Progress | None:
        """Rank 0's latest progress record, or None when it cannot be read right now."""
        rank0 = next((p for p in pods
                      if p["metadata"].get("annotations", {}).get(COMPLETION_INDEX_KEY) == "0"
                      and p.get("status", {}).get("phase") in ("Running", "Succeeded")
                      and p.get("status", {}).get("podIP")), None)
        if rank0 is None:
            return None
        url = f"http://{rank0['status']['podIP']}:{self.progress_port}/progress"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
                async with session.get(url) as response:
                    if response.status != 200:
                        return None
                    # a record that is no ProgressRecord (another version's): ValueError
                    return progress_from_record(await response.json())
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            logger.debug("progress of %s not readable: %s", rank0["metadata"]["name"], error)
            return None

    async def suspend(self, job: FineTuneJob) -> None:
        """A queued job is suspended through Kueue's own switch: Kueue unsuspends an admitted
        Job that anyone else suspends, and only a deactivated Workload frees its quota."""
        await self._switch(job, run=False)

    async def resume(self, job: FineTuneJob) -> None:
        """A queued job goes back into its queue; Kueue unsuspends the Job on admission."""
        await self._switch(job, run=True)

    async def _switch(self, job: FineTuneJob, run: bool) -> None:
        """The Workload's `spec.active` where Kueue has one, else the Job's `suspend`."""
        if (kueue_workload := await self._kueue_workload(job)) is not None:
            await self.kube.activate_kueue_workload(
                job.namespace, kueue_workload["metadata"]["name"], run)
            self._queue_looks.pop(kueue_workload["metadata"]["labels"][KUEUE_JOB_UID_LABEL],
                                  None)
            return
        await self.kube.suspend_job(job.namespace, naming.worker_job(job.name), not run)

    async def restart(self, job: FineTuneJob) -> None:
        # Foreground: the Job stays (deleting) until its pods are gone, so the next gang
        # never meets the old one's hostnames
        self._forget_queue_look(job)
        await self.kube.delete("Job", job.namespace, naming.worker_job(job.name))
        self.children.deleted("Job", job.namespace, job.name, naming.worker_job(job.name))

    def forget(self, namespace: str, name: str) -> None:
        """The FineTuneJob is gone: what the backend remembered of it goes too."""
        workload = self.children.get("Job", namespace, name, naming.worker_job(name)) \
            if self.children.ready else None
        if workload is not None:
            self._queue_looks.pop(workload["metadata"].get("uid"), None)
        self.children.forget(namespace, name)

    async def cancel(self, job: FineTuneJob) -> None:
        """Owner references would collect these too; deleting them now frees the name."""
        self._forget_queue_look(job)
        await self.kube.delete("Job", job.namespace, naming.worker_job(job.name))
        await self.kube.delete("Service", job.namespace, naming.headless_service(job.name),
                               "Background")
        await self.kube.delete("ConfigMap", job.namespace, naming.trainer_config_map(job.name),
                               "Background")
        self.children.forget(job.namespace, job.name)
