"""What one optimizer step trains on: this rank's micro-batches, and what the loop needs to
know of the whole global batch (the count its loss is a mean over, the work it holds), the
same on every rank.

An objective makes it (`objectives.base.Objective.step_batch`): SFT and DPO from sequences
prepared before the first step, counted once (`StepCounts`); GRPO from completions it samples
at the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from finetune_trainer import flops
from finetune_trainer.data import IGNORE, GlobalBatches


class StepWork(NamedTuple):
    """What a step's global batch holds, all ranks together."""

    labels: int
    """Label tokens (what the loss trains on)."""
    inputs: int
    """Tokens through the model (prompts included, padding not)."""
    sequences: int
    attended: int
    """Query-key pairs causal attention computes within the documents (flops.attended_pairs)."""
    full_rows: int
    """The same as PaLM and torchtitan count them (flops.full_row_pairs)."""


@dataclass
class StepBatch:
    """One optimizer step of one rank."""

    micro_batches: list[dict]
    """This rank's micro-batches, as the objective's `summed` takes them (host tensors)."""
    units: int
    """What the step's loss is a mean over, all ranks together (label tokens, preference
    pairs, completions): each micro-batch's summed loss is scaled by world / units."""
    work: StepWork
    local_labels: int
    """This rank's label tokens and sequences (its Prometheus counters)."""
    local_samples: int


class StepCounts:
    """What any step's global batch holds (`StepWork`), from per-sequence counts taken
    once: identical on every rank without communicating."""

    def __init__(self, sequences, batches: GlobalBatches, units) -> None:
        self.batches = batches
        # as the loss counts them: the label of each row's first token is never predicted
        self.labels = [sum(label != IGNORE for label in s["labels"][1:]) for s in sequences]
        self.inputs = [len(s["input_ids"]) for s in sequences]
        self.attended = [flops.attended_pairs(s["position_ids"]) for s in sequences]
        self.units = [units(s) for s in sequences]

    def units_of_step(self, epoch: int, step: int) -> int:
        """What the objective's loss is a mean over in the step's global batch (label
        tokens, preference pairs)."""
        return sum(self.units[i] for i in self.batches.step_indices(epoch, step))

    def of_indices(self, micro_batches: list[list[int]]) -> int:
        return sum(self.labels[i] for indices in micro_batches for i in indices)

    def of_step(self, epoch: int, step: int) -> StepWork:
        window = self.batches.step_indices(epoch, step)
        return StepWork(labels=sum(self.labels[i] for i in window),
                        inputs=sum(self.inputs[i] for i in window), sequences=len(window),
                        attended=sum(self.attended[i] for i in window),
                        full_rows=sum(flops.full_row_pairs(self.inputs[i]) for i in window))

    def step_batch(self, key: tuple[int, int], mine: list[list[int]], micro_batches: list
                   ) -> StepBatch:
        """The step `key` (epoch, step within it) of a rank reading `mine`, collated as
        `micro_batches`."""
        return StepBatch(micro_batches, self.units_of_step(*key), self.of_step(*key),
                         self.of_indices(mine), sum(len(indices) for indices in mine))
