"""What the TRL peers of our objectives share (trl_dpo_peer.py, trl_grpo_peer.py): the model
seeded as our trainer seeds it, TRL's trainer settings that match a `finetune run` of the
tests' manifests, and each logged step written as a JSON line.

Imported by the peers as a sibling module: they run as scripts (under torchrun for two
processes), with this folder first on their path.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, TrainerCallback

from finetune_trainer.config import LoraConfig
from finetune_trainer.model import apply_lora


def seeded_model(path: str, method: str, seed: int):
    """The model as our trainer builds it: seeded, then the adapters made by the same call
    (`finetune_trainer.model.apply_lora`), so both start from the same weights."""
    transformers.set_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if method == "lora":
        model = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0))
    return model


def trainer_settings(name: str, *, batch: int, lr: float, steps: int, seed: int
                     ) -> dict[str, Any]:
    """TRL's TrainingArguments as the tests' manifests train: fp32 on CPU, cosine without
    warmup, no weight decay, gradients clipped at 1, a log line every step."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return dict(
        output_dir=tempfile.mkdtemp(prefix=f"trl-{name}-"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, learning_rate=lr, lr_scheduler_type="cosine",
        warmup_steps=0, max_steps=steps, logging_steps=1, save_strategy="no", report_to=[],
        max_grad_norm=1.0, weight_decay=0.0, seed=seed, use_cpu=True, bf16=False, fp16=False,
        optim="adamw_torch", dataloader_num_workers=0,
        ddp_backend="gloo" if world > 1 else None, gradient_checkpointing=False,
        disable_tqdm=True)


class LoggedSteps(TrainerCallback):
    """Each logged training step's figures as one JSON line of `out` (rank 0)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.out, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def finish() -> None:
    """gloo's threads still alive at interpreter exit can abort the process after the last
    step was written ("terminate called without an active exception", SIGABRT)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
