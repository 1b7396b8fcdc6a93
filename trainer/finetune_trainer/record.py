"""The progress record: what rank 0 publishes at every log step and every backend reads
back, named once (#16). Torch-free: the operator imports it.

It travels three ways, all from this model: `progress.json` / `progress.jsonl` in the
output folder and rank 0's `/progress` endpoint (its JSON, camelCase keys as in the
FineTuneJob status), and on Azure ML the job's MLflow run (`mlflow_metrics`, read back by
`from_mlflow`). The operator turns it into `status.progress` (api.Progress.from_record).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from finetune_trainer.exits import TERMINATION_LIMIT
from finetune_trainer.objectives import registry

MLFLOW_METRICS: dict[str, str] = {
    "loss": "loss",
    "learning_rate": "learning_rate",
    "tokens_per_second": "tokens_per_second",
    "epoch": "epoch",
    "total_steps": "total_steps",
    "eta_seconds": "eta_seconds",
    "grad_norm": "grad_norm",
    "eval_loss": "eval_loss",
}
"""Record field → MLflow metric name (the Studio's charts; the operator reads them back).
Every other metric of the run the trainer logs is one of the objective's (TRL's names)."""
FOREIGN_METRICS = ("system/",)
"""Metrics of a run that are not the trainer's: MLflow's system metrics."""


def headline(objective_metrics: dict[str, float] | None) -> list[tuple[str, float, str]]:
    """(label, value, format) of the objective's figures a progress line shows (each
    objective's `ObjectiveSpec.headline`: DPO's margin and accuracy, GRPO's reward), finite
    values only."""
    figures = objective_metrics or {}
    return [(label, figures[name], shown) for spec in registry().values()
            for name, label, shown in spec.headline
            if isinstance(figures.get(name), (int, float)) and math.isfinite(figures[name])]


def format_duration(seconds: float | None) -> str:
    """`3725` → `1:02:05` (an ETA, an elapsed time); `?` when unknown."""
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressRecord(BaseModel):
    """Where training is, as rank 0 measured it over the last log window."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True,
                              extra="ignore", validate_assignment=True)

    step: int
    """Optimizer steps completed."""
    total_steps: int | None = None
    epoch: float | None = None
    loss: float | None = None
    """Mean loss over the window's label tokens."""
    learning_rate: float | None = None
    grad_norm: float | None = None
    """The gradient norm of the window's last step (before clipping)."""
    eval_loss: float | None = None
    """Mean token loss on the eval split at the latest evaluation (None: not evaluated yet);
    in a Succeeded record, the export's (under early stopping, the best evaluation's)."""
    objective_metrics: dict[str, float] | None = None
    """The objective's own figures over the window, under TRL's names (DPO: `rewards/chosen`,
    `rewards/margins`, ...; GRPO: `reward`, `reward_std`, `rewards/<name>/mean`, `kl`,
    ...); None for SFT."""
    tokens_per_second: float | None = None
    """Label tokens per second, all ranks together (the tokens the loss trains on)."""
    input_tokens_per_second: float | None = None
    """Tokens through the model per second, all ranks together (prompts too, each token
    once, padding not): what MFU counts."""
    eta_seconds: int | None = None
    mfu: float | None = None
    """Model FLOPs utilisation on GPUs, attention counted over the query-key pairs
    actually attended (flops.py; docs/performance.md)."""
    mfu_full_rows: float | None = None
    """MFU as PaLM and torchtitan count it (attention over whole rows, causal masking
    ignored), for comparing with figures published that way."""
    step_seconds: float | None = None
    """Mean wall time of the window's steps."""
    peak_memory_bytes: int | None = None
    """Rank 0's peak memory (the CUDA allocator's on a GPU, resident set on CPU)."""
    phase: str = "Running"
    """Running; Exporting while rank 0 pushes the trained model to `output.export` (no step
    is due: the operator's stall check waits); then Succeeded or Stopped."""
    stopped_early: str | None = None
    """Why a Succeeded run ended before its last step (hyperparameters.earlyStoppingPatience)."""
    update_time: str = ""
    preflight: dict[str, Any] | None = None
    """The collective preflight's figures (busBandwidthGBps, nodes, slowNodes, ...)."""
    exports: list[dict[str, str]] | None = None
    """In a Succeeded record: each `spec.output.export` target's outcome, `{uri, pushed}`
    (the reference with its digest) or `{uri, error}` (what went wrong and the fix)."""

    def as_json(self, history: bool = False) -> dict[str, Any]:
        """The record as JSON (camelCase); `history`: a progress.jsonl line, without the
        preflight every record repeats."""
        return self.model_dump(by_alias=True, exclude={"preflight"} if history else None)

    def as_termination_message(self) -> str:
        """The final record as a finished pod's termination message (the kubelet keeps 4 KB):
        the operator can no longer read /progress once the trainer has gone, and without it
        the status would keep the last figures it polled and never learn why a run stopped
        early. No preflight (already in the status, and long); where it would still pass
        TERMINATION_LIMIT, the objective's figures (polled already) go, then the exports'
        errors are shortened: cut, the JSON would not be read at all."""
        record = self.model_dump(by_alias=True, exclude={"preflight"})
        text = json.dumps(record, separators=(",", ":"))
        if len(text) > TERMINATION_LIMIT:
            record["objectiveMetrics"] = None
            text = json.dumps(record, separators=(",", ":"))
        if len(text) > TERMINATION_LIMIT and record.get("exports"):
            record["exports"] = [{**e, **({"error": e["error"][:120]} if "error" in e else {})}
                                 for e in record["exports"]]
            text = json.dumps(record, separators=(",", ":"))
        return text

    def mlflow_metrics(self) -> dict[str, float]:
        """The record's numbers under their MLflow names; unknown or non-finite values are
        left out (MLflow refuses NaN, and a missing loss is not a zero loss)."""
        out = {}
        values = [(metric, getattr(self, field)) for field, metric in MLFLOW_METRICS.items()]
        values += list((self.objective_metrics or {}).items())
        for metric, value in values:
            if isinstance(value, (int, float)) and math.isfinite(value):
                out[metric] = float(value)
        return out

    @classmethod
    def from_mlflow(cls, metrics: list[dict[str, Any]]) -> ProgressRecord | None:
        """The record from an MLflow run's metrics (`runs/get` → data.metrics, each key's
        latest step); None before the trainer logged any."""
        latest: dict[str, dict[str, Any]] = {}
        for metric in metrics:
            key = metric.get("key")
            if key and (key not in latest or (metric.get("step") or 0) >= (
                    latest[key].get("step") or 0)):
                latest[key] = metric
        if MLFLOW_METRICS["loss"] not in latest and MLFLOW_METRICS["total_steps"] not in latest:
            return None
        values = {field: float(latest[name]["value"]) for field, name in MLFLOW_METRICS.items()
                  if name in latest}
        for whole in ("total_steps", "eta_seconds"):
            if whole in values:
                values[whole] = int(values[whole])
        known = set(MLFLOW_METRICS.values())
        objective = {name: float(metric["value"]) for name, metric in latest.items()
                     if name not in known and not name.startswith(FOREIGN_METRICS)}
        step = max(int(m.get("step") or 0) for m in latest.values())
        return cls(step=step, objective_metrics=objective or None, **values)
