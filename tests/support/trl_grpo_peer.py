"""TRL's GRPOTrainer on the model, prompts and settings of a `finetune run` (the peer of
tests/trainer/test_grpo.py): one JSON line per logged step with TRL's figures, and one per
sampled completion.

Run as a script (under torchrun for two processes). Seeded as our trainer is (the adapters
made by the same call, trl_peers.seeded_model), and each generation round sampled from the
seed our trainer gives it (`objectives.grpo.objective.generation_seed`), set at the start
of the step, before TRL generates. The rewards: our built-in `exact_match`, and the user's
own function the run names.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl_peers import LoggedSteps, finish, seeded_model, trainer_settings

from finetune_trainer.objectives.grpo import rewards
from finetune_trainer.objectives.grpo.objective import generation_seed


class SeededRounds(TrainerCallback):
    """Each step's generation round seeded as ours seeds it."""

    def __init__(self, seed: int, iterations: int) -> None:
        self.seed, self.iterations = seed, iterations
        self.rank = int(os.environ.get("RANK", "0"))

    def on_step_begin(self, args, state, control, **kwargs):
        round_index = state.global_step // self.iterations
        torch.manual_seed(generation_seed(self.seed, round_index, self.rank))


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--model", "--data", "--method", "--loss", "--out", "--completions",
                 "--own-reward"):
        parser.add_argument(name, required=True)
    for name, kind in (("--beta", float), ("--lr", float), ("--temperature", float),
                       ("--steps", int), ("--batch", int), ("--generations", int),
                       ("--max-completion", int), ("--seed", int), ("--iterations", int)):
        parser.add_argument(name, type=kind, required=True)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))

    def exact_match(prompts, completions, completion_ids, answer, trainer_state, **_):
        with open(args.completions, "a", encoding="utf-8") as handle:
            for index, (prompt, text) in enumerate(zip(prompts, completions, strict=True)):
                handle.write(json.dumps({"step": trainer_state.global_step + 1, "rank": rank,
                                         "index": index, "prompt": prompt,
                                         "completion": text}) + "\n")
        return rewards.exact_match(completions, column="answer", pattern=None, answer=answer)

    module, _, function = args.own_reward.partition(":")
    own = getattr(importlib.import_module(module), function)  # beside the data: PYTHONPATH
    model = seeded_model(args.model, args.method, args.seed)
    config = GRPOConfig(
        **trainer_settings("grpo", batch=args.batch, lr=args.lr, steps=args.steps,
                           seed=args.seed),
        beta=args.beta, loss_type=args.loss, num_generations=args.generations,
        max_completion_length=args.max_completion, temperature=args.temperature,
        scale_rewards="group", num_iterations=args.iterations)
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_match, own], args=config,
                          train_dataset=Dataset.from_json(args.data),
                          processing_class=AutoTokenizer.from_pretrained(args.model),
                          callbacks=[LoggedSteps(args.out),
                                     SeededRounds(args.seed, args.iterations)])
    trainer.train()
    finish()


if __name__ == "__main__":
    main()
