"""The sweep's pure parts: grid enumeration, seeded sampling through optuna that a restart
cannot change, the spec a trial runs, the early-termination rules, what a sweep does next
(`decide`, as a table of situations) and what it refuses (`check_sweep`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pydantic
import pytest

from finetune_operator.api import FineTuneSweep, SearchParameter
from finetune_operator.sweep import (
    Child,
    Trial,
    bandit_stop,
    check_sweep,
    child_view,
    decide,
    grid,
    median_stop,
    suggest,
    trial_manifest,
    with_params,
)
from tests.conftest import minimal_job

SPACE = {
    "hyperparameters.learningRate": SearchParameter(type="logUniform", min=1e-5, max=1e-3),
    "method.lora.r": SearchParameter(type="intRange", min=8, max=32, step=8),
    "method.lora.alpha": SearchParameter(type="choice", values=[16, 32]),
}


def test_a_grid_enumerates_every_combination_once_in_a_fixed_order():
    space = {"method.lora.r": SearchParameter(type="intRange", min=8, max=32, step=8),
             "hyperparameters.learningRate": SearchParameter(type="choice", values=[1e-4, 2e-4])}
    combinations = grid(space)
    assert combinations == [{"hyperparameters.learningRate": lr, "method.lora.r": r}
                            for lr in (1e-4, 2e-4) for r in (8, 16, 24, 32)]
    assert [suggest(space, "grid", 0, n) for n in range(9)] == [*combinations, None]


def test_a_grid_refuses_a_float_range_with_the_fix():
    with pytest.raises(ValueError, match="use type: choice"):
        grid({"hyperparameters.learningRate": SearchParameter(type="uniform", min=0.1, max=0.2)})


@pytest.mark.parametrize("sampling", ["random", "bayesian"])
def test_sampling_is_reproducible_and_a_restart_gets_the_same_trials(sampling):
    history: list[Trial] = []
    for number in range(8):
        params = suggest(SPACE, sampling, seed=7, number=number, history=history)
        lr, r = params["hyperparameters.learningRate"], params["method.lora.r"]
        assert 1e-5 <= lr <= 1e-3 and r in (8, 16, 24, 32)
        assert params["method.lora.alpha"] in (16, 32)
        loss = 1.0 + abs(lr - 2e-4) * 1000 + r / 100  # a made-up objective
        history.append(Trial(number, params, {10: loss + 0.5, 20: loss}, finished=True))
    # an operator restarted after trial 5: it asks for trial 6 again, from what was recorded
    again = suggest(SPACE, sampling, seed=7, number=6, history=history[:6])
    assert again == history[6].params
    assert len({tuple(sorted(t.params.items())) for t in history}) == 8, "no trial repeated"
    other_seed = suggest(SPACE, sampling, seed=8, number=6, history=history[:6])
    assert other_seed != again


def test_a_trial_runs_the_template_with_its_parameters_set():
    template = {"method": {"type": "lora"}, "hyperparameters": {"maxSteps": 10}}
    spec = with_params(template, {"method.lora.r": 16, "hyperparameters.learningRate": 1e-4})
    assert spec == {"method": {"type": "lora", "lora": {"r": 16}},
                    "hyperparameters": {"maxSteps": 10, "learningRate": 1e-4}}
    assert template == {"method": {"type": "lora"}, "hyperparameters": {"maxSteps": 10}}
    with pytest.raises(ValueError, match=r"type is not a section of the template"):
        with_params(template, {"method.type.x": 1})


@pytest.mark.parametrize(("parameter", "fix"), [
    ({"type": "choice"}, "list them"),
    ({"type": "uniform", "min": 1.0, "max": 1.0}, "min < max"),
    ({"type": "logUniform", "min": 0.0, "max": 1.0}, "min > 0"),
    ({"type": "logUniform", "min": -1.0, "max": 4.0},
     r"logUniform needs min > 0 \(it samples the log\), and min is -1 — e.g. min: 1e-5"),
    ({"type": "intRange", "min": 16, "max": 4},
     "intRange needs min < max, and min is 16, max is 4 — e.g. min: 4, max: 64"),
    ({"type": "intRange", "min": 1.5, "max": 4}, "whole min and max"),
])
def test_a_bad_parameter_says_how_to_write_it(parameter, fix):
    with pytest.raises(pydantic.ValidationError, match=fix):
        SearchParameter.model_validate(parameter)


def curve(*values: float) -> dict[int, float]:
    return {10 * (i + 1): v for i, v in enumerate(values)}


def test_median_stopping_ends_a_trial_worse_than_the_median_of_running_averages():
    others = [Trial(0, {}, curve(2.0, 1.6, 1.2), True),   # running average at 20: 1.8
              Trial(1, {}, curve(2.2, 1.8, 1.4), True),   # 2.0
              Trial(2, {}, curve(1.8, 1.4, 1.0), True)]   # 1.6 → median 1.8
    assert median_stop(Trial(3, {}, curve(2.4, 2.0)), others, 20, "minimize")
    assert not median_stop(Trial(4, {}, curve(2.4, 1.7)), others, 20, "minimize")
    assert not median_stop(Trial(5, {}, curve(9.0)), [], 10, "minimize")  # none to compare
    assert not median_stop(Trial(6, {}, {}), others, 20, "minimize")  # nothing reported yet
    assert median_stop(Trial(7, {}, curve(0.1, 0.2)), others, 20, "maximize")


def test_bandit_ends_a_trial_outside_the_slack_of_the_best():
    best = Trial(0, {}, curve(2.0, 1.0), True)
    assert bandit_stop(Trial(1, {}, curve(2.0, 1.2)), [best], 20, "minimize", 0.1)
    assert not bandit_stop(Trial(2, {}, curve(2.0, 1.05)), [best], 20, "minimize", 0.1)
    assert not bandit_stop(best, [], 20, "minimize", 0.1)  # the best is within its own slack
    assert bandit_stop(Trial(3, {}, curve(0.5)), [Trial(4, {}, curve(0.9))], 10,
                       "maximize", 0.2)


# --- the sweep's next step --------------------------------------------------------------------

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def sweep_doc(status=None, **spec):
    template = minimal_job(dataset={"uri": "pvc://data/train.jsonl", "evalFraction": 0.1})["spec"]
    doc = {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneSweep",
           "metadata": {"name": "lr", "namespace": "team", "uid": "u-1"},
           "spec": {"template": template, "maxTrials": 4, "parallelTrials": 2, "seed": 3,
                    "searchSpace": {"hyperparameters.learningRate": {
                        "type": "logUniform", "min": 1e-5, "max": 1e-3}}, **spec}}
    if status is not None:
        doc["status"] = status
    return doc


def step(doc, children=None, now=NOW):
    """One look: the decision, and the sweep as the patched status leaves it."""
    sweep = FineTuneSweep.model_validate(doc)
    decision = decide(sweep, children or {}, now)
    return decision, {**doc, "status": decision.status.to_dict()}


def test_a_new_sweep_records_its_first_trials_before_creating_them():
    decision, doc = step(sweep_doc())
    assert [t.name for t in decision.create] == ["lr-0", "lr-1"]  # parallelTrials
    assert [t["phase"] for t in doc["status"]["trials"]] == ["Creating", "Creating"]
    assert doc["status"]["phase"] == "Running" and doc["status"]["trialCount"] == 2
    assert [e.reason for e in decision.events] == ["TrialCreated", "TrialCreated"]
    manifest = trial_manifest(FineTuneSweep.model_validate(doc), decision.create[1])
    assert manifest["metadata"]["name"] == "lr-1"
    assert manifest["metadata"]["labels"] == {"finetune.dev/sweep": "lr",
                                              "finetune.dev/trial": "1"}
    assert manifest["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert manifest["spec"]["hyperparameters"]["learningRate"] == decision.create[1].params[
        "hyperparameters.learningRate"]
    assert manifest["spec"]["output"]["uri"] == "pvc://ckpt/demo/lr-1"


def test_a_restart_before_the_creates_makes_the_same_trials_again_and_no_new_one():
    _decision, doc = step(sweep_doc())
    again, after = step(doc)  # the watch shows no trial yet: recreate (409 if they exist)
    assert [t.name for t in again.create] == ["lr-0", "lr-1"] and not again.events
    assert after["status"]["trials"] == doc["status"]["trials"]


def test_trials_follow_their_jobs_and_a_finished_one_makes_room_for_the_next():
    _d, doc = step(sweep_doc())
    _d, doc = step(doc, {0: Child("Running", 10, 2.0), 1: Child("Running", 10, 1.5)})
    assert [p["value"] for p in doc["status"]["trials"][0]["curve"]] == [2.0]
    decision, doc = step(doc, {0: Child("Succeeded", 20, 1.2), 1: Child("Running", 20, 1.3)})
    assert [t.name for t in decision.create] == ["lr-2"]
    assert doc["status"]["best"]["name"] == "lr-0" and doc["status"]["best"]["objective"] == 1.2
    assert doc["status"]["best"]["output"] == "pvc://ckpt/demo/lr-0"
    assert doc["status"]["runningTrials"] == 2


def test_a_trial_that_stopped_early_ranks_by_its_export_and_its_curve_keeps_each_steps_own():
    """Its final record carries the best evaluation's loss (the model it exported) at the
    stopping step: the objective, not a point of the curve (a drop that never happened)."""
    def job(phase, step, eval_loss, conditions=()):
        return {"status": {"phase": phase, "conditions": list(conditions),
                           "progress": {"step": step, "evalLoss": eval_loss}}}

    _d, doc = step(sweep_doc(maxTrials=1, objective={"metric": "evalLoss"}))
    for at, value in ((10, 1.0), (20, 1.3)):
        _d, doc = step(doc, {0: child_view(job("Running", at, value), "evalLoss")})
    stopped = job("Succeeded", 20, 1.0, [{"type": "Complete", "status": "True",
                                          "reason": "StoppedEarly"}])
    _d, doc = step(doc, {0: child_view(stopped, "evalLoss")})
    trial = doc["status"]["trials"][0]
    assert trial["objective"] == 1.0 and doc["status"]["best"]["objective"] == 1.0
    assert [(p["step"], p["value"]) for p in trial["curve"]] == [(10, 1.0), (20, 1.3)]
    # a run to its last step exports that step's weights: its final loss is the step's own
    ran_out = job("Succeeded", 20, 1.1, [{"type": "Complete", "status": "True",
                                          "reason": "Succeeded"}])
    assert child_view(ran_out, "evalLoss").value_of_earlier_step is False
    assert child_view(stopped, "loss").value_of_earlier_step is False


def test_median_stopping_marks_the_trial_stopped_before_deleting_it():
    doc = sweep_doc(earlyTermination={"policy": "median", "delaySteps": 10}, parallelTrials=3)
    _d, doc = step(doc)
    decision, doc = step(doc, {0: Child("Running", 10, 1.0), 1: Child("Running", 10, 1.2),
                               2: Child("Running", 10, 3.0)})
    assert decision.delete == ["lr-2"]
    stopped = doc["status"]["trials"][2]
    assert stopped["phase"] == "Stopped" and "median stopping at step 10" in stopped["message"]
    # a restart between the status patch and the delete deletes it again; a job gone is done
    again, doc = step(doc, {0: Child("Running", 10, 1.0), 1: Child("Running", 10, 1.2),
                            2: Child("Running", 10, 3.0)})
    assert again.delete == ["lr-2"] and [t.name for t in again.create] == ["lr-3"]


def test_the_sweep_ends_with_the_best_trial_once_nothing_is_left_to_run():
    doc = sweep_doc(maxTrials=2)
    _d, doc = step(doc)
    decision, doc = step(doc, {0: Child("Succeeded", 20, 1.4), 1: Child("Failed", 5, None,
                                                                         "out of memory")})
    assert doc["status"]["phase"] == "Succeeded" and doc["status"]["best"]["name"] == "lr-0"
    assert doc["status"]["trials"][1]["message"] == "out of memory"
    assert "its model is in pvc://ckpt/demo/lr-0" in doc["status"]["message"]
    assert [e.reason for e in decision.events] == ["SweepSucceeded"]
    later, _ = step(doc, {0: Child("Succeeded", 20, 1.4)})
    assert not later.create and not later.delete and not later.events


def test_a_sweep_with_no_successful_trial_fails_and_says_where_to_look():
    _d, doc = step(sweep_doc(maxTrials=1))
    _d, doc = step(doc, {0: Child("Failed", None, None, "image pull failed")})
    assert doc["status"]["phase"] == "Failed" and "kubectl describe ftsweep" in doc["status"][
        "message"]


def test_the_time_budget_stops_the_running_trials_and_makes_no_more():
    _d, doc = step(sweep_doc(timeoutSeconds=600))
    decision, doc = step(doc, {0: Child("Running", 10, 1.0)}, NOW + timedelta(seconds=60))
    assert decision.wake_after == pytest.approx(540)
    decision, doc = step(doc, {0: Child("Running", 10, 1.0), 1: Child("Running", 10, 1.1)},
                         NOW + timedelta(seconds=601))
    assert sorted(decision.delete) == ["lr-0", "lr-1"] and not decision.create
    assert {t["phase"] for t in doc["status"]["trials"]} == {"Stopped"}
    assert doc["status"]["phase"] == "Failed"  # none finished: nothing to name best


def test_a_trial_whose_job_was_deleted_by_someone_else_fails():
    _d, doc = step(sweep_doc(maxTrials=2))
    _d, doc = step(doc, {0: Child("Running", 10, 1.0), 1: Child("Running", 10, 1.1)})
    decision, doc = step(doc, {1: Child("Running", 10, 1.1)})
    assert doc["status"]["trials"][0]["phase"] == "Failed"
    assert doc["status"]["trials"][0]["message"] == "its FineTuneJob was deleted"
    assert not decision.create  # maxTrials reached: the lost trial is not replaced


def test_a_grid_sweep_ends_at_its_last_combination():
    doc = sweep_doc(sampling="grid", maxTrials=10, parallelTrials=5,
                    searchSpace={"method.lora.r": {"type": "choice", "values": [8, 16]}})
    decision, doc = step(doc)
    assert [t.params for t in decision.create] == [{"method.lora.r": 8}, {"method.lora.r": 16}]
    _d, doc = step(doc, {0: Child("Succeeded", 20, 1.1), 1: Child("Succeeded", 20, 1.0)})
    assert doc["status"]["phase"] == "Succeeded" and doc["status"]["best"]["params"] == {
        "method.lora.r": 16}


def test_a_curve_keeps_at_most_32_points_first_and_last_among_them():
    _d, doc = step(sweep_doc(maxTrials=1))
    for s in range(1, 101):
        _d, doc = step(doc, {0: Child("Running", s, 10.0 / s)})
    curve = doc["status"]["trials"][0]["curve"]
    assert len(curve) <= 32 and curve[-1]["step"] == 100 and curve[0]["step"] == 1


# --- what a sweep refuses -------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "path", "words"), [
    ({"searchSpace": {"hyperparameters.learningRatee": {"type": "choice", "values": [1e-4]}}},
     'spec.searchSpace["hyperparameters.learningRatee"]', "did you mean `learningRate`"),
    ({"searchSpace": {"resources.nodes": {"type": "intRange", "min": 0, "max": 2}}},
     'spec.searchSpace["resources.nodes"]',
     "the value 0 makes spec.template.resources.nodes invalid"),
    ({"sampling": "grid"}, 'spec.searchSpace["hyperparameters.learningRate"]',
     "a grid cannot enumerate a logUniform range"),
    ({"searchSpace": {"method.type.x": {"type": "choice", "values": [1]}}},
     'spec.searchSpace["method.type.x"]', ': type is not a section of the template — name a'),
    # a float range on an integer field: its ends (1.0, 8.0) pass, its draws (4.5) do not
    ({"searchSpace": {"hyperparameters.batchSizePerDevice": {
        "type": "uniform", "min": 1, "max": 8}}},
     'spec.searchSpace["hyperparameters.batchSizePerDevice"]',
     "uniform draws fractions (e.g. 4.5), and spec.template.hyperparameters."
     "batchSizePerDevice takes an integer — use `type: intRange` (e.g. min: 1, max: 8)"),
    ({"searchSpace": {"method.lora.r": {"type": "logUniform", "min": 4, "max": 64}}},
     'spec.searchSpace["method.lora.r"]', "logUniform draws fractions (e.g. 11.5)"),
    ({"searchSpace": {"hyperparameters.learningRate": {
        "type": "logUniform", "min": 1e-5, "max": 1e-3, "mean": 1e-4}}},
     'spec.searchSpace["hyperparameters.learningRate"].mean',
     "remove it; known fields: type, values, min, max, step"),
    # the sweep's kind: a FineTuneJob (ftj) has no spec.template to explain
    ({"searchSpace": {"method.lora.r": {"type": "choice", "values": ["16"]}}},
     'spec.searchSpace["method.lora.r"]',
     "see `kubectl explain ftsweep.spec.template.method.lora.r`"),
    ({"objective": {"metric": "evalLoss"}, "template": minimal_job()["spec"]},
     "spec.objective.metric", "evalFraction"),
    ({"objective": {"metric": "evalLoss"}, "template": minimal_job(
        dataset={"uri": "pvc://data/prompts.jsonl", "format": "prompt", "evalFraction": 0.1},
        objective={"type": "grpo", "grpo": {"rewards": [{"name": "exact_match"}]}})["spec"]},
     "spec.objective.metric", "objective grpo's evaluation has no loss"),
    ({"template": {**minimal_job()["spec"], "resources": {"nodes": 0}}},
     "spec.template.resources.nodes", "at least 1"),
])
def test_a_bad_sweep_is_refused_naming_the_field_and_the_fix(change, path, words):
    doc = sweep_doc()
    doc["spec"].update(change)
    _sweep, problems = check_sweep(doc)
    errors = [p for p in problems if p.severity == "error"]
    assert any(p.path == path and words in str(p) for p in errors), errors


def test_a_template_problem_is_said_once_not_again_for_each_searched_value():
    doc = sweep_doc()
    doc["spec"]["template"] = {**minimal_job()["spec"], "resources": {"nodes": 0}}
    _sweep, problems = check_sweep(doc)
    assert [p.path for p in problems if p.severity == "error"] == [
        "spec.template.resources.nodes"]
    # the words name the sweep's fields too
    doc["spec"]["template"] = {**minimal_job()["spec"],
                               "hyperparameters": {"maxSteps": 10, "evalEverySteps": 5}}
    [problem] = [p for p in check_sweep(doc)[1] if p.path.startswith("spec.template")]
    assert problem.path == "spec.template.hyperparameters.evalEverySteps"
    assert "set `spec.template.dataset.evalSplit`" in problem.fix
    assert "spec.template.template" not in str(problem)
    # typed as written, as the API server types it: parsed, the sweep took "10" for 10
    doc["spec"]["template"] = {**minimal_job()["spec"], "hyperparameters": {"maxSteps": "10"}}
    [problem] = [p for p in check_sweep(doc)[1] if p.path.startswith("spec.template")]
    assert (problem.path, problem.message) == ("spec.template.hyperparameters.maxSteps",
                                               "must be an integer, got '10'"), problem
    assert "kubectl explain ftsweep.spec.template.hyperparameters.maxSteps" in problem.fix


def test_more_trials_at_once_than_in_all_is_a_warning():
    doc = sweep_doc(maxTrials=4, parallelTrials=8)
    _sweep, problems = check_sweep(doc)
    assert [(p.path, p.severity) for p in problems] == [("spec.parallelTrials", "warning")]
    assert str(problems[0]) == ("spec.parallelTrials: is 8, more than maxTrials (4): no more "
                                "than 4 trials ever run at once — set parallelTrials to 4 or "
                                "less, or raise maxTrials")


def test_a_good_sweep_passes_and_a_long_name_does_not():
    assert [p for p in check_sweep(sweep_doc())[1] if p.severity == "error"] == []
    doc = sweep_doc()
    doc["metadata"]["name"] = "a" * 44
    assert [p.path for p in check_sweep(doc)[1]] == ["metadata.name"]


def test_a_sweep_searches_dpos_beta_and_is_told_a_beta_out_of_range():
    """`objective.dpo.beta` is a field of the template like any other: searched within its
    range, and a range that leaves it is refused naming the field."""
    import yaml

    from tests.conftest import REPO

    doc = yaml.safe_load((REPO / "examples/07-sweep-lora-lr.yaml").read_text())
    template = doc["spec"]["template"]
    template["dataset"] = {"uri": "pvc://data/pairs.jsonl", "format": "preference",
                           "evalSplit": "train[95%:]", "split": "train[:95%]"}
    template["objective"] = {"type": "dpo", "dpo": {"loss": "sigmoid"}}
    doc["spec"]["searchSpace"] = {"objective.dpo.beta": {"type": "logUniform", "min": 0.01,
                                                         "max": 0.5}}
    sweep, problems = check_sweep(doc)
    assert sweep is not None and [p for p in problems if p.severity == "error"] == []
    assert with_params(template, {"objective.dpo.beta": 0.2})["objective"]["dpo"] == {
        "loss": "sigmoid", "beta": 0.2}
    doc["spec"]["searchSpace"]["objective.dpo.beta"]["max"] = 500.0
    _, problems = check_sweep(doc)
    said = [str(p) for p in problems if p.severity == "error"]
    assert any('spec.searchSpace["objective.dpo.beta"]' in p and "500" in p and
               "objective.dpo.beta" in p.split(":", 1)[1] for p in said), said
