"""Hyperparameter sweeps: what a FineTuneSweep does next, decided from its status and what
the watch shows of its trials' FineTuneJobs (`decide`, pure and table-tested), with trials
sampled through optuna and early termination read from the trials' progress.

Restart-safe by construction: trial n's parameters depend only on the sweep's spec, its seed
and the trials recorded before it, never on a sampler's state in memory; and a trial is
recorded in the sweep's status (the journal) before its FineTuneJob `<sweep>-<n>` is
created, and marked stopped before it is deleted. An operator restarted anywhere in between
finds the record and finishes the step; creating a name that exists is a no-op.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from finetune_operator.api import (
    KIND,
    MAX_NAME_LENGTH,
    MAX_SWEEP_NAME_LENGTH,
    SWEEP_KIND,
    TERMINAL_PHASES,
    BestTrial,
    CurvePoint,
    FineTuneSweep,
    FineTuneSweepStatus,
    Goal,
    Sampling,
    Scalar,
    SearchParameter,
    TrialStatus,
)
from finetune_operator.backends import check_manifest
from finetune_operator.reasons import CompleteReason, ConditionType, SweepReason
from finetune_operator.reconcile import Event
from finetune_operator.validation import (
    Problem,
    field_path,
    in_sweep_template,
    structural_problem,
)


def grid_values(parameter: SearchParameter) -> list[Scalar]:
    """Every value a grid tries; float ranges have none (a grid of them is a choice)."""
    if parameter.type == "choice":
        return list(parameter.values or [])
    if parameter.type == "intRange":
        return list(range(int(parameter.min or 0), int(parameter.max or 0) + 1, parameter.step))
    raise ValueError(f"a grid cannot enumerate a {parameter.type} range — use type: choice "
                     "with the values to try, or sampling: random or bayesian")


def distribution(parameter: SearchParameter) -> Any:
    from optuna.distributions import (  # optuna: ~150 ms, only where a sweep samples
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if parameter.type == "choice":
        return CategoricalDistribution(parameter.values)
    low, high = parameter.min or 0.0, parameter.max or 0.0
    if parameter.type == "intRange":
        return IntDistribution(int(low), int(high), step=parameter.step)
    return FloatDistribution(low, high, log=parameter.type == "logUniform")


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


def grid(space: Mapping[str, SearchParameter]) -> list[dict[str, Scalar]]:
    """Every combination, in a fixed order (keys sorted, each key's values as written)."""
    keys = sorted(space)
    return [dict(zip(keys, combination, strict=True))
            for combination in itertools.product(*(grid_values(space[k]) for k in keys))]


def suggest(space: Mapping[str, SearchParameter], sampling: Sampling, seed: int, number: int,
            history: Sequence[Trial] = (), goal: Goal = "minimize"
            ) -> dict[str, Scalar] | None:
    """Trial `number`'s parameters; None when a grid has no combination left. Random and
    Bayesian (optuna's TPE) sampling are seeded with seed + number, so the answer for a
    number never depends on what was asked before (an operator restart, a retried look)."""
    if sampling == "grid":
        combinations = grid(space)
        return combinations[number] if number < len(combinations) else None
    import optuna  # optuna: ~150 ms, only where a sweep samples
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = (optuna.samplers.RandomSampler(seed=seed + number) if sampling == "random"
               else optuna.samplers.TPESampler(seed=seed + number))
    study = optuna.create_study(direction=goal, sampler=sampler)
    distributions = {key: distribution(parameter) for key, parameter in space.items()}
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
                raise ValueError(f"{part} is not a section of the template")
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


# --- the sweep's next step -----------------------------------------------------------------

LABEL = "finetune.dev/sweep"
"""On each trial's FineTuneJob: the sweep it belongs to."""
TRIAL_LABEL = "finetune.dev/trial"
"""On each trial's FineTuneJob: its number."""
ENDED = frozenset({*TERMINAL_PHASES, "Stopped"})
"""A trial in one of these phases will not change any more."""
CURVE_POINTS = 32
"""Points kept per trial curve: the status of a 1,000-trial sweep must fit in etcd."""


@dataclass(frozen=True)
class Child:
    """What the watch last showed of a trial's FineTuneJob."""

    phase: str | None = None
    step: int | None = None
    value: float | None = None
    """The objective's metric at `step`."""
    message: str | None = None
    value_of_earlier_step: bool = False
    """`value` is an earlier evaluation's: a run that stopped early exports (and reports
    the eval loss of) its best evaluation, not its last step."""


def child_view(body: Mapping[str, Any], metric: str) -> Child:
    """A trial's FineTuneJob, as `decide` reads it."""
    status = body.get("status") or {}
    progress = status.get("progress") or {}
    value = progress.get(metric)
    stopped_early = any(c.get("type") == ConditionType.COMPLETE
                        and c.get("reason") == CompleteReason.STOPPED_EARLY
                        for c in status.get("conditions") or ())
    return Child(phase=status.get("phase"), step=progress.get("step"),
                 value=float(value) if isinstance(value, (int, float)) else None,
                 message=status.get("message"),
                 value_of_earlier_step=stopped_early and metric == "evalLoss")


@dataclass
class SweepDecision:
    """The sweep's new status (patched first: the journal), then the trials' FineTuneJobs to
    create and the ones to delete, and the events to post."""

    status: FineTuneSweepStatus
    create: list[TrialStatus] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    wake_after: float | None = None
    """Seconds until the time budget runs out (nothing else wakes a sweep on a clock)."""


def decide(sweep: FineTuneSweep, children: Mapping[int, Child], now: datetime
           ) -> SweepDecision:
    """The sweep's next step from its recorded trials and the FineTuneJobs `children` shows
    (by trial number): follow each trial, stop the ones early termination or the budget
    rejects, make new ones up to `parallelTrials` and `maxTrials`, name the best, and end
    once nothing runs and nothing is left to make."""
    spec = sweep.spec
    status = (sweep.status or FineTuneSweepStatus()).model_copy(deep=True)
    decision = SweepDecision(status)
    if status.phase in TERMINAL_PHASES:  # ended: only a stop a restart interrupted is left
        decision.delete = [t.name for t in status.trials
                           if t.phase == "Stopped" and t.number in children]
        return decision
    status.start_time = status.start_time or now
    status.phase = status.phase or "Running"
    for trial in status.trials:
        _follow(trial, children.get(trial.number), decision)
    _terminate_early(sweep, decision)
    spent = (now - status.start_time).total_seconds()
    out_of_time = spec.timeout_seconds is not None and spent >= spec.timeout_seconds
    if out_of_time:
        for trial in _active(status):
            _stop(trial, f"the sweep's time budget (timeoutSeconds: {spec.timeout_seconds}) "
                  "ran out", decision)
    elif spec.timeout_seconds is not None:
        decision.wake_after = spec.timeout_seconds - spent
    exhausted = out_of_time or not _make_trials(sweep, decision)
    status.best = _best(status.trials, spec.objective.goal)
    status.trial_count = len(status.trials)
    status.running_trials = len(_active(status))
    if status.phase == "Running" and exhausted and not status.running_trials:
        _finish(sweep, decision, now)
    return decision


def _follow(trial: TrialStatus, child: Child | None, decision: SweepDecision) -> None:
    if trial.phase in ENDED:
        if trial.phase == "Stopped" and child is not None:
            decision.delete.append(trial.name)  # marked before a restart could delete it
        return
    if child is None:
        if trial.phase == "Creating":
            decision.create.append(trial)  # recorded, maybe created (a name that exists: ok)
        else:
            trial.phase, trial.message = "Failed", "its FineTuneJob was deleted"
        return
    trial.phase = child.phase or "Pending"  # type: ignore[assignment]
    if child.step is not None and child.value is not None and math.isfinite(child.value):
        trial.step, trial.objective = child.step, child.value
        if not child.value_of_earlier_step:  # the curve's points are each step's own
            _record(trial, child.step, child.value)
    if trial.phase == "Failed":
        trial.message = child.message


def _record(trial: TrialStatus, step: int, value: float) -> None:
    """Add a point to the curve (the newest value of a step wins); past CURVE_POINTS, every
    other older point goes."""
    points = [p for p in trial.curve if p.step != step] + [CurvePoint(step=step, value=value)]
    points.sort(key=lambda p: p.step)
    if len(points) > CURVE_POINTS:
        points = points[:-1][::2] + points[-1:]
    trial.curve = points


def _active(status: FineTuneSweepStatus) -> list[TrialStatus]:
    return [t for t in status.trials if t.phase not in ENDED]


def _stop(trial: TrialStatus, why: str, decision: SweepDecision) -> None:
    trial.phase, trial.message = "Stopped", why
    decision.delete.append(trial.name)
    decision.events.append(Event("Normal", SweepReason.TRIAL_STOPPED, f"{trial.name}: {why}"))


def as_trial(trial: TrialStatus) -> Trial:
    return Trial(trial.number, dict(trial.params), {p.step: p.value for p in trial.curve},
                 finished=trial.phase in ENDED)


def _terminate_early(sweep: FineTuneSweep, decision: SweepDecision) -> None:
    rule = sweep.spec.early_termination
    goal, metric = sweep.spec.objective.goal, sweep.spec.objective.metric
    if rule.policy == "none":
        return
    trials = decision.status.trials
    for trial in _active(decision.status):
        if trial.step is None or trial.step < rule.delay_steps:
            continue
        mine = as_trial(trial)
        others = [as_trial(t) for t in trials if t is not trial and t.curve]
        stop = (median_stop(mine, others, trial.step, goal) if rule.policy == "median"
                else bandit_stop(mine, others, trial.step, goal, rule.slack_factor))
        if stop:
            _stop(trial, f"{rule.policy} stopping at step {trial.step}: its best {metric} "
                  f"{mine.best(goal):.4g} is behind the other trials'", decision)


def _make_trials(sweep: FineTuneSweep, decision: SweepDecision) -> bool:
    """Record new trials up to the limits; False when no trial is left to make."""
    spec, status = sweep.spec, decision.status
    history = [as_trial(t) for t in status.trials]
    while len(status.trials) < spec.max_trials:
        if len(_active(status)) >= spec.parallel_trials:
            return True
        number = len(status.trials)
        params = suggest(spec.search_space, spec.sampling, spec.seed, number, history,
                         spec.objective.goal)
        if params is None:  # a grid's last combination was made
            return False
        name = f"{sweep.name}-{number}"
        trial = TrialStatus(number=number, name=name, params=params,
                            output=f"{spec.template.output.uri.rstrip('/')}/{name}")
        status.trials.append(trial)
        decision.create.append(trial)
        decision.events.append(Event("Normal", SweepReason.TRIAL_CREATED, f"{name}: " + ", ".join(
            f"{k}={v}" for k, v in params.items())))
    return False


def _best(trials: Sequence[TrialStatus], goal: Goal) -> BestTrial | None:
    done = [t for t in trials if t.phase == "Succeeded" and t.objective is not None]
    if not done:
        return None
    pick = min if goal == "minimize" else max
    best = pick(done, key=lambda t: t.objective)  # type: ignore[arg-type, return-value]
    return BestTrial(number=best.number, name=best.name, objective=best.objective,
                     params=dict(best.params), output=best.output)


def _finish(sweep: FineTuneSweep, decision: SweepDecision, now: datetime) -> None:
    status, metric = decision.status, sweep.spec.objective.metric
    status.completion_time = now
    if status.best is not None:
        status.phase = "Succeeded"
        status.message = (f"best of {status.trial_count} trials: {status.best.name}, "
                          f"{metric} {status.best.objective:.4g}; its model is in "
                          f"{status.best.output}")
        decision.events.append(Event("Normal", SweepReason.SWEEP_SUCCEEDED, status.message))
    else:
        status.phase = "Failed"
        status.message = (f"none of {status.trial_count} trials succeeded with {metric} "
                          "figures to compare — see the trials' messages (kubectl describe "
                          "ftsweep)")
        decision.events.append(Event("Warning", SweepReason.SWEEP_FAILED, status.message))


def trial_manifest(sweep: FineTuneSweep, trial: TrialStatus) -> dict[str, Any]:
    """Trial `trial`'s FineTuneJob: the template with its parameters set, writing to its own
    output folder, owned by the sweep (deleting the sweep deletes its trials)."""
    spec = with_params(sweep.spec.template.to_dict(), trial.params)
    spec.setdefault("output", {})["uri"] = trial.output
    meta = sweep.metadata
    return {
        "apiVersion": sweep.api_version, "kind": "FineTuneJob",
        "metadata": {
            "name": trial.name, "namespace": sweep.namespace,
            "labels": {LABEL: sweep.name, TRIAL_LABEL: str(trial.number)},
            "ownerReferences": [{"apiVersion": sweep.api_version, "kind": sweep.kind,
                                 "name": meta.name, "uid": meta.uid, "controller": True}],
        },
        "spec": spec,
    }


# --- admission -----------------------------------------------------------------------------

def check_sweep(doc: Any) -> tuple[FineTuneSweep | None, list[Problem]]:
    """Every problem with a FineTuneSweep manifest, each naming its field and the fix, and
    the sweep if it parsed: its own fields, its template as a FineTuneJob's spec (by the
    same rules the operator admits a job with), and every searched field's extreme values
    (and a fraction a float range draws) set into the template, so no trial is made that
    its own admission would refuse."""
    if not isinstance(doc, dict) or doc.get("kind") != SWEEP_KIND:
        return None, [Problem("kind", "is not FineTuneSweep", f"use `kind: {SWEEP_KIND}`")]
    try:
        sweep = FineTuneSweep.model_validate(doc, by_alias=True, by_name=False)  # as decoded
    except ValidationError as error:
        return None, [structural_problem(e, FineTuneSweep) for e in error.errors()]
    problems: list[Problem] = []
    if len(sweep.name) > MAX_SWEEP_NAME_LENGTH:
        problems.append(Problem("metadata.name", f"is {len(sweep.name)} characters, the limit "
                                f"is {MAX_SWEEP_NAME_LENGTH}", "shorten it: trials are named "
                                f"<sweep>-<n> and a FineTuneJob's name takes {MAX_NAME_LENGTH}"))
    template = sweep.spec.template.to_dict()
    # the template as written, as the API server types it (a job's spec): parsed, the sweep
    # has taken `maxSteps: "200"` for 200, which `kubectl apply` refuses
    own = _as_template(_job_problems(sweep, doc["spec"]["template"], sweep.spec.max_trials - 1))
    problems += own
    if sweep.spec.parallel_trials > sweep.spec.max_trials:
        problems.append(Problem(
            "spec.parallelTrials", f"is {sweep.spec.parallel_trials}, more than maxTrials "
            f"({sweep.spec.max_trials}): no more than {sweep.spec.max_trials} trials ever run "
            "at once", f"set parallelTrials to {sweep.spec.max_trials} or less, or raise "
            "maxTrials", "warning"))
    if sweep.spec.template.output.export:
        problems.append(Problem("spec.template.output.export", "would have every trial push "
                                "to the same tags", "remove it, and push the best trial's "
                                "output with `finetune export` once the sweep has ended"))
    if sweep.spec.objective.metric == "evalLoss" and sweep.spec.template.objective.type == "grpo":
        problems.append(Problem("spec.objective.metric", "is evalLoss, and objective grpo's "
                                "evaluation has no loss (it reports eval_reward)", "sweep a "
                                "GRPO job by hand for now: compare the trials' status.progress."
                                "objectiveMetrics.eval_reward"))
    elif sweep.spec.objective.metric == "evalLoss" and not sweep.spec.template.dataset.evaluated:
        problems.append(Problem("spec.objective.metric", "evalLoss needs an eval split, and "
                                "the template has none", "set spec.template.dataset.evalSplit "
                                "(e.g. validation) or evalFraction (e.g. 0.05), or "
                                "objective.metric: loss"))
    for path, parameter in sweep.spec.search_space.items():
        where = field_path(("spec", "searchSpace", path))
        if sweep.spec.sampling == "grid":
            try:
                grid_values(parameter)
            except ValueError as error:
                problems.append(Problem(where, *str(error).split(" — ", 1)))
        for value in _values_to_try(parameter):
            try:
                spec = with_params(template, {path: value})
            except ValueError as error:
                problems.append(Problem(where, str(error), "name a field of the template, "
                                        "camelCase, e.g. hyperparameters.learningRate"))
                break
            # the template's own problems are said once, above, not again for each value
            found = [p for p in _as_template(_job_problems(sweep, spec, 0))
                     if p.severity == "error" and p not in own]
            problems += [_made_invalid(where, parameter, value, p) for p in found]
            if found:
                break
    return sweep, problems


def _values_to_try(parameter: SearchParameter) -> list[Scalar]:
    """Every choice; a range's ends; and for a float range, a value between that is not
    whole, as its draws are: an integer field takes 1.0 and 8.0, and refuses 4.5."""
    if parameter.type == "choice":
        return list(parameter.values or [])
    if parameter.type == "intRange":
        return [int(parameter.min or 0), int(parameter.max or 0)]
    low, high = parameter.min or 0.0, parameter.max or 0.0
    between = (low + high) / 2
    while between.is_integer() and low < between:
        between = (low + between) / 2
    return [low, high, between]


def _made_invalid(where: str, parameter: SearchParameter, value: Scalar,
                  problem: Problem) -> Problem:
    """A trial's problem with a searched value, as the searched field's. A float range on an
    integer field (structural_problem's `must be an integer`) gets the fix of its type."""
    if parameter.type in ("uniform", "logUniform") and problem.message.startswith(
            "must be an integer"):
        low, high = math.ceil(parameter.min or 0), math.floor(parameter.max or 0)
        return Problem(where, f"{parameter.type} draws fractions (e.g. {value!r}), and "
                       f"{problem.path} takes an integer", "use `type: intRange` (e.g. min: "
                       f"{low}, max: {high}) or `type: choice` with the values to try"
                       if low < high else "use `type: choice` with the values to try")
    return Problem(where, f"the value {value!r} makes {problem.path} invalid: "
                   f"{problem.message}", problem.fix)


def _job_problems(sweep: FineTuneSweep, spec: dict[str, Any], number: int) -> list[Problem]:
    _job, problems = check_manifest({
        "apiVersion": sweep.api_version, "kind": KIND, "spec": spec,
        "metadata": {"name": f"{sweep.name}-{number}", "namespace": sweep.namespace,
                     # Kueue's label on the sweep queues its trials no more than on a job
                     "labels": sweep.metadata.labels,
                     "annotations": sweep.metadata.annotations}})
    return problems


def _as_template(problems: list[Problem]) -> list[Problem]:
    """A trial's problems as the sweep's: `spec.x` is `spec.template.x`, in the path and in
    the words; its name is the sweep's."""
    return [replace(p, path=in_sweep_template(p.path), message=in_sweep_template(p.message),
                    fix=in_sweep_template(p.fix)) for p in problems
            if not p.path.startswith("metadata.name")]
