"""Group Relative Policy Optimization with verifiable rewards: the model answers each prompt
several times, the answers are scored by reward functions, and it is moved towards those
better than their group's mean. TRL's GRPOTrainer semantics and names
(tests/trainer/test_grpo.py holds ours to it step for step)."""

from finetune_trainer.objectives import JobRule, ObjectiveSpec, SettingsRule
from finetune_trainer.objectives.grpo.settings import REWARD_NAME, GrpoConfig, misnamed_reward


def _groups(spec, workers: int) -> str | None:
    """A step's completions make whole groups."""
    hp, grpo = spec.hyperparameters, spec.objective.grpo
    completions = hp.batch_size_per_device * hp.gradient_accumulation_steps * workers
    if grpo is None or completions % grpo.num_generations == 0:
        return None
    return (f"{hp.batch_size_per_device} x gradientAccumulationSteps "
            f"{hp.gradient_accumulation_steps} x {workers} worker{'s' if workers > 1 else ''} "
            f"is {completions} completions a step, no whole number of groups of "
            f"objective.grpo.numGenerations {grpo.num_generations}")


def _room(spec, workers: int) -> str | None:
    grpo = spec.objective.grpo
    if grpo is None or spec.dataset.max_seq_length > grpo.max_completion_length:
        return None
    return (f"{spec.dataset.max_seq_length} leaves no room for a prompt beside "
            f"objective.grpo.maxCompletionLength {grpo.max_completion_length}")


def _plans(spec) -> dict:
    """What the planner counts of sampling (operator/finetune_operator/planner)."""
    grpo, hp = spec.objective.grpo, spec.hyperparameters
    if grpo is None:
        return {}
    return {"generation_rows": hp.batch_size_per_device * hp.gradient_accumulation_steps,
            "generation_tokens": spec.dataset.max_seq_length,
            "generation_new_tokens": grpo.max_completion_length,
            "generation_every": grpo.iterations,
            "reference_forward": grpo.beta > 0,
            "reference_copy": grpo.beta > 0 and spec.method.type == "full"}


def _early_stopping(spec, workers: int) -> str | None:
    if not spec.hyperparameters.early_stopping_patience:
        return None
    return ("judges the eval loss, and objective grpo's evaluation has none (a GRPO loss "
            "centres on each group's mean reward and says nothing of progress)")


SPEC = ObjectiveSpec(
    name="grpo",
    formats=("prompt",),
    title="reinforcement learning with verifiable rewards (GRPO)",
    rows_per_sample=1,  # prompt + completion, within maxSeqLength
    about="online reinforcement learning with verifiable rewards (`dataset.format: "
    "prompt`): each prompt is answered `grpo.numGenerations` times by the model being "
    "trained, the answers scored by `grpo.rewards`, and the model moved towards the ones "
    "better than their group's mean (GRPO, as TRL's GRPOTrainer).",
    runtime="finetune_trainer.objectives.grpo.objective:GrpoObjective",
    settings=GrpoConfig,
    plans=_plans,
    job_rules=(
        JobRule("spec.hyperparameters.batchSizePerDevice", _groups,
                "make batchSizePerDevice x gradientAccumulationSteps x workers a multiple of "
                "numGenerations (batchSizePerDevice counts completions, as TRL's)"),
        JobRule("spec.dataset.maxSeqLength", _room,
                "raise maxSeqLength above maxCompletionLength by the longest prompt's tokens"),
        JobRule("spec.hyperparameters.earlyStoppingPatience", _early_stopping,
                "remove earlyStoppingPatience, and watch eval_reward (status.progress."
                "objectiveMetrics) to choose the checkpoint")),
    headline=(("reward", "reward", "{:.4f}"), ("reward_std", "reward std", "{:.4f}"),
              ("kl", "kl", "{:.4f}")),
    pattern_hints=((REWARD_NAME, misnamed_reward),),
    rules=(SettingsRule(
        "grpo.rewards",
        "self.type != 'grpo' || has(self.grpo)",
        lambda objective: objective.type != "grpo" or objective.grpo is not None,
        "is required: objective grpo scores completions by its rewards",
        "add `grpo: {rewards: [{name: exact_match, column: answer}]}` (built-ins: "
        "exact_match, format, math_equal, length_penalty; or your own `module:function`)"),
        SettingsRule(
            "grpo.rewards",
            "!has(self.grpo) || self.grpo.rewards.all(r, r.name != 'format' || "
            "has(r.pattern))",
            lambda objective: objective.grpo is None or all(
                r.name != "format" or r.pattern is not None for r in objective.grpo.rewards),
            "has a `format` reward without `pattern`",
            "add `pattern`, the regular expression a whole completion must match"),
        SettingsRule(
            "grpo.rewards",
            "!has(self.grpo) || self.grpo.rewards.all(r, self.grpo.rewards.filter(s, "
            "s.name == r.name).size() == 1)",
            lambda objective: objective.grpo is None or len(
                {r.name for r in objective.grpo.rewards}) == len(objective.grpo.rewards),
            "names a reward more than once",
            "give each reward once (its `weight` says how much it counts)")),
)
