"""Operator-wide settings: what the platform team chooses once, in the Helm values.

Each setting comes from one environment variable that the chart sets on the operator
Deployment; `finetune render` uses the same defaults, so what it prints is what the
operator creates.
"""

from __future__ import annotations

import json
import os

from pydantic import BaseModel, Field

ENV_PREFIX = "FINETUNE_"


class Taint(BaseModel):
    key: str
    value: str | None = None
    effect: str = "NoSchedule"


class OperatorSettings(BaseModel):
    trainer_image: str = "finetune-trainer:0.1.0"
    """Image of the worker pods, unless a job sets spec.kubernetes.image. The chart sets the
    one installed (required: none is published); this placeholder is what `finetune render`
    shows."""
    trainer_pull_secrets: list[str] = Field(default_factory=list)
    """Secrets the worker pods pull their image with, unless a job sets
    spec.kubernetes.imagePullSecrets (the chart's trainer.imagePullSecrets)."""
    gpu_resource: str = "nvidia.com/gpu"
    gpu_taint: Taint | None = Field(default_factory=lambda: Taint(key="sku", value="gpu"))
    """AKS GPU node pools are commonly tainted sku=gpu:NoSchedule; GPU workers tolerate it."""
    spot_taint: Taint = Field(default_factory=lambda: Taint(
        key="kubernetes.azure.com/scalesetpriority", value="spot"))
    spot_node_label: str = "kubernetes.azure.com/scalesetpriority"
    infiniband_resource: str = "rdma/rdma_shared_device_a"
    """What the cluster's RDMA device plugin offers (NVIDIA network operator's default)."""
    rendezvous_port: int = 29500
    metrics_port: int = 9108
    termination_grace_seconds: int = 300
    """Time workers get after SIGTERM to finish a step and write a checkpoint."""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorSettings:
        """FINETUNE_TRAINER_IMAGE, FINETUNE_GPU_RESOURCE, ... (JSON for the taints and the
        pull secrets)."""
        environ = os.environ if environ is None else environ
        values = {}
        for name in cls.model_fields:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is None:
                continue
            if name.endswith("_taint"):
                values[name] = None if raw in ("", "null") else Taint.model_validate_json(raw)
            elif name.endswith("_secrets"):  # a JSON list of names
                values[name] = json.loads(raw) if raw.strip() else []
            else:
                values[name] = raw
        return cls.model_validate(values)
