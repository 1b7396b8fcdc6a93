"""Names of the objects derived from a FineTuneJob: one place, so launch stays idempotent
(a re-reconcile computes the same names and finds what it created before)."""

from __future__ import annotations

from finetune_trainer.uris import Uri

# Where the kubernetes backend mounts a `pvc://claim/path` location in every worker.
PVC_MOUNT_ROOT = "/mnt/pvc"
TRAINER_CONFIG_KEY = "trainer.yaml"
TRAINER_CONFIG_MOUNT = "/etc/finetune"
LABEL_JOB = "finetune.dev/job"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "finetune-operator"


def trainer_config_map(job_name: str) -> str:
    return f"{job_name}-trainer"


def headless_service(job_name: str) -> str:
    return job_name


def worker_job(job_name: str) -> str:
    return job_name


def worker_hostname(job_name: str, index: int) -> str:
    """An Indexed Job's pod hostname: `<job>-<completion index>`."""
    return f"{worker_job(job_name)}-{index}"


def all_names(job_name: str, nodes: int) -> list[str]:
    """Every name derived from a job with `nodes` workers (for length checks)."""
    return [trainer_config_map(job_name), headless_service(job_name), worker_job(job_name),
            worker_hostname(job_name, nodes - 1)]


def pvc_mount_path(uri: Uri) -> str:
    """The path inside a worker at which a pvc:// location appears."""
    path = f"{PVC_MOUNT_ROOT}/{uri.pvc_claim}"
    return f"{path}/{uri.pvc_subpath}" if uri.pvc_subpath else path
