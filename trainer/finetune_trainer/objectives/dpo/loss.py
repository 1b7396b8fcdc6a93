"""DPO's losses over each pair's answer log-probabilities, and the full-weight reference table.

A pair's answers are scored by the sum of their tokens' log-probabilities under the model
being trained (the policy) and under the reference (the model before training). The
losses and the rewards are TRL's `DPOTrainer` formulas of the same names (and `sigmoid`
with label smoothing is conservative DPO, which TRL 1.16's `sigmoid` no longer applies),
so its users' beta and habits carry over; tests/trainer/test_dpo.py holds ours to
DPOTrainer step for step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from finetune_trainer.data import rank_batches
from finetune_trainer.loss import answer_logps
from finetune_trainer.objectives.dpo.settings import DpoConfig


@dataclass(frozen=True)
class PairLosses:
    """A micro-batch's pairs: each one's loss and rewards (beta x log-ratio)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    def reward_sums(self) -> torch.Tensor:
        """Sums over the pairs of `objective.REWARDS` (accuracies: pairs whose chosen reward
        is higher), float64: divided by the pair count at the log step."""
        chosen, rejected = self.chosen_rewards.double(), self.rejected_rewards.double()
        return torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                            (chosen > rejected).double().sum()])


def dpo_losses(policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor,
               settings: DpoConfig) -> PairLosses:
    """`policy`, `reference`: each answer's summed log-probability, chosen at even indices
    and rejected at odd ones; `lengths`: each answer's token count (for `ipo`)."""
    chosen_ratio = policy[0::2] - reference[0::2]
    rejected_ratio = policy[1::2] - reference[1::2]
    beta, smoothing = settings.beta, settings.label_smoothing
    if settings.loss == "ipo":  # on the per-token mean log-ratios, as TRL
        delta = (chosen_ratio / lengths[0::2].clamp(min=1)
                 - rejected_ratio / lengths[1::2].clamp(min=1))
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        delta = chosen_ratio - rejected_ratio
        right, wrong = -F.logsigmoid(beta * delta), -F.logsigmoid(-beta * delta)
        if settings.loss == "sigmoid":
            losses = (1 - smoothing) * right + smoothing * wrong
        else:  # robust
            losses = ((1 - smoothing) * right - smoothing * wrong) / (1 - 2 * smoothing)
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def answer_lengths(batch, answers: int) -> torch.Tensor:
    """Each answer's trained token count in a collated batch (`loss_answers`)."""
    return torch.bincount(batch["loss_answers"], minlength=answers).to(torch.float32)


def adapters_off(model):
    """The reference of an adapter run: the base with its adapters switched off (peft's
    `disable_adapter`, on the very modules the strategy wraps: no second copy)."""
    return model.disable_adapter()


def reference_table(strategy, head, sequences, pair_count: int, micro_batch: int,
                    collation, group, base: bool = False) -> torch.Tensor:
    """Every pair's answer log-probabilities under the model as it is now (full weights,
    before the first step; `base`: an adapter run's base, adapters off), [pairs, 2]
    float64 on CPU: each rank scores its share of the packed `sequences`, all ranks running
    the same number of batches, summed over ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    table = torch.zeros(pair_count, 2, dtype=torch.float64)
    was_training = strategy.model.training
    strategy.model.eval()
    switched = adapters_off(strategy.unwrapped()) if base else contextlib.nullcontext()
    with torch.no_grad(), switched:
        for mine in rank_batches(sequences, micro_batch, world, rank):
            batch = collation.tensors(mine)
            on_device = {k: v.to(strategy.device) for k, v in batch.items()}
            with strategy.autocast():
                logps = answer_logps(strategy.model, on_device, head)
            table[batch["pairs"]] = logps.double().cpu().view(-1, 2)
    strategy.model.train(was_training)
    dist.all_reduce(table, group=group)
    return table
