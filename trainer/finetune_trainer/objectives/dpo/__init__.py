"""Direct Preference Optimization: pairs of a chosen and a rejected answer to one prompt,
scored against a reference (the model before training), TRL's DPOTrainer losses."""

from finetune_trainer.objectives import ObjectiveSpec, SettingsRule
from finetune_trainer.objectives.dpo.settings import DpoConfig

SPEC = ObjectiveSpec(
    name="dpo",
    formats=("preference",),
    title="preference tuning (DPO)",
    rows_per_sample=2,  # prompt + chosen, then prompt + rejected
    reference_forward=lambda job: (job.method.type != "full" and not  # full: a table
                                   job.objective.settings().precompute_ref_log_probs),
    about="preference tuning on pairs of a chosen and a rejected answer to one prompt "
    "(`dataset.format: preference`), against the model as it was before training (with "
    "adapters: the base, adapters switched off; with full weights: log-probabilities taken "
    "once before the first step and kept in the output folder).",
    runtime="finetune_trainer.objectives.dpo.objective:DpoObjective",
    settings=DpoConfig,
    headline=(("rewards/margins", "margin", "{:.4f}"), ("rewards/accuracies", "accuracy",
                                                         "{:.0%}")),
    rules=(SettingsRule(
        "dpo.labelSmoothing",
        "!has(self.dpo) || self.dpo.loss != 'ipo' || self.dpo.labelSmoothing == 0.0",
        lambda objective: not (objective.dpo is not None and objective.dpo.loss == "ipo"
                               and objective.dpo.label_smoothing),
        "is not used by the ipo loss",
        "remove labelSmoothing, or use `loss: sigmoid` (conservative DPO) or `loss: robust`"),),
)
