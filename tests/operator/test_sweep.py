"""The sweep's pure parts: grid enumeration, seeded sampling through optuna that a restart
cannot change, the spec a trial runs, and the early-termination rules."""

from __future__ import annotations

import pydantic
import pytest

from finetune_operator.sweep import (
    Parameter,
    Trial,
    bandit_stop,
    grid,
    median_stop,
    suggest,
    with_params,
)

SPACE = {
    "hyperparameters.learningRate": Parameter(type="logUniform", min=1e-5, max=1e-3),
    "method.lora.r": Parameter(type="intRange", min=8, max=32, step=8),
    "method.lora.alpha": Parameter(type="choice", values=[16, 32]),
}


def test_a_grid_enumerates_every_combination_once_in_a_fixed_order():
    space = {"method.lora.r": Parameter(type="intRange", min=8, max=32, step=8),
             "hyperparameters.learningRate": Parameter(type="choice", values=[1e-4, 2e-4])}
    combinations = grid(space)
    assert combinations == [{"hyperparameters.learningRate": lr, "method.lora.r": r}
                            for lr in (1e-4, 2e-4) for r in (8, 16, 24, 32)]
    assert [suggest(space, "grid", 0, n) for n in range(9)] == [*combinations, None]


def test_a_grid_refuses_a_float_range_with_the_fix():
    with pytest.raises(ValueError, match="use type: choice"):
        grid({"hyperparameters.learningRate": Parameter(type="uniform", min=0.1, max=0.2)})


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
    with pytest.raises(ValueError, match=r"searchSpace.method.type.x: type is not a section"):
        with_params(template, {"method.type.x": 1})


@pytest.mark.parametrize(("parameter", "fix"), [
    ({"type": "choice"}, "list them"),
    ({"type": "uniform", "min": 1.0, "max": 1.0}, "min < max"),
    ({"type": "logUniform", "min": 0.0, "max": 1.0}, "min > 0"),
    ({"type": "intRange", "min": 1.5, "max": 4}, "whole min and max"),
])
def test_a_bad_parameter_says_how_to_write_it(parameter, fix):
    with pytest.raises(pydantic.ValidationError, match=fix):
        Parameter.model_validate(parameter)


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
