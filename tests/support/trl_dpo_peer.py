"""TRL's DPOTrainer on the model, pairs and settings of a `finetune run` (the peer of
tests/trainer/test_dpo.py): one JSON line per logged step with the loss and the rewards.

Run as a script (under torchrun for two processes). Seeded as our trainer is, and the
adapters made by the same call (`finetune_trainer.model.apply_lora` after
`transformers.set_seed(seed)` on the loaded model), so both start from the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import transformers
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

from finetune_trainer.config import LoraConfig
from finetune_trainer.model import apply_lora


class Steps(TrainerCallback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.out, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--model", "--data", "--method", "--loss", "--out"):
        parser.add_argument(name, required=True)
    for name, kind in (("--beta", float), ("--smoothing", float), ("--lr", float),
                       ("--steps", int), ("--batch", int), ("--max-length", int),
                       ("--seed", int)):
        parser.add_argument(name, type=kind, required=True)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    transformers.set_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.method == "lora":
        model = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pairs = Dataset.from_json(args.data)
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-dpo-"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=0, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to=[], beta=args.beta, loss_type=[args.loss], label_smoothing=args.smoothing,
        max_length=args.max_length, max_grad_norm=1.0, weight_decay=0.0, seed=args.seed,
        use_cpu=True, bf16=False, fp16=False, optim="adamw_torch", dataloader_num_workers=0,
        ddp_backend="gloo" if world > 1 else None, gradient_checkpointing=False,
        disable_tqdm=True)
    trainer = DPOTrainer(model=model, args=config, train_dataset=pairs,
                         processing_class=tokenizer, callbacks=[Steps(args.out)])
    trainer.train()
    if torch.distributed.is_initialized():
        # gloo's threads still alive at interpreter exit can abort the process after the
        # last step was written ("terminate called without an active exception", SIGABRT)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
