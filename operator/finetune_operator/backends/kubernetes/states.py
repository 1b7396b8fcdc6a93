"""The kubernetes backend's observation (pure): the Job, its pods, their events and Kueue's
Workload, as the cluster reports them, read into what the reconciler needs.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from datetime import datetime
from typing import Any

from finetune_operator.api import BackendRef, FineTuneJob, Progress
from finetune_operator.backends.children import CONTROLLER_UID_KEY, ORPHANED
from finetune_operator.backends.kubernetes.workers import (
    BAD_INPUT_EXIT_CODE,
    COMPLETION_INDEX_KEY,
    FETCH_MODEL_CONTAINER,
    FETCH_REFUSED_EXIT_CODE,
    OTHER_CHECKPOINTS_EXIT_CODE,
    SETUP_EXIT_CODE,
    STOPPED_EXIT_CODE,
    TRAINER_CONTAINER,
)
from finetune_operator.reasons import FailedReason, WaitingReason
from finetune_operator.reconcile import Failure, Observation
from finetune_trainer.config import DOCKER_CONFIG_KEY
from finetune_trainer.exits import LOST_PEER
from finetune_trainer.record import ProgressRecord

logger = logging.getLogger("finetune_operator.kubernetes")
DEACTIVATED = "Deactivated"
"""The reason (a prefix: `Deactivated` or `DeactivatedDueTo...`) of Kueue's Evicted condition
when the Workload's `spec.active` is false: a suspension the operator asked for."""
NO_WORKLOAD_GRACE_SECONDS = 30.0
"""How long a queued Job may wait for Kueue to make its Workload before the status asks
whether Kueue is there at all."""

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
                       "says which field)", reason=FailedReason.INPUT_REFUSED)
    if (container, code) == (FETCH_MODEL_CONTAINER, FETCH_REFUSED_EXIT_CODE):
        return Failure("refused", tail[0].removeprefix("finetune-train: ")[:1000]
                       or f"{name}: the hub refused spec.model (its name, revision or token)",
                       reason=FailedReason.INPUT_REFUSED)
    if (container, code) == (TRAINER_CONTAINER, SETUP_EXIT_CODE):
        # the trainer's own line (errors.setup_failure), not a traceback's or a command's
        said = tail[0].removeprefix("finetune-train: ")[:1000] or (
            "the trainer could not set itself up in the image (its log says what)")
        return Failure("worker", f"{name} exited {code}: {said}", setup=True)
    if reason == "OOMKilled":  # the kernel's word, and what to change
        return Failure("worker", f"{name} exited {code} (OOMKilled): its processes needed more "
                       "memory than the container's limit, spec.resources.memory; raise it, "
                       "or lower hyperparameters.batchSizePerDevice or dataset.maxSeqLength")
    detail = f": {tail[0][:300]}" if tail[0] else ""
    return Failure("worker", f"{name} exited {code} ({reason}){detail}")


PEER_LOSS_GRACE_SECONDS = 30.0
"""How long a failure that only says a peer went waits for that peer's pod to end with its
own word, while the peer still runs: about a second when a rank was killed; a node that
died says nothing, and the lost connection is the cause given after this."""


def lost_a_peer(failure: Failure) -> bool:
    """The worker failed because another rank went, not on its own account."""
    return failure.kind == "worker" and bool(LOST_PEER.search(failure.message))


def _peer_still_ending(pods: list[dict[str, Any]], ended: str, now: datetime) -> bool:
    """Another pod of the gang has not ended yet, and the lost peer's failure is recent."""
    if not any(p.get("status", {}).get("phase") not in ("Failed", "Succeeded")
               and _terminated(p)[0] is None for p in pods):
        return False
    try:
        since = (now - datetime.fromisoformat(ended)).total_seconds()
    except ValueError:  # no finishedAt: no clock to wait by
        return False
    return since < PEER_LOSS_GRACE_SECONDS


def progress_from_record(record: dict[str, Any]) -> Progress:
    """Rank 0's /progress JSON (finetune_trainer.record.ProgressRecord) as the status model."""
    return Progress.from_record(ProgressRecord.model_validate(record))


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
        why = scheduled.get("reason", WaitingReason.UNSCHEDULABLE)
        return f"{name}: {why}: {scheduled.get('message', '')}"
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


_SAME_CAUSE = {"ImagePullBackOff": WaitingReason.ERR_IMAGE_PULL,
               "InvalidImageName": WaitingReason.ERR_IMAGE_PULL}
"""The kubelet's retries of one pull alternate ErrImagePull and ImagePullBackOff: one cause."""
_PULL_WORDS = "|".join([WaitingReason.ERR_IMAGE_PULL, *_SAME_CAUSE,
                        WaitingReason.ERR_IMAGE_NEVER_PULL])
_UNPULLABLE = re.compile(rf"^[^:]+: ({_PULL_WORDS}):")
_MISSING_CLAIM = re.compile(r'persistentvolumeclaim "([^"]+)" not found')
_MISSING_OBJECT = re.compile(r'(secret|configmap)s? "([^"]+)" not found')
_MISSING_KEY = re.compile(r"couldn't find key (\S+) in (Secret|ConfigMap) [^/\s]+/([^\s:]+)")
_NO_PRIORITY_CLASS = re.compile(r"no PriorityClass with name (\S+) was found")
_NO_NODE_MATCHES = "didn't match Pod's node affinity/selector"
_INSUFFICIENT = re.compile(r"Insufficient ([\w./-]+)")


_PULL_REFUSED = re.compile(  # containerd's words; the Docker engine's: "no basic auth"
    r'(?:pulling from host (?P<host>[^\s/]+) failed with status code [^:]*: '
    r'(?:401 Unauthorized|403 Forbidden))|(?:no basic auth credentials)'
    r'|(?:unauthorized: authentication required)')
_NO_SUCH_IMAGE = re.compile(r'failed to resolve reference "[^"]+": \S+: not found|'
                            r'manifest unknown')
CHART_TRAINER_IMAGE = "Helm values trainer.image.repository and .tag"
MAY_PULL = ("on AKS: az aks update --attach-acr; else a pull Secret in "
            "spec.kubernetes.imagePullSecrets or the chart's trainer.imagePullSecrets")


def _pull_refused(job: FineTuneJob, host: str | None) -> str:
    """The registry wants credentials the pods did not give: which Secret to make, and
    where to name it. The kubelet keeps retrying: no re-apply is needed once it exists."""
    k8s, ns = job.spec.kubernetes, job.namespace
    registry = host or "REGISTRY"
    named = k8s.image_pull_secrets if k8s is not None else None
    make = (f"kubectl create secret docker-registry NAME -n {ns} --docker-server={registry} "
            "--docker-username=USER --docker-password=TOKEN")
    if named:
        secrets = ", ".join(named)
        return (f"the registry {registry} refused the pull with the credentials of "
                f"spec.kubernetes.imagePullSecrets ({secrets}): check that each exists in "
                f"namespace {ns} (the kubelet pulls without a missing one: kubectl get secret "
                f"-n {ns} {named[0]}) and holds credentials for {registry} ({make}); the "
                "workers start once a pull works, no re-apply needed")
    return (f"the registry {registry} refused the pull without credentials it accepts: "
            f"create a pull Secret ({make}) and name it in spec.kubernetes.imagePullSecrets "
            "or the chart's trainer.imagePullSecrets (on AKS: az aks update --attach-acr); the "
            "workers start once a pull works, no re-apply needed")


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
        if match[1] == WaitingReason.ERR_IMAGE_NEVER_PULL:  # pull policy Never: what nodes hold
            where = ("spec.kubernetes.image names it" if k8s and k8s.image else
                     f"it is the operator's trainer image ({CHART_TRAINER_IMAGE})")
            return (f"{waiting} — {where}, and spec.kubernetes.imagePullPolicy Never lets "
                    "the kubelet use only images already on the node: load it there, or name "
                    "one the nodes hold")
        if refused := _PULL_REFUSED.search(waiting):
            return f"{waiting} — {_pull_refused(job, refused['host'])}"
        own = job.spec.kubernetes is not None and bool(job.spec.kubernetes.image)
        if _NO_SUCH_IMAGE.search(waiting):
            where = ("spec.kubernetes.image names it" if own else
                     f"it is the operator's trainer image ({CHART_TRAINER_IMAGE})")
            return (f"{waiting} — the registry has no such image: {where}; check its "
                    "repository and tag against those the registry lists (crane ls REPOSITORY)")
        if own:
            return (f"{waiting} — spec.kubernetes.image names the image: check its name and "
                    f"tag, and that the nodes may pull from its registry ({MAY_PULL})")
        return (f"{waiting} — the operator's trainer image ({CHART_TRAINER_IMAGE}): set "
                "spec.kubernetes.image to one the nodes can pull, or fix the chart's value "
                f"({MAY_PULL})")
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
        if any(key == DOCKER_CONFIG_KEY for _, key in refs):  # a registry's credentials
            make, sources = "secret docker-registry", ("--docker-server=<registry> "
                                                       "--docker-username=... "
                                                       "--docker-password=...")
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
    for index, target in enumerate(job.spec.output.export):
        if kind == "Secret" and target.secret_name == name:
            refs.append((f"spec.output.export[{index}].secretName", target.secret_key))
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
                       "its log names the field", reason=FailedReason.INPUT_REFUSED)
    if reason == "PodFailurePolicy" and (
            f"Container {TRAINER_CONTAINER} " in message
            and f"exit code {SETUP_EXIT_CODE}" in message):
        return Failure("worker", f"{text}: the trainer could not set itself up in the image "
                       "(an import, an op that cannot be built) — its log says what",
                       setup=True)
    if reason == "PodFailurePolicy" and f"Container {FETCH_MODEL_CONTAINER} " in message:
        return Failure("refused", f"{text}: the hub refused spec.model (no such model or "
                       "revision, or a token it does not accept) — the fetch-model "
                       "container's log names the field", reason=FailedReason.INPUT_REFUSED)
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
    failed = [e for e in events if e.get("reason") == WaitingReason.FAILED_CREATE]
    if not failed:
        return None
    newest = max(failed, key=_event_time)
    said = newest.get("message") or newest.get("note") or ""
    return f"{WaitingReason.FAILED_CREATE}: {said}".rstrip(": ")


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


MOUNT_REASONS = (WaitingReason.FAILED_MOUNT, WaitingReason.FAILED_ATTACH_VOLUME)
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
            not_mounted: str | None = None, now: datetime | None = None) -> Observation:
    """What the reconciler needs from the Job and its pods (pure: the caller fetches them).
    `not_created`: why the Job controller could not create pods (`creation_failure`);
    `not_mounted`: why a pod's volumes do not mount (`mount_failure`); `now`: the clock a
    worker that lost its peer waits by (PEER_LOSS_GRACE_SECONDS; None: no wait). The Job is
    the job's `status.backendRef`: what `kubectl describe` and `finetune status` point a
    user to."""
    if workload is None:
        return Observation()
    seen = _observe_job(workload, pods, nodes, progress, not_created, not_mounted, now)
    return replace(seen, backend_ref=BackendRef(kind="Job", name=workload["metadata"]["name"]))


def _observe_job(workload: dict[str, Any], pods: list[dict[str, Any]], nodes: int,
                 progress: Progress | None, not_created: str | None,
                 not_mounted: str | None, now: datetime | None) -> Observation:
    if workload["metadata"].get("deletionTimestamp"):
        return Observation(exists=True, deleting=True)
    pods = [p for p in pods if _made_by(p, workload)]  # not a previous gang's leftovers
    current = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    seen = [(f, _ended_at(p)) for p in current if (f := pod_failure(p)) is not None]
    # an evicted pod fails and goes: seen while it goes, it says it was preempted; a worker
    # that failed on its own while the Job controller took its pod away (the gang already
    # failed) is a cause too. Others being deleted were stopped, on suspend or a restart.
    gang_failed = bool(_condition(workload, "FailureTarget") or _condition(workload, "Failed"))
    seen += [(f, _ended_at(p)) for p in pods if p not in current
             if (f := pod_failure(p)) is not None
             and (f.kind == "preempted" or (f.kind == "worker" and gang_failed))]
    # a worker failure outranks a preemption seen at the same time: it must be counted; of
    # failed workers, one that could not set itself up (the image's, the same on every
    # attempt) outranks the others, one's own error a peer's lost connection to it, then
    # the first to end is the cause
    seen.sort(key=lambda pair: ({"refused": 0, "worker": 1, "preempted": 2,
                                 "stopped": 3}[pair[0].kind], not pair[0].setup,
                                lost_a_peer(pair[0]), pair[1]))
    failures = [f for f, _ in seen]
    if failures and lost_a_peer(failures[0]) and now is not None and _peer_still_ending(
            pods, seen[0][1], now):
        # each pod's torchrun reports on its own clock: the rank that lost its peer often
        # ends first, and the peer's own failure (its kill, its out-of-memory) says why
        return Observation(exists=True, progress=progress, polled=True)
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
_KNOWN_WAITS = frozenset(WaitingReason)


def blocking_reason(waiting: str | None) -> str | None:
    """The reason word of a wait that lasts until someone acts, from the words this module
    writes (`[pod: ]Reason: message`: pod_waiting, mount_failure, creation_failure); None
    for one on its way (`pod: fetching the model ...`)."""
    match = _REASON.match(waiting or "")
    if match is None:
        return None
    word = _SAME_CAUSE.get(match[1], match[1])
    return WaitingReason(word) if word in _KNOWN_WAITS else word  # theirs: passed on


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
