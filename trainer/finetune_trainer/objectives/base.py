"""The trainer's side of an objective: the interface the training loop calls.

torchtitan's shape: the loop knows one loss interface and never which loss it has. An
objective prepares its records into sequences (before the process group exists), may take
what it needs once the model is built (`attach`: DPO's reference table), and turns a
micro-batch into its summed loss (`summed`, training and evaluation alike), whose mean is
over `units` (label tokens, preference pairs) summed over the step's global batch: every rank
knows that count before the forward pass, so normalising needs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from finetune_trainer.data import (
    IGNORE,
    DataError,
    GlobalBatches,
    one_per_sequence,
    pack,
    pack_in_order,
    rank_batches,
)
from finetune_trainer.objectives import trains_on
from finetune_trainer.record import headline
from finetune_trainer.step_batch import StepBatch, StepCounts

if TYPE_CHECKING:
    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.objectives import ObjectiveSpec

PACKERS = {"best-fit": pack, "next-fit": pack_in_order}


@dataclass
class PreparedData:
    """An objective's sequences, ready for `GlobalBatches` and `collate`."""

    train: list[dict[str, list[int]]]
    eval: list[dict[str, list[int]]]
    notes: tuple[str, ...] = ()
    """What the log says of the data beyond its sources (preference pairs truncated)."""


@dataclass
class Evaluation:
    """What an evaluation of the held-out data found: the objective's loss over it (what
    early stopping judges; None where the objective has none that says anything) and its
    figures (TRL's names, without their `eval_` prefix)."""

    loss: float | None
    figures: dict[str, float] = field(default_factory=dict)

    def said(self) -> str:
        """`loss 1.2345`, or the headline figures (`reward 0.5000, reward std 0.1000`)."""
        parts = [] if self.loss is None else [f"loss {self.loss:.4f}"]
        parts += [f"{label} {shown.format(value)}"
                  for label, value, shown in headline(self.figures)]
        return ", ".join(parts) or "nothing to report"


@dataclass
class RunContext:
    """What an objective may use of the run once the model is built (`Objective.attach`)."""

    strategy: Any
    head: Any
    """The fused loss head (loss.install), or None: the logits are computed whole."""
    collation: Any
    group: Any
    """The CPU process group (gloo) for agreement without a device sync."""
    micro_batch: int
    output_dir: Path
    step: int
    """The step the run starts from (0, or the resumed checkpoint's)."""
    sequences: list = field(default_factory=list)
    """Training then evaluation sequences."""
    say: Any = print
    batches: GlobalBatches | None = None
    """Which sequences each rank reads at each step (`Objective.batches`)."""
    train: list = field(default_factory=list)
    """The training sequences (`PreparedData.train`)."""
    pin: bool = False
    """Host tensors go to a GPU: pin them (`Objective.load`)."""


class Objective:
    """Base of every objective's trainer side: SFT's defaults where one has nothing to add."""

    base_dir: Path | None = None
    """Where the trainer config's relative paths start (set by the preflight): `--base-dir`,
    else the config file's folder (the working directory for a config passed inline)."""
    paired = False
    """Collation: each trained position's answer (and each pair's id) goes with the batch."""
    metric_names: tuple[str, ...] = ()
    """What `summed`'s second value sums, by name, in order (DPO: record.REWARDS); a log
    step reports each as its mean over the window's `units`."""

    def __init__(self, config: TrainerConfig, spec: ObjectiveSpec) -> None:
        self.config, self.spec = config, spec
        self.reference_each_batch = spec.runs_reference_each_batch(config)
        """A reference runs forward beside the policy on every batch (MFU counts it)."""
        self.width = spec.rows_per_sample * config.dataset.max_seq_length
        """The widest row a sample makes (compiled layers pad every row to it)."""

    def check_format(self, fmt: str) -> None:
        """The data's format is one this objective trains on (`auto` is only resolved from
        the columns, so this is checked again where the records are read)."""
        if fmt in self.spec.formats:
            return
        others = [name for name in trains_on(fmt) if name != self.spec.name]
        fix = (f"set spec.objective.type to {' or '.join(others)}, or " if others else "")
        formats = self.spec.formats_said()
        raise DataError(self.config.dataset.uri, f"is laid out as {fmt}, and objective "
                        f"{self.spec.name} trains on {formats} data",
                        f"{fix}lay the data out as {formats} records (spec.dataset.format)")

    def prepare(self, tokenizer, records, eval_records, fmt: str) -> PreparedData:
        raise NotImplementedError

    def arrange(self, samples: list[dict[str, list[int]]]) -> list[dict[str, list[int]]]:
        """Samples packed into rows of `width` (spec.dataset.packing), else one a row."""
        if not self.config.dataset.packing:
            return one_per_sequence(samples)
        return PACKERS[self.config.benchmark.packer](samples, max_length=self.width)

    def units(self, sequence: dict[str, list[int]]) -> int:
        """What the loss is a mean over, in one sequence: its trained tokens (the label of
        a row's first token is never predicted)."""
        return sum(label != IGNORE for label in sequence["labels"][1:])

    def batches(self, count: int, micro_batch: int, accumulation: int, world: int,
                seed: int) -> GlobalBatches:
        """Which of the `count` training sequences each rank reads at each step."""
        return GlobalBatches(count, micro_batch, accumulation, world, seed)

    def attach(self, run: RunContext) -> None:
        """Take what the loss needs of the built model: the strategy and the fused head;
        count the steps' work once."""
        self.strategy, self.head, self.run = run.strategy, run.head, run
        self.counts = StepCounts(run.train, run.batches, self.units)

    def load(self, sequences: list[list[dict[str, list[int]]]]) -> list:
        """A step's micro-batches of sequences as host tensors: called a step ahead, on a
        thread where the device computes asynchronously, so nothing here touches the
        model."""
        tensors = [self.run.collation.tensors(micro) for micro in sequences]
        if self.run.pin:
            tensors = [{k: v.pin_memory() for k, v in batch.items()} for batch in tensors]
        return tensors

    def step_batch(self, key: tuple[int, int], mine: list[list[int]], loaded) -> StepBatch:
        """The step `key` (epoch, step within it): this rank read `mine` (sequence indices),
        `load` made `loaded` of them. On the training thread: an objective may run the
        model here (GRPO samples its completions)."""
        return self.counts.step_batch(key, mine, loaded)

    def summed(self, batch):
        """(the micro-batch's summed loss, the sums of `metric_names` or None)."""
        raise NotImplementedError

    def evaluate(self, sequences: list[dict[str, list[int]]]) -> Evaluation | None:
        """The held-out `sequences` (PreparedData.eval) at the weights as they are (None:
        there are none). Here: the objective's mean loss over them (per label token, per
        preference pair); every rank runs the same number of batches, so collectives inside
        the forward stay in step. Collective."""
        if not sequences:
            return None
        run, strategy = self.run, self.strategy
        strategy.model.eval()
        total, units = 0.0, 0
        with torch.no_grad():
            for mine in rank_batches(sequences, run.micro_batch, dist.get_world_size(),
                                     dist.get_rank()):
                batch = {k: v.to(strategy.device, non_blocking=True)
                         for k, v in run.collation.tensors(mine).items()}
                with strategy.autocast():
                    total += float(self.summed(batch)[0])
                units += sum(self.units(s) for s in mine)
        strategy.model.train()
        sums = torch.tensor([total, units], dtype=torch.float64)
        dist.all_reduce(sums, group=run.group)
        return Evaluation(float(sums[0] / max(float(sums[1]), 1.0)))

    def logged(self, sums: list[float], units: int) -> dict[str, float] | None:
        """What a log step reports of the objective beyond its loss, from the window's
        `metric_names` sums and `units`, all ranks summed (every rank calls it: collectives
        on the CPU group are allowed)."""
        if not self.metric_names:
            return None
        per = max(units, 1)
        return {name: value / per for name, value in zip(self.metric_names, sums, strict=True)}

    def state_dict(self) -> dict:
        """What this rank's objective must carry across a restart to train on exactly as
        the uninterrupted run would, saved in each checkpoint (empty: nothing; tensors,
        numbers, strings, lists and dicts only, as `torch.load(weights_only=True)` reads)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back `state_dict`'s state of the checkpoint resumed, after `attach`."""

    def summary(self, train: list[dict[str, list[int]]]) -> str | None:
        """The log's line on the objective before the first step (None: nothing to say)."""
        return None
