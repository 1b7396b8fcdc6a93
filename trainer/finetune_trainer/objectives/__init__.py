"""Training objectives as components: what a job trains towards (`spec.objective.type`).

Each objective is a package of its own here (`sft`, `dpo`), registered under the entry-point
group `finetune_trainer.objectives` (pyproject.toml), as the operator's backends are. Its
`SPEC` (this module's `ObjectiveSpec`, torch-free) is what the operator, the planner and
`finetune validate` read: the data formats it trains on, how wide a sample's row is, whether
a reference model runs beside the policy. Its `runtime` is the trainer's side (an
`objectives.base.Objective`): preparing the records, the loss of a micro-batch and what the
log reports of it. The training loop calls that interface and never asks which objective it
has. docs/design/adding-an-objective.md says what a new one touches.

This module stays importable without torch: the operator image has no training stack.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.objectives.base import Objective

ENTRY_POINT_GROUP = "finetune_trainer.objectives"


@dataclass(frozen=True)
class SettingsRule:
    """A rule across an objective's settings, said twice from here: as the CRD's CEL rule
    (the API server refuses the manifest) and in Python (`finetune validate`, the
    operator), so the two cannot disagree in wording."""

    field: str
    """The field at fault, under spec.objective (`dpo.labelSmoothing`)."""
    cel: str
    """The rule on spec.objective as CEL (`self` is the objective section)."""
    holds: Callable[[Any], bool]
    """The same rule in Python, on the `ObjectiveConfig`."""
    says: str
    fix: str


@dataclass(frozen=True)
class JobRule:
    """A rule across the job's sections (GRPO's step of whole groups), said in Python only:
    `finetune validate` and the operator refuse the job before anything is created, and the
    trainer refuses the same at start."""

    field: str
    """The field at fault, from the spec (`spec.hyperparameters.batchSizePerDevice`)."""
    problem: Callable[[Any, int], str | None]
    """(the job's spec, its workers: nodes x processes) → what is wrong, or None."""
    fix: str


@dataclass(frozen=True)
class ObjectiveSpec:
    """What is known of an objective without torch."""

    name: str
    """`spec.objective.type`."""
    formats: tuple[str, ...]
    """The data formats (`spec.dataset.format`, `auto` resolved from the columns) it trains
    on."""
    rows_per_sample: int
    """A sample's row is this many times `maxSeqLength` wide (DPO: prompt + chosen, then
    prompt + rejected): packing's room, compiled layers' fixed width and the planner's
    activations."""
    reference_forward: Callable[[Any], bool] = lambda job: False
    """(a FineTuneJob's spec or a trainer config: each has `method` and `objective`) → a
    reference model runs forward on every batch beside the policy (DPO with adapters: the
    base, adapters off, unless its log-probabilities were taken once), for the planner's
    memory and MFU's FLOPs."""
    about: str = ""
    """What it trains towards, a sentence for `spec.objective.type`'s reference."""
    title: str = ""
    """What a model card says the model was trained with (`preference tuning (DPO)`)."""
    runtime: str = ""
    """`module:Class` of its trainer side, an `objectives.base.Objective` (imports torch)."""
    settings: type | None = None
    """Its settings section's model (an `ApiModel`), `spec.objective.<name>`; None: none."""
    rules: tuple[SettingsRule, ...] = ()
    """Rules across its settings section (`spec.objective.<name>`, named after it)."""
    plans: Callable[[Any], dict[str, Any]] | None = None
    """The planner's settings beyond a step's rows, from the job's spec (GRPO: the
    generation's KV cache and time, the reference): `TrainingSetup` fields."""
    job_rules: tuple[JobRule, ...] = ()
    """Rules across the job's sections, checked where the job's workers are known."""
    headline: tuple[tuple[str, str, str], ...] = ()
    """Which of its figures (`Objective.logged`, TRL's names) a progress line and `finetune
    status` show: (name, label, format)."""
    pattern_hints: tuple[tuple[str, Callable[[str], tuple[str, str]]], ...] = ()
    """(a settings field's `pattern`, value → (what is wrong, the fix)): what `finetune
    validate` says of a value the pattern refuses, in place of the pattern itself (GRPO: a
    misspelt reward's likely name)."""

    def formats_said(self) -> str:
        """Its formats as a message says them: `chat, instruction or text`."""
        *most, last = self.formats
        return f"{', '.join(most)} or {last}" if most else last

    def runs_reference_each_batch(self, job) -> bool:
        """`job`: a FineTuneJob's spec or a trainer config of this objective."""
        return self.reference_forward(job)

    def objective(self, config: TrainerConfig) -> Objective:
        """Its trainer side for one run (imported here: torch comes with it)."""
        module, _, name = self.runtime.partition(":")
        return getattr(importlib.import_module(module), name)(config, self)


@functools.cache
def registry() -> dict[str, ObjectiveSpec]:
    """Every registered objective by name (`spec.objective.type`), sorted: the CRD's enum
    and its rules come out the same on every machine."""
    found = {}
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        spec = point.load()
        if spec.name != point.name:
            raise RuntimeError(f"entry point {point.name} of {ENTRY_POINT_GROUP} loads the "
                               f"objective {spec.name!r}: name them alike")
        found[spec.name] = spec
    if not found:
        raise RuntimeError(f"no objective registered under {ENTRY_POINT_GROUP}: the package "
                           "is installed without its metadata (pip install the project)")
    return found


def spec_of(name: str) -> ObjectiveSpec:
    """The registered objective `name` (`spec.objective.type`)."""
    known = registry()
    if name not in known:
        raise ValueError(f"spec.objective.type {name!r} is no objective of this trainer: "
                         f"use one of {', '.join(known)}")
    return known[name]


def trains_on(fmt: str) -> list[str]:
    """The objectives that train on data of format `fmt`."""
    return [name for name, spec in registry().items() if fmt in spec.formats]
