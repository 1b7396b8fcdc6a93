"""GRPO's numbers, as TRL's GRPOTrainer computes them: advantages from a step's rewards, the
clipped policy loss with its KL to the reference, and the figures a log step reports.

Pure torch on tensors: objective.py feeds them the sampled completions and the model's
per-token log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune_trainer.objectives.grpo.settings import GrpoConfig

STD_FLOOR = 1e-4
"""Added to the standard deviation advantages are divided by (TRL's)."""


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaN (NaN where fewer than two values)."""
    keep = dim is not None
    mean = torch.nanmean(values, dim=dim, keepdim=True) if keep else torch.nanmean(values)
    variance = torch.nanmean((values - mean) ** 2, dim=dim) if keep else torch.nanmean(
        (values - mean) ** 2)
    count = (~values.isnan()).sum(dim=dim) if keep else (~values.isnan()).sum()
    correction = torch.where(count > 1, count / (count - 1).clamp(min=1),
                             torch.full_like(variance, float("nan")))
    return (variance * correction).sqrt()


@dataclass(frozen=True)
class Scored:
    """A step's completions scored, all ranks (in the round's order)."""

    advantages: torch.Tensor
    """One per completion; 0 where no reward applied."""
    figures: dict[str, float]
    """TRL's `reward`, `reward_std`, `frac_reward_zero_std`, `rewards/<name>/mean|std`."""


def score(per_reward: torch.Tensor, names: list[str], weights: list[float], generations: int,
          scaling: str) -> Scored:
    """`per_reward`: [completions, rewards], NaN where a reward returned None; groups of
    `generations` consecutive completions answer one prompt."""
    weight = torch.tensor(weights, dtype=per_reward.dtype)
    unscorable = per_reward.isnan().all(dim=1)
    rewards = (per_reward * weight).nansum(dim=1)
    rewards[unscorable] = float("nan")
    grouped = rewards.view(-1, generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(generations)
    if scaling == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:  # group; none keeps it for frac_reward_zero_std only
        std = nanstd(grouped, dim=1).repeat_interleave(generations)
    advantages = rewards - mean
    if scaling != "none":
        advantages = advantages / (std + STD_FLOOR)
    figures = {}
    for column, name in enumerate(names):
        figures[f"rewards/{name}/mean"] = torch.nanmean(per_reward[:, column]).item()
        figures[f"rewards/{name}/std"] = nanstd(per_reward[:, column]).item()
    figures["reward"] = torch.nanmean(rewards).item()
    figures["reward_std"] = nanstd(rewards).item()
    figures["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean(
        ).item()
    return Scored(torch.nan_to_num(advantages, nan=0.0), figures)


FLAT_STEPS = 10
"""Steps in a row of groups each scored alike before the log warns (a tenth of example 09's
100): fewer may be a model's first, still random, answers."""


def flat_rewards_warning(flat_steps: int) -> str | None:
    """The warning for a run whose last `flat_steps` steps each trained on groups whose
    completions all got the same reward (TRL's `frac_reward_zero_std` 1.0): every
    advantage is 0, so is the loss, and the model does not move, while the run looks well
    and ends Succeeded. None below FLAT_STEPS."""
    if flat_steps < FLAT_STEPS:
        return None
    return (f"warning: every group's completions got the same reward for the last "
            f"{flat_steps} steps (frac_reward_zero_std 1.0): GRPO learns only from "
            "differences within a group, so the model is not learning — give it prompts it "
            "answers right only sometimes, raise numGenerations or temperature, or add a "
            "graded reward")


def length_figures(lengths: list[int], clipped: list[bool]) -> dict[str, float]:
    """TRL's `completions/*`: lengths (end of text included) of every completion, and of
    those that ended before maxCompletionLength."""
    ended = [n for n, cut in zip(lengths, clipped, strict=True) if not cut]
    return {"completions/mean_length": sum(lengths) / len(lengths),
            "completions/min_length": float(min(lengths)),
            "completions/max_length": float(max(lengths)),
            "completions/clipped_ratio": sum(clipped) / len(clipped),
            "completions/mean_terminated_length": sum(ended) / len(ended) if ended else 0.0,
            "completions/min_terminated_length": float(min(ended)) if ended else 0.0,
            "completions/max_terminated_length": float(max(ended)) if ended else 0.0}


@dataclass(frozen=True)
class TokenLosses:
    """A micro-batch's per-token losses and what the log reports of them."""

    losses: torch.Tensor
    """Per completion token, flattened in the batch's order."""
    kl: torch.Tensor | None
    low: torch.Tensor
    """Tokens clipped below (ratio under 1 - epsilon with a negative advantage)."""
    high: torch.Tensor
    """Tokens clipped above (ratio over 1 + epsilonHigh with a positive advantage)."""


def token_losses(logps: torch.Tensor, old: torch.Tensor | None, reference: torch.Tensor | None,
                 advantages: torch.Tensor, settings: GrpoConfig) -> TokenLosses:
    """The clipped surrogate per token, plus beta x KL (k3, times the ratio) where there is a
    reference. `old`: the sampling model's log-probabilities, None when the step is the
    round's only one (the ratio is then exactly 1, its gradient still flowing)."""
    old = logps.detach() if old is None else old
    ratio = torch.exp(logps - old)
    low, high = settings.epsilon, settings.epsilon_high or settings.epsilon
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if settings.beta != 0.0 and reference is not None:
        gap = reference - logps
        kl = (torch.exp(gap) - gap - 1) * ratio
        losses = losses + settings.beta * kl
    return TokenLosses(losses, kl, ((ratio < 1 - low) & (advantages < 0)).float(),
                       ((ratio > 1 + high) & (advantages > 0)).float())


def summed_loss(losses: torch.Tensor, sequence: torch.Tensor, completions: int,
                settings: GrpoConfig) -> torch.Tensor:
    """The micro-batch's loss summed as its `units` count it (objective.py): `dapo`, every
    token (units: the step's tokens); `grpo`, each completion's mean (units: completions);
    `dr_grpo`, tokens over maxCompletionLength (units: completions); `bnpo`, the
    micro-batch's token mean (units: micro-batches)."""
    if settings.loss == "dapo":
        return losses.sum()
    if settings.loss == "dr_grpo":
        return losses.sum() / settings.max_completion_length
    if settings.loss == "bnpo":
        return losses.sum() / max(losses.numel(), 1)
    sums = torch.zeros(completions, dtype=losses.dtype, device=losses.device).index_add(
        0, sequence, losses)
    lengths = torch.bincount(sequence, minlength=completions).clamp(min=1)
    return (sums / lengths).sum()
