"""Space the output volume needs (#17), as a breakdown a user can read.

The output folder holds, following what the trainer writes:
- `modelCache`: an hf:// model's copy, fetched once for every node and restart
  (finetune_trainer.fetch): the hub's weights as stored (their config's dtype, bf16 when
  it names none);
- `checkpoints`: `keepLast` complete ones plus the one being written (the oldest is
  deleted only after the new one is complete), and under early stopping the best
  evaluation's, which pruning keeps for the export. A checkpoint holds the trainable weights
  and their Adam moments, never the frozen base: 12 bytes a trainable weight (fp32 weight
  and two moments), and under ZeRO-1/2 DeepSpeed's 16-bit module copy of them on top;
- `finalModel`: the export: the trained weights (the whole model for a full fine-tune,
  the adapter for LoRA and QLoRA) in fp32, or in the 16-bit module's dtype under
  DeepSpeed, and with `mergeAdapter` the merged model in fp32 beside it.
Progress records, logs and the tokenizer are a few MB and not counted.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.memory import TrainingSetup, trainable_params

DISK_LINES = ("modelCache", "checkpoints", "finalModel")
STORED_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class DiskEstimate(BaseModel):
    """Bytes the output volume holds at the end of a run, line by line."""

    breakdown: dict[str, int]
    total: int
    checkpoint_bytes: int
    """One checkpoint."""


def stored_bytes_per_param(config: dict[str, Any]) -> int:
    """Bytes a weight takes in the model's files (config.json's dtype; bf16 if unnamed)."""
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return STORED_BYTES.get(dtype.removeprefix("torch."), 2)


def _module_bytes(setup: TrainingSetup) -> int:
    """Bytes a trained weight takes in the module the strategy exports: fp32 under DDP and
    FSDP, the compute dtype in DeepSpeed's module."""
    if setup.strategy in ("ddp", "fsdp") or setup.precision == "fp32":
        return 4
    return 2


def checkpoint_bytes(shape: ModelShape, setup: TrainingSetup) -> int:
    # ZeRO-1/2 also save the engine's whole 16-bit module; ZeRO-3's partitions are in its
    # fp32 optimizer state already
    module_copy = _module_bytes(setup) if setup.strategy in ("zero1", "zero2") else 0
    return (12 + module_copy) * trainable_params(shape, setup)


def estimate_disk(shape: ModelShape, setup: TrainingSetup, *, fetched: bool,
                  stored_bytes: int, keep_last: int, merge_adapter: bool,
                  keeps_best: bool = False) -> DiskEstimate:
    """The output volume's bytes for `setup`; `fetched`: the model is an hf:// one, copied
    into the volume once; `keeps_best`: early stopping keeps the best evaluation's
    checkpoint beside the newest ones."""
    one = checkpoint_bytes(shape, setup)
    final = _module_bytes(setup) * trainable_params(shape, setup)
    if setup.method != "full" and merge_adapter:
        final += 4 * shape.total_params
    lines = {"modelCache": stored_bytes * shape.total_params if fetched else 0,
             "checkpoints": (keep_last + 1 + keeps_best) * one, "finalModel": final}
    return DiskEstimate(breakdown=lines, total=sum(lines.values()), checkpoint_bytes=one)
