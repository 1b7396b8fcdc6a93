"""AdamW and the learning-rate schedule: linear warmup, then cosine, linear or constant."""

from __future__ import annotations

import math

import torch

from finetune_trainer.config import Hyperparameters


def lr_factor(step: int, total_steps: int, warmup_ratio: float, scheduler: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    warmup = math.ceil(total_steps * warmup_ratio)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if scheduler == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    if scheduler == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model, hp: Hyperparameters, learning_rate: float, fused: bool = True):
    """AdamW, weight decay on matrices only; torch's fused kernel when `fused` (the
    strategy's `fused_optimizer`) and every trainable weight is on a GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if _dims(p) >= 2]
    no_decay = [p for p in params if _dims(p) < 2]  # biases and norms
    groups = [{"params": decay, "weight_decay": hp.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = fused and all(p.is_cuda for p in params)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=learning_rate,
                             betas=(0.9, 0.999), eps=1e-8, fused=fused or None)


def _dims(parameter) -> int:
    """The weight's own dimensions: a ZeRO-3 partition is a flat placeholder that keeps
    the real shape in `ds_shape`."""
    return len(getattr(parameter, "ds_shape", parameter.shape))


def build_scheduler(optimizer, hp: Hyperparameters, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, total_steps, hp.warmup_ratio, hp.scheduler))
