"""The kubernetes backend's word on a manifest before anything runs: the rules of its spec
section (`spec.kubernetes`; those with CEL are compiled into the CRD) and of Kueue's queue
label, and where a job's logs are. Light on purpose: `finetune validate` and `finetune run`
load it (entry point `finetune_operator.backend_rules`) without the backend's clients."""

from __future__ import annotations

from collections.abc import Iterator

from finetune_operator.api import FineTuneJob
from finetune_operator.backends import KUEUE_QUEUE_LABEL, BackendRules
from finetune_operator.validation import CelRule, Problem, Rule, short_repr

NAME = "kubernetes"

RESERVED_ENV_NAMES = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "FINETUNE_RESTARTS", "NODE_NAME",
    "GROUP_RANK", "NODE_RANK", "NNODES", "NPROC_PER_NODE", "TORCHELASTIC_RUN_ID",
    "FINETUNE_CONFIG", "FINETUNE_TERMINATION_LOG",
)
"""torchrun's and torch.distributed's rendezvous variables and the names Kubeflow users know:
set by the backend for every worker, so a user's value would silently split or hang the
gang."""
RESERVED_ENV_PREFIXES = ("PET_",)

_RESERVED_CEL = ("!(e.name in [" + ", ".join(f"'{n}'" for n in RESERVED_ENV_NAMES) + "]) && "
                 + " && ".join(f"!e.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES))


def pod_settings(job: FineTuneJob) -> Iterator[Problem]:
    k8s = job.spec.kubernetes
    if k8s is None:
        return
    seen: set[str] = set()
    for i, env in enumerate(k8s.env):
        path = f"spec.kubernetes.env[{i}]"
        if env.name in RESERVED_ENV_NAMES or env.name.startswith(RESERVED_ENV_PREFIXES):
            yield Problem(f"{path}.name", f"{env.name} is reserved: the backend sets it for "
                          "the rendezvous of every worker", f"remove {env.name} from env")
        if env.value is not None and env.value_from is not None:
            yield Problem(path, "has both value and valueFrom", "keep one of them")
        if env.name in seen:
            yield Problem(f"{path}.name", f"{env.name} is set twice", "keep one entry")
        seen.add(env.name)
    names: set[str] = set()
    for i, volume in enumerate(k8s.volumes):
        path = f"spec.kubernetes.volumes[{i}]"
        if len(volume.sources()) != 1:
            yield Problem(path, f"has {len(volume.sources())} sources",
                          "set exactly one of persistentVolumeClaim, configMap, secret, emptyDir")
        if volume.name in names:
            yield Problem(f"{path}.name", f"{volume.name} is used twice", "give it another name")
        names.add(volume.name)


def queue_is_in_the_spec(job: FineTuneJob) -> Iterator[Problem]:
    """Kueue's queue label on the FineTuneJob itself (the habit of Kubeflow's TrainJob and
    JobSet, which Kueue knows): Kueue reads it only on the workloads it integrates, so the
    job ran unqueued. An error: a job meant to wait for its quota must not start at once.
    No CEL rule: the API server's rules cannot see metadata.labels."""
    meta, spec = job.metadata, job.spec
    for where, values in ("metadata.labels", meta.labels), ("metadata.annotations",
                                                            meta.annotations):
        if KUEUE_QUEUE_LABEL not in values:
            continue
        queue = values[KUEUE_QUEUE_LABEL]
        shown = queue if queue.isprintable() and len(queue) <= 63 else short_repr(queue)
        spec_queue = spec.kubernetes.queue_name if spec.kubernetes else None
        if spec.backend != NAME:
            continue  # another backend's rules say what queues its jobs
        if spec_queue is None:
            yield Problem(where, f"{KUEUE_QUEUE_LABEL}: Kueue reads it only on the kinds it "
                          "integrates (Job, JobSet, TrainJob, ...), not here: the workers would "
                          f"start without waiting in queue {shown}",
                          f"did you mean `spec.kubernetes.queueName: {shown}`?")
        elif spec_queue != queue:
            yield Problem(where, f"{KUEUE_QUEUE_LABEL} says {shown}, and "
                          f"spec.kubernetes.queueName is {spec_queue}: the worker Job waits in "
                          f"{spec_queue}", "remove the label (spec.kubernetes.queueName is "
                          "the job's queue), or set queueName to the queue meant")


RULES = (
    Rule("kubernetes_pod_settings", pod_settings, (
        CelRule("spec.kubernetes", f"!has(self.env) || self.env.all(e, {_RESERVED_CEL})",
                "spec.kubernetes.env sets a reserved rendezvous variable (MASTER_ADDR, "
                "MASTER_PORT, RANK, WORLD_SIZE, PET_*, ...) — remove it; the backend sets "
                "these", ".env"),
        CelRule("spec.kubernetes.env[*]", "!(has(self.value) && has(self.valueFrom))",
                "an env entry has both value and valueFrom — keep one"),
        CelRule("spec.kubernetes.volumes[*]",
                "[has(self.persistentVolumeClaim), has(self.configMap), has(self.secret), "
                "has(self.emptyDir)].filter(x, x).size() == 1",
                "a volume needs exactly one of persistentVolumeClaim, configMap, secret or "
                "emptyDir"),
    )),
    Rule("queue_is_in_the_spec", queue_is_in_the_spec),
)

BACKEND_RULES = BackendRules(section=NAME, rules=RULES)
"""What `finetune_operator.backend_rules` names for this backend."""
