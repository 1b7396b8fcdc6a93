"""What `finetune plan`'s own options mean where a manifest would say it: `--model NAME`
as the smallest FineTuneJob of that model, and which `--gpu-type` the planner refuses.

Decisions only: the command admits the job (`admission.admit`, a layer above the planner)
and prints what these return."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from finetune_operator import gpu_catalog as catalog
from finetune_operator.api import API_VERSION, KIND, MAX_NAME_LENGTH, FineTuneJob
from finetune_operator.planner import known_models
from finetune_operator.planner.plan import unknown_gpu_type


def model_uri(name: str) -> str:
    """`--model NAME` as a model URI: a local folder (or its config.json) where NAME is a
    path or names one that exists here, else a hub repository."""
    local = Path(name).expanduser()
    if name.startswith((".", "/", "~")) or local.exists():
        return str(local.resolve())
    return "hf://" + name.removeprefix("hf://").strip("/")


def model_manifest(name: str, uri: str, gpu_type: str | None = None, *,
                   method: str | None = None, seq_len: int | None = None,
                   gpus_per_node: int | None = None, nodes: int | None = None
                   ) -> dict[str, Any]:
    """`plan --model NAME` (`uri`: `model_uri(NAME)`): the smallest FineTuneJob of that model
    (a manifest's defaults, one epoch, placeholder data and output), with the options given
    and the name made of the model's."""
    local = Path(name).expanduser()
    named = local.resolve().parent if local.name == "config.json" else Path(uri)
    label = re.sub(r"[^a-z0-9]+", "-", named.name.lower())

    def given(**fields: int | str | None) -> dict[str, int | str]:
        return {key: value for key, value in fields.items() if value is not None}

    spec = {"model": {"uri": uri}, "hyperparameters": {"epochs": 1},
            "dataset": given(uri="pvc://data/train.jsonl", maxSeqLength=seq_len),
            "method": given(type=method), "output": {"uri": "pvc://output/plan"},
            "resources": given(gpusPerNode=gpus_per_node, nodes=nodes, gpuType=gpu_type)}
    return {"apiVersion": API_VERSION, "kind": KIND, "spec": spec,
            "metadata": {"name": label[:MAX_NAME_LENGTH].strip("-") or "plan"}}


def missing_model(name: str, uri: str, why_offline: str | None,
                  unanswered: str | None = None) -> str:
    """Why `plan --model NAME` has no config.json to plan from, naming the built-in table's
    closest names; `why_offline`: why the hub was not asked; `unanswered`: why the hub,
    asked, gave none."""
    if not uri.startswith("hf://"):
        what = "holds no config.json that reads as JSON" if Path(uri).exists() else (
            "is no file or folder here (a hub model is org/name)")
        return f"--model {name}: {uri} {what}"
    close = known_models.close_names(name)
    hub = (f"the hub was not asked (offline: {why_offline})" if why_offline else
           f"the hub did not answer ({unanswered})" if unanswered else
           "the hub gave no config.json for it (not reached, no such repo, or a gated "
           "one: set HF_TOKEN)")
    return (f"--model {name}: not in the planner's built-in table, and {hub} — "
            + (f"did you mean {' or '.join(close)}? " if close else "")
            + "(`finetune plan --list-models` lists the table; a local folder holding "
            "config.json works too)")


def gpu_type_refused(gpu_type: str, job: FineTuneJob) -> str | None:
    """Why `plan --gpu-type`, typed on the command line, is refused, or None: a name the
    catalog does not know (a typo would be planned as `verdict: unknown`, exit 0) or a job
    of CPU workers (the option would be ignored without a word)."""
    if not job.spec.resources.on_gpus:
        return (f"--gpu-type {gpu_type}: the job's workers are CPU processes "
                "(spec.resources.gpusPerNode: 0) — set gpusPerNode to plan it on GPUs")
    if catalog.find(gpu_type) is None:
        return f"--gpu-type {gpu_type}: {unknown_gpu_type(gpu_type)}"
    return None
