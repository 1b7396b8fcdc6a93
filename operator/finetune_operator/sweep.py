"""Hyperparameter sweeps (#18): a search space over a FineTuneJob's spec, trials sampled
through optuna, and early termination read from the trials' progress.

Pure and restart-safe by construction: trial n's parameters depend only on the sweep's
spec, its seed and the trials recorded before it (the operator keeps them in the sweep's
status), never on a sampler's state in memory; an operator restarted mid-sweep asks again
and gets the same answer. Not wired to a controller yet: the FineTuneSweep resource, its
CRD and the reconciler that creates the child FineTuneJobs come next (see the note on #18).
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, model_validator

from finetune_trainer.config import ApiModel

Sampling = Literal["grid", "random", "bayesian"]
Goal = Literal["minimize", "maximize"]
Scalar = float | int | str | bool


class Parameter(ApiModel):
    """One searched field: a choice of values, a float range (uniform or log-uniform), or
    an integer range."""

    type: Literal["choice", "uniform", "logUniform", "intRange"]
    values: list[Scalar] | None = Field(default=None, min_length=1, max_length=1000)
    """`choice`: the values to try."""
    min: float | None = None
    max: float | None = None
    step: int = Field(default=1, ge=1)
    """`intRange`: the distance between values."""

    @model_validator(mode="after")
    def _complete(self) -> Parameter:
        if self.type == "choice":
            if not self.values:
                raise ValueError("choice needs values — list them, e.g. values: [8, 16, 32]")
            return self
        if self.min is None or self.max is None or not self.min < self.max:
            raise ValueError(f"{self.type} needs min < max — e.g. min: 1e-5, max: 1e-3")
        if self.type == "logUniform" and self.min <= 0:
            raise ValueError("logUniform needs min > 0 — the log of 0 is not a number")
        if self.type == "intRange" and not (float(self.min).is_integer()
                                            and float(self.max).is_integer()):
            raise ValueError("intRange needs whole min and max — e.g. min: 4, max: 64")
        return self

    def grid_values(self) -> list[Scalar]:
        """Every value a grid tries; float ranges have none (a grid of them is a choice)."""
        if self.type == "choice":
            return list(self.values or [])
        if self.type == "intRange":
            return list(range(int(self.min), int(self.max) + 1, self.step))
        raise ValueError(f"a grid cannot enumerate a {self.type} range — use type: choice "
                         "with the values to try, or sampling: random or bayesian")

    def distribution(self) -> Any:
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )

        if self.type == "choice":
            return CategoricalDistribution(self.values)
        if self.type == "intRange":
            return IntDistribution(int(self.min), int(self.max), step=self.step)
        return FloatDistribution(self.min, self.max, log=self.type == "logUniform")


@dataclass(frozen=True)
class Trial:
    """One trial as the sweep's status records it."""

    number: int
    params: dict[str, Scalar]
    curve: dict[int, float] = field(default_factory=dict)
    """The objective by step, as the trial's progress reported it."""
    finished: bool = False
    """Ended (succeeded, failed or stopped early): its curve will not grow."""

    def best(self, goal: Goal, until: int | None = None) -> float | None:
        values = [v for s, v in self.curve.items() if until is None or s <= until]
        if not values:
            return None
        return min(values) if goal == "minimize" else max(values)


def grid(space: Mapping[str, Parameter]) -> list[dict[str, Scalar]]:
    """Every combination, in a fixed order (keys sorted, each key's values as written)."""
    keys = sorted(space)
    return [dict(zip(keys, combination, strict=True))
            for combination in itertools.product(*(space[k].grid_values() for k in keys))]


def suggest(space: Mapping[str, Parameter], sampling: Sampling, seed: int, number: int,
            history: Sequence[Trial] = (), goal: Goal = "minimize"
            ) -> dict[str, Scalar] | None:
    """Trial `number`'s parameters; None when a grid has no combination left. Random and
    Bayesian (optuna's TPE) sampling are seeded with seed + number, so the answer for a
    number never depends on what was asked before (an operator restart, a retried look)."""
    if sampling == "grid":
        combinations = grid(space)
        return combinations[number] if number < len(combinations) else None
    import optuna
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = (optuna.samplers.RandomSampler(seed=seed + number) if sampling == "random"
               else optuna.samplers.TPESampler(seed=seed + number))
    study = optuna.create_study(direction=goal, sampler=sampler)
    distributions = {key: parameter.distribution() for key, parameter in space.items()}
    for trial in history:
        value = trial.best(goal)
        if trial.finished and value is not None and math.isfinite(value):
            study.add_trial(create_trial(state=TrialState.COMPLETE, value=value,
                                         params=trial.params, distributions=distributions))
    return dict(study.ask(distributions).params)


def with_params(template: Mapping[str, Any], params: Mapping[str, Scalar]) -> dict[str, Any]:
    """The template spec with each searched field (a dotted path in the spec, camelCase as
    in a manifest: `hyperparameters.learningRate`, `method.lora.r`) set."""
    spec: dict[str, Any] = copy.deepcopy(dict(template))
    for path, value in params.items():
        node = spec
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"searchSpace.{path}: {part} is not a section of the spec")
        node[leaf] = value
    return spec


def median_stop(trial: Trial, others: Sequence[Trial], step: int, goal: Goal) -> bool:
    """Median stopping (Golovin et al., Google Vizier, as Azure ML documents it): stop a
    trial at `step` when its best value so far is worse than the median of the other
    trials' running averages up to the same step. Trials with nothing reported by then do
    not count; with none to compare, nothing stops."""
    best = trial.best(goal, until=step)
    averages = [statistics.fmean(values) for other in others
                if (values := [v for s, v in other.curve.items() if s <= step])]
    if best is None or not averages:
        return False
    median = statistics.median(averages)
    return best > median if goal == "minimize" else best < median


def bandit_stop(trial: Trial, others: Sequence[Trial], step: int, goal: Goal,
                slack_factor: float) -> bool:
    """Bandit (Azure ML's slack-factor rule): stop a trial at `step` when its best value so
    far is not within `slack_factor` of the best any trial reached by then; for a goal to
    minimize, worse than best × (1 + slack), to maximize, worse than best / (1 + slack)."""
    mine = trial.best(goal, until=step)
    theirs = [v for other in (trial, *others) if (v := other.best(goal, until=step)) is not None]
    if mine is None or not theirs:
        return False
    if goal == "minimize":
        return mine > min(theirs) * (1 + slack_factor)
    return mine < max(theirs) / (1 + slack_factor)
