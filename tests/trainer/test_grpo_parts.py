"""GRPO's parts on their own: the prompts' order against TRL's RepeatSampler, advantages and
figures against TRL's own functions, and what a reward function may return."""

from __future__ import annotations

import math

import pytest
import torch

from finetune_trainer.data import DataError
from finetune_trainer.objectives.grpo import loss as grpo_loss
from finetune_trainer.objectives.grpo.batches import GroupBatches
from finetune_trainer.objectives.grpo.rewards import Reward, RewardError, exact_match


@pytest.mark.parametrize(("prompts", "world", "micro", "accumulation", "iterations"), [
    (8, 1, 8, 1, 1), (7, 2, 4, 1, 1), (12, 2, 2, 2, 2), (5, 1, 4, 1, 3)])
def test_prompts_are_drawn_in_trls_repeat_sampler_order(prompts, world, micro, accumulation,
                                                        iterations):
    """Every step of three epochs: rank r answers the r-th slice of the round's completions,
    in the order GRPOTrainer's sampler and accelerate's sharding give them (incomplete last
    round dropped, `iterations` steps a round)."""
    from trl.trainer.utils import RepeatSampler

    generations = 4
    batches = GroupBatches(prompts, micro, accumulation, world, 42, generations=generations,
                           iterations=iterations)
    per_round = micro * accumulation * world // generations
    sampler = RepeatSampler(list(range(prompts)), mini_repeat_count=generations,
                            batch_size=per_round, repeat_count=iterations, shuffle=True,
                            seed=42)
    theirs = [index for _ in range(3) for index in sampler]
    share = micro * accumulation
    ours = []
    for step in range(3 * batches.steps_per_epoch):
        epoch, within = divmod(step, batches.steps_per_epoch)
        for rank in range(world):
            ours += [i for micro_batch in batches.micro_batches(epoch, within, rank)
                     for i in micro_batch]
    # TRL's dataloader yields a round's completions once per step of it; each rank reads
    # its contiguous share
    assert ours == theirs
    assert batches.steps_per_epoch == prompts // per_round * iterations
    assert len(ours) == 3 * batches.steps_per_epoch * share * world


def test_a_step_that_is_no_whole_number_of_groups_is_refused_naming_the_fields():
    with pytest.raises(DataError, match=r"a step's 6 completions \(batchSizePerDevice 3 x "
                       r"gradientAccumulationSteps 1 x 2 processes\) are no whole number of "
                       r"groups of objective.grpo.numGenerations 4"):
        GroupBatches(10, 3, 1, 2, 0, generations=4)
    with pytest.raises(DataError, match="holds 1 prompt, fewer than one step's 2"):
        GroupBatches(1, 8, 1, 1, 0, generations=4)


@pytest.mark.parametrize("scaling", ["group", "batch", "none"])
def test_advantages_and_figures_are_trls(scaling):
    """The same rewards (a None among them) through ours and TRL's formulas: advantages,
    reward, reward_std, frac_reward_zero_std and each reward's mean and std."""
    from trl.trainer.utils import nanstd

    torch.manual_seed(0)
    per_reward = torch.rand(16, 2, dtype=torch.float64)
    per_reward[3, 1] = float("nan")
    per_reward[8:12, :] = 0.5  # a group whose rewards are all alike
    per_reward[13, :] = float("nan")  # unscorable: no reward applied
    weights = [1.0, 0.5]
    scored = grpo_loss.score(per_reward, ["a", "b"], weights, 4, scaling)

    rewards = (per_reward * torch.tensor(weights, dtype=torch.float64)).nansum(dim=1)
    rewards[per_reward.isnan().all(dim=1)] = float("nan")
    mean = torch.nanmean(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    std = (nanstd(rewards).expand_as(rewards) if scaling == "batch"
           else nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4))
    advantages = rewards - mean
    if scaling != "none":
        advantages = advantages / (std + 1e-4)
    assert torch.allclose(scored.advantages, torch.nan_to_num(advantages, nan=0.0))
    assert scored.advantages[13] == 0
    figures = scored.figures
    assert figures["reward"] == pytest.approx(torch.nanmean(rewards).item())
    assert figures["reward_std"] == pytest.approx(nanstd(rewards).item())
    assert figures["frac_reward_zero_std"] == pytest.approx(
        torch.isclose(std, torch.zeros_like(std)).float().mean().item())
    assert figures["rewards/b/mean"] == pytest.approx(torch.nanmean(per_reward[:, 1]).item())
    assert figures["rewards/b/std"] == pytest.approx(nanstd(per_reward[:, 1]).item())


def _reward(function) -> Reward:
    return Reward("mine:score", 1.0, function, {})


@pytest.mark.parametrize(("returned", "problem"), [
    ([1.0, float("nan")], "returned nan for completion 1"),
    ([1.0, "yes"], "returned 'yes' for completion 1"),
    ([1.0], "returned 1 values for 2 completions"),
    (0.5, "returned float, not a list")])
def test_a_reward_returning_what_cannot_be_a_score_is_named_with_the_fix(returned, problem):
    with pytest.raises(RewardError) as refused:
        _reward(lambda **_: returned).score(["p", "p"], ["a", "b"], [[1], [2]], {})
    assert str(refused.value).startswith(f"spec.objective.grpo.rewards mine:score: {problem}")


def test_none_means_not_applicable_and_numbers_of_any_kind_count():
    scores = _reward(lambda **_: [None, torch.tensor(0.25), 1]).score(
        ["p"] * 3, ["a", "b", "c"], [[1], [2], [3]], {})
    assert math.isnan(scores[0]) and scores[1:] == [0.25, 1.0]


def test_exact_match_compares_the_answer_a_pattern_finds():
    answers = {"answer": ["42", "7", "3"]}
    assert exact_match([" 42\n", "it is 7", "3"], column="answer", pattern=None,
                       **answers) == [1.0, 0.0, 1.0]
    assert exact_match(["<a>41</a> then <a>42</a>", "<a>7</a>", "none"], column="answer",
                       pattern=r"<a>(.*?)</a>", **answers) == [1.0, 1.0, 0.0]
    with pytest.raises(RewardError, match="the data has no column 'solution'"):
        exact_match(["42"], column="solution", pattern=None, **answers)


def test_math_equal_reads_the_answer_as_math_verify_does():
    from finetune_trainer.objectives.grpo.rewards import math_equal

    assert math_equal(["It is 1/2", "$\\frac{1}{2}$", "3", "none"], column="answer",
                      answer=["0.5"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert math_equal(["3"], column="answer", answer=["no number here"]) == [None]


def _own_reward(folder, module: str, code: str) -> Reward:
    """`module:score` imported as the trainer imports a user's reward: `code` in a file
    beside the data (`folder`)."""
    import sys

    from finetune_trainer.objectives.grpo.rewards import users_own
    from finetune_trainer.objectives.grpo.settings import RewardConfig

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(code)
    path = list(sys.path)
    try:
        return users_own(RewardConfig(name=f"{module}:score"), [folder])
    finally:
        sys.path[:] = path
        sys.modules.pop(module, None)


def test_a_reward_that_raises_is_named_at_the_line_of_its_own_code(tmp_path):
    """The error arises deep in json; the message points at the user's call of it."""
    reward = _own_reward(tmp_path, "parsing_rewards", "import json\n\n\n"
                         "def score(completions, **_):\n"
                         "    return [json.loads(text) for text in completions]\n")
    with pytest.raises(RewardError) as refused:
        reward.score(["p"], ["not json"], [[1]], {})
    where = f"{tmp_path / 'parsing_rewards.py'}:5"
    assert str(refused.value) == (
        "spec.objective.grpo.rewards parsing_rewards:score: raised JSONDecodeError: Expecting "
        f"value: line 1 column 1 (char 0) at {where} — fix {where}, so that it returns a float "
        "(or None) for every completion; it is called as TRL calls reward functions, with "
        "keyword arguments prompts, completions, completion_ids and one per data column")


@pytest.mark.parametrize(("code", "problem", "fix"), [
    ("def score(completions, **_)\n    return []\n",
     "SyntaxError: expected ':' at {file}:1", "fix {file}:1"),
    ("import json\nTABLE = json.loads('nope')\n",
     "JSONDecodeError: Expecting value: line 1 column 1 (char 0) at {file}:2", "fix {file}:2"),
    ("import not_installed_anywhere\n",
     "ModuleNotFoundError: No module named 'not_installed_anywhere' at {file}:1",
     "install not_installed_anywhere on the trainer's Python path, or fix {file}:1")],
    ids=["syntax", "raises-at-import", "imports-a-missing-package"])
def test_a_reward_module_whose_own_code_fails_is_fixed_at_its_line(tmp_path, code, problem,
                                                                    fix):
    """It was found beside the data: shipping it there is no fix."""
    file = tmp_path / "broken_rewards.py"
    with pytest.raises(RewardError) as refused:
        _own_reward(tmp_path, "broken_rewards", code)
    assert str(refused.value) == (
        "spec.objective.grpo.rewards broken_rewards:score: module broken_rewards cannot be "
        f"imported: {problem.format(file=file)} — {fix.format(file=file)}")


def test_a_reward_module_not_found_is_shipped_beside_the_data(tmp_path):
    import sys

    from finetune_trainer.objectives.grpo.rewards import users_own
    from finetune_trainer.objectives.grpo.settings import RewardConfig

    path = list(sys.path)
    try:
        with pytest.raises(RewardError) as beside:
            users_own(RewardConfig(name="absent_rewards:score"), [tmp_path])
        with pytest.raises(RewardError) as nowhere:  # data from hf://: no folder
            users_own(RewardConfig(name="absent_rewards:score"), [])
    finally:
        sys.path[:] = path
    assert str(beside.value) == (
        "spec.objective.grpo.rewards absent_rewards:score: module absent_rewards cannot be "
        f"imported: no absent_rewards.py in {tmp_path} nor on the trainer's Python path — "
        "ship absent_rewards.py beside the data (the job's dataset folder), or on the "
        "trainer's Python path")
    assert str(nowhere.value).endswith(
        "no absent_rewards.py on the trainer's Python path — put absent_rewards.py on the "
        "trainer's Python path (this job's data has no folder to ship it beside)")


def test_rewards_alike_in_every_group_for_ten_steps_are_warned_of():
    """A run whose groups are each scored alike learns nothing (every advantage 0), and
    looks like a success: after FLAT_STEPS steps of it the log says so."""
    assert grpo_loss.FLAT_STEPS == 10
    assert grpo_loss.flat_rewards_warning(9) is None
    assert grpo_loss.flat_rewards_warning(10) == (
        "warning: every group's completions got the same reward for the last 10 steps "
        "(frac_reward_zero_std 1.0): GRPO learns only from differences within a group, so "
        "the model is not learning — give it prompts it answers right only sometimes, raise "
        "numGenerations or temperature, or add a graded reward")
