"""Supervised fine-tuning: next-token cross-entropy on the trained tokens (the answers of
instruction and chat records, all of a text record)."""

from finetune_trainer.objectives import ObjectiveSpec

SPEC = ObjectiveSpec(
    name="sft",
    formats=("chat", "instruction", "text"),
    rows_per_sample=1,
    title="supervised fine-tuning",
    about="supervised fine-tuning, the cross-entropy of the answers (or text) in the data.",
    runtime="finetune_trainer.objectives.sft.objective:SftObjective",
)
