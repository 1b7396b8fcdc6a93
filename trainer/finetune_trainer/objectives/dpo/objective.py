"""DPO's trainer side: pairs tokenised and packed two sides to a pair, the reference's
log-probabilities (the base with its adapters off at every batch, or a table taken before
the first step of a full-weight run), the pair losses and TRL's rewards."""

from __future__ import annotations

import hashlib
import os
import time

import torch
import torch.distributed as dist

from finetune_trainer import trained_with
from finetune_trainer.data import DataError, tokenize_pairs
from finetune_trainer.layout import REFERENCE_FILE
from finetune_trainer.loss import answer_logps
from finetune_trainer.objectives.base import Objective, PreparedData, RunContext
from finetune_trainer.objectives.dpo.loss import (
    PairLosses,
    adapters_off,
    answer_lengths,
    dpo_losses,
    reference_table,
)

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
"""What a DPO log step reports of its preference pairs, TRL's names: the mean reward (beta x
log-ratio to the reference) of the chosen and of the rejected answers, their mean
difference, and the fraction of pairs whose chosen reward is higher."""

REFERENCE_OF = ("model.uri", "model.revision", "method.type", "strategy.precision")
"""What a full-weight reference table is of, besides its pairs (`DpoObjective.attach`)."""


class DpoObjective(Objective):
    """A micro-batch's summed pair losses over its preference pairs (`units`), the policy's
    answer log-probabilities with grad, the reference's without; its reward sums
    (REWARDS) for the log."""

    paired = True
    metric_names = REWARDS

    def __init__(self, config, spec) -> None:
        super().__init__(config, spec)
        self.settings = config.objective.settings()
        self.table: torch.Tensor | None = None

    def prepare(self, tokenizer, records, eval_records, fmt: str) -> PreparedData:
        """Preference pairs, train then eval numbered in one sequence of pair ids (the
        reference's table is indexed by them); a row holds up to twice maxSeqLength."""
        data = self.config.dataset
        train = tokenize_pairs(records, tokenizer, data.max_seq_length)
        if not train.samples:
            raise DataError(data.uri, "holds no preference pair", "add records with prompt, "
                            "chosen and rejected")
        evaluation = tokenize_pairs(eval_records, tokenizer, data.max_seq_length,
                                    first_id=len(train.samples))
        if data.eval_split is not None and not evaluation.samples:
            raise DataError(data.uri, f"its {data.eval_split} split holds no preference pair",
                            "add records to it, or use evalFraction")
        notes = tuple(note for part in (train, evaluation)
                      if (note := part.said(data.max_seq_length)) is not None)
        return PreparedData(self.arrange(train.samples), self.arrange(evaluation.samples),
                            notes)

    def units(self, sequence) -> int:
        """Preference pairs: the loss is a mean over them."""
        return len(sequence.get("pairs", ()))

    def summary(self, train) -> str:
        dpo = self.settings
        smoothing = (f", label smoothing {dpo.label_smoothing:g}" if dpo.label_smoothing
                     else "")
        return (f"objective dpo ({dpo.loss}, beta {dpo.beta:g}{smoothing}): "
                f"{sum(self.units(s) for s in train)} preference pairs")

    def attach(self, run: RunContext) -> None:
        """The reference of an adapter run is the base, adapters off, at every batch, or
        with `precomputeRefLogProbs` a table of every pair's log-probabilities taken of it
        before the first step; of a full-weight run, always such a table (the weights it
        was taken from change at every step). A table is kept in the output folder."""
        super().attach(run)
        if self.config.method.type == "full" or self.settings.precompute_ref_log_probs:
            self.table = self._reference_table(run)

    def _reference_table(self, run: RunContext) -> torch.Tensor:
        path = run.output_dir / REFERENCE_FILE
        digest = hashlib.sha256()
        # of these pairs, through this model at this precision: another model's table, left
        # by an earlier run in the folder, is never read as this one's
        settings = trained_with.record(self.config)
        digest.update(repr([settings[key] for key in REFERENCE_OF]).encode())
        for sequence in run.sequences:
            digest.update(repr((sequence["input_ids"], sequence["pairs"])).encode())
        fingerprint = digest.hexdigest()
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            if saved.get("fingerprint") == fingerprint:
                run.say(f"reference log-probabilities read from {path}")
                return saved["logps"]
        full = self.config.method.type == "full"
        if run.step > 0 and full:  # an adapter run's base has not moved: taken again
            raise DataError(str(path), "is missing, or was taken of other preference pairs, "
                            f"and this run resumes at step {run.step}: the reference "
                            "of a full-weight run is the model before its first step, gone "
                            "since", "restore the file, or start the run afresh (finetune "
                            "run --fresh; a FineTuneJob with a new output.uri)")
        started = time.perf_counter()
        pairs = sum(self.units(s) for s in run.sequences)
        table = reference_table(run.strategy, run.head, run.sequences, pairs,
                                run.micro_batch, run.collation, run.group, base=not full)
        if dist.get_rank() == 0:
            partial = path.with_name(path.name + ".partial")
            torch.save({"fingerprint": fingerprint, "logps": table}, partial)
            os.replace(partial, path)
        dist.barrier(group=run.group)
        run.say(f"reference log-probabilities of {pairs} preference pairs taken in "
                f"{time.perf_counter() - started:.1f} s, kept in {path}")
        return table

    def reference(self, batch) -> torch.Tensor:
        if self.table is not None:
            pairs = batch["pairs"]
            if self.table.device != pairs.device:  # once: then no host sync per batch
                self.table = self.table.to(pairs.device)
            return self.table[pairs].flatten()
        with torch.no_grad(), adapters_off(self.strategy.unwrapped()):
            return answer_logps(self.strategy.model, batch, self.head)

    def summed(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the batch's pair losses, `PairLosses.reward_sums`)."""
        reference = self.reference(batch)
        policy = answer_logps(self.strategy.model, batch, self.head)
        pairs = self.pair_losses(batch, policy, reference)
        return pairs.losses.sum(), pairs.reward_sums()

    def pair_losses(self, batch, policy, reference) -> PairLosses:
        lengths = answer_lengths(batch, policy.shape[0])
        return dpo_losses(policy, reference.to(policy.dtype), lengths, self.settings)
