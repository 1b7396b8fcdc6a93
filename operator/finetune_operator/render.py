"""FineTuneJob → the objects a backend creates for it. Pure functions: no API calls.

`finetune render` prints these, the operator creates them. The kubernetes backend's
worker Service and Indexed Job join the trainer ConfigMap when the backend lands.
"""

from __future__ import annotations

from typing import Any

from finetune_operator import naming, yamlio
from finetune_operator.api import API_VERSION, KIND, FineTuneJob
from finetune_operator.trainer_config import build_trainer_config
from finetune_trainer.config import TrainerConfig
from finetune_trainer.uris import parse_uri


def kubernetes_location(section: str, uri: str, schemes: tuple) -> str:
    """pvc:// locations become the path where the worker pods mount the claim."""
    parsed = parse_uri(uri, schemes)
    return naming.pvc_mount_path(parsed) if parsed.scheme == "pvc" else uri


def labels(job: FineTuneJob) -> dict[str, str]:
    return {naming.LABEL_JOB: job.name, naming.LABEL_MANAGED_BY: naming.MANAGER}


def owner_references(job: FineTuneJob) -> list[dict[str, Any]]:
    """Children are garbage-collected with their FineTuneJob (when its uid is known)."""
    if not job.metadata.uid:
        return []
    return [{"apiVersion": API_VERSION, "kind": KIND, "name": job.name,
             "uid": job.metadata.uid, "controller": True, "blockOwnerDeletion": True}]


def object_meta(job: FineTuneJob, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": job.namespace, "labels": labels(job)}
    if owner := owner_references(job):
        meta["ownerReferences"] = owner
    return meta


def trainer_config_map(job: FineTuneJob, config: TrainerConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(job, naming.trainer_config_map(job.name)),
        "data": {naming.TRAINER_CONFIG_KEY: yamlio.dump(config.to_dict())},
    }


def render(job: FineTuneJob) -> list[dict[str, Any]]:
    """The objects the job's backend would create, in creation order."""
    if job.spec.backend == "kubernetes":
        return [trainer_config_map(job, build_trainer_config(job, kubernetes_location))]
    # Other backends hand the trainer config to their workers themselves (Azure ML passes
    # it as a job input): the contract document is what they submit.
    return [build_trainer_config(job).to_dict()]
