"""Which prompts each rank answers at each step: TRL's RepeatSampler order, so that a run of
ours and a GRPOTrainer run with the same seed sample for the same prompts in the same places.

A step's global batch counts completions (`batchSizePerDevice x gradientAccumulationSteps x`
processes), `numGenerations` of them per prompt, each prompt's group one after the other.
A generation round draws the next prompts of the epoch's seeded permutation (an incomplete
last round is dropped, as TRL drops it) and serves `iterations` optimizer steps; rank r
answers the r-th contiguous slice of the round's completions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune_trainer.data import DataError, GlobalBatches


@dataclass(frozen=True)
class GroupBatches(GlobalBatches):
    """`GlobalBatches` for GRPO: indices are prompts, each repeated once per completion."""

    generations: int = 8
    iterations: int = 1

    def __post_init__(self) -> None:
        if self.global_batch % self.generations:
            raise DataError(
                "hyperparameters", f"a step's {self.global_batch} completions "
                f"(batchSizePerDevice {self.micro_batch} x gradientAccumulationSteps "
                f"{self.accumulation} x {self.world_size} process"
                f"{'es' if self.world_size > 1 else ''}) are no whole number of groups of "
                f"objective.grpo.numGenerations {self.generations}",
                "make batchSizePerDevice x gradientAccumulationSteps x processes a multiple "
                "of numGenerations")
        if self.prompts < self.per_round:
            raise DataError(
                "dataset", f"holds {self.prompts} prompt{'s' if self.prompts != 1 else ''}, "
                f"fewer than one step's {self.per_round} ({self.global_batch} completions "
                f"in groups of {self.generations})", "add prompts, or lower "
                "batchSizePerDevice (or raise numGenerations)")

    @property
    def prompts(self) -> int:
        return self.num_sequences

    @property
    def per_round(self) -> int:
        """Prompts a generation round answers."""
        return self.global_batch // self.generations

    @property
    def steps_per_epoch(self) -> int:
        return self.prompts // self.per_round * self.iterations

    def order(self, epoch: int) -> list[int]:
        """The epoch's permutation of the prompts: one generator seeded once, drawing one
        permutation per epoch (RepeatSampler's)."""
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(epoch):
            torch.randperm(self.prompts, generator=generator)
        return torch.randperm(self.prompts, generator=generator).tolist()

    def step_indices(self, epoch: int, step: int) -> list[int]:
        """The prompt of every completion of the step's round, all ranks, in order."""
        start = step // self.iterations * self.per_round
        return [prompt for prompt in self._order(epoch)[start:start + self.per_round]
                for _ in range(self.generations)]

    def micro_batches(self, epoch: int, step: int, rank: int) -> list[list[int]]:
        """`rank`'s slice of the round's completions, cut into its micro-steps (before the
        objective shuffles them, as TRL does, once they are sampled)."""
        share = self.micro_batch * self.accumulation
        mine = self.step_indices(epoch, step)[rank * share:(rank + 1) * share]
        return [mine[i * self.micro_batch:(i + 1) * self.micro_batch]
                for i in range(self.accumulation)]

    def idle_ranks(self) -> int:
        return 0
