"""TRL's DPOTrainer on the model, pairs and settings of a `finetune run` (the peer of
tests/trainer/test_dpo.py): one JSON line per logged step with the loss and the rewards.

Run as a script (under torchrun for two processes). Seeded as our trainer is, and the
adapters made by the same call (trl_peers.seeded_model), so both start from the same
weights.
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from transformers import AutoTokenizer
from trl import DPOConfig, DPOTrainer
from trl_peers import LoggedSteps, finish, seeded_model, trainer_settings


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--model", "--data", "--method", "--loss", "--out"):
        parser.add_argument(name, required=True)
    for name, kind in (("--beta", float), ("--smoothing", float), ("--lr", float),
                       ("--steps", int), ("--batch", int), ("--max-length", int),
                       ("--seed", int)):
        parser.add_argument(name, type=kind, required=True)
    args = parser.parse_args()
    model = seeded_model(args.model, args.method, args.seed)
    config = DPOConfig(
        **trainer_settings("dpo", batch=args.batch, lr=args.lr, steps=args.steps,
                           seed=args.seed),
        beta=args.beta, loss_type=[args.loss], label_smoothing=args.smoothing,
        max_length=args.max_length)
    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_json(args.data),
                         processing_class=AutoTokenizer.from_pretrained(args.model),
                         callbacks=[LoggedSteps(args.out)])
    trainer.train()
    finish()


if __name__ == "__main__":
    main()
