"""`spec.objective.grpo`: GRPO's settings, as TRL's GRPOConfig names them (torch-free: the CRD
and the operator read them)."""

from __future__ import annotations

import difflib
import re
from typing import Literal

from pydantic import Field

from finetune_trainer.api_model import ApiModel

GrpoLoss = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
RewardScaling = Literal["group", "batch", "none"]

BUILT_IN_REWARDS = ("exact_match", "format", "math_equal", "length_penalty")
"""The verifiable rewards the trainer ships (objectives/grpo/rewards.py); any other name is a
user's function, `module:function`."""
REWARD_NAME = rf"^({'|'.join(BUILT_IN_REWARDS)}|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$"


def misnamed_reward(name: str) -> tuple[str, str]:
    """What is wrong with a reward `name` that REWARD_NAME refuses, and the fix: the
    built-in it likely misspells (as `finetune validate` suggests a misspelt field's name),
    or the `module:function` it likely means (`mine.score`); the pattern alone helps no
    one."""
    forms = f"(built-ins: {', '.join(BUILT_IN_REWARDS)}; your own: module:function)"
    close = difflib.get_close_matches(name, BUILT_IN_REWARDS, n=1)
    if close:
        return "is not a built-in reward", f"did you mean {close[0]}? {forms}"
    module, dot, function = name.rpartition(".")
    if dot and re.fullmatch(REWARD_NAME, f"{module}:{function}"):
        return ("is neither a built-in reward nor module:function",
                f"did you mean {module}:{function}? {forms}")
    return ("is neither a built-in reward nor module:function",
            f"name a built-in or your own function {forms}")


class RewardConfig(ApiModel):
    """One reward: a built-in verifiable reward or a function of your own, and its weight in
    the sum each completion is scored by."""

    name: str = Field(min_length=1, max_length=256, pattern=REWARD_NAME)
    """`exact_match`: 1 where the completion's answer (the text, or `pattern`'s first group
    of its last match) equals the record's `column`, both stripped, else 0. `format`: 1
    where the whole completion matches the regular expression `pattern`, else 0.
    `math_equal`: 1 where the completion's last mathematical answer equals `column`'s under
    math-verify (numbers, fractions, LaTeX), else 0. `length_penalty`: DAPO's soft overlong
    punishment, 0 up to `maxCompletionLength - window` tokens, then down to -1 at
    `maxCompletionLength`. Or `module:function`, your own, imported from the data's folder
    (a local or PVC dataset) or the image's Python path: called as TRL calls reward functions,
    `function(prompts=..., completions=..., completion_ids=..., **columns)`, returning a
    float (or None: not applicable) per completion. It runs inside your own job."""
    weight: float = 1.0
    """Its weight in the completion's reward (TRL's `reward_weights`)."""
    column: str = Field(default="answer", min_length=1, max_length=128)
    """`exact_match`, `math_equal`: the data's column holding each prompt's answer."""
    pattern: str | None = Field(default=None, min_length=1, max_length=1024)
    """`format`: the regular expression a whole completion must match (Python `re`, dot
    matching newlines). `exact_match`: where the answer is, its first group (`<answer>(.*?)
    </answer>`); the last match counts."""
    window: int | None = Field(default=None, ge=1)
    """`length_penalty`: the tokens before `maxCompletionLength` over which the penalty
    grows from 0 to -1 (default a quarter of `maxCompletionLength`)."""


class GrpoConfig(ApiModel):
    """Group Relative Policy Optimization (Shao et al., 2024), as TRL's GRPOConfig names it:
    each prompt is answered `numGenerations` times by the model being trained, each answer
    scored by the `rewards`, and the model moved towards the answers better than their
    group's mean."""

    num_generations: int = Field(default=8, ge=2, le=1024)
    """Completions sampled per prompt (the group). A step's completions,
    `batchSizePerDevice x gradientAccumulationSteps x` processes, must be a multiple of it."""
    max_completion_length: int = Field(default=512, ge=1, le=131_072)
    """Tokens a completion may have; one cut there is `clipped` (completions/clipped_ratio).
    A prompt may have `dataset.maxSeqLength` minus this many (longer ones keep their end)."""
    temperature: float = Field(default=1.0, gt=0, le=100)
    """Sampling temperature; the log-probabilities trained on are taken at the same one."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens whose probability reaches it (1: all)."""
    beta: float = Field(default=0.0, ge=0, le=100)
    """Weight of the KL divergence to the reference (the model before training; with
    adapters, the base with them off). 0, TRL's default: no reference is run."""
    epsilon: float = Field(default=0.2, gt=0, le=10)
    """The importance ratio is clipped to [1 - epsilon, 1 + epsilonHigh]."""
    epsilon_high: float | None = Field(default=None, gt=0, le=10)
    """The upper clip (DAPO's clip-higher, 0.28 in its paper); default `epsilon`."""
    loss: GrpoLoss = "dapo"
    """How token losses are averaged (TRL's `loss_type`). `dapo` (TRL's default): over every
    completion token of the step's global batch. `grpo`: over each completion's tokens,
    then over completions (favours short answers). `dr_grpo`: over completions x
    `maxCompletionLength` (Dr. GRPO, no length bias). `bnpo`: over each micro-batch's
    completion tokens."""
    scale_rewards: RewardScaling = "group"
    """Advantages are rewards minus their group's mean, divided by the standard deviation
    of the `group` (GRPO), of the step's whole `batch`, or `none` (Dr. GRPO)."""
    iterations: int = Field(default=1, ge=1, le=64)
    """Optimizer steps on each batch of completions (TRL's `num_iterations`, GRPO's mu):
    from the second one on, the clipped importance ratio to the model that sampled them
    matters."""
    rewards: list[RewardConfig] = Field(min_length=1, max_length=16)
    """What a completion is scored by: the weighted sum of these, each also logged
    (`rewards/<name>/mean`)."""
    log_completions: int = Field(default=2, ge=0, le=64)
    """Sampled completions printed with their rewards at every log step (0: none); at each
    log step the latest round's, every one of them, is appended to the output folder's
    `completions.jsonl`."""
