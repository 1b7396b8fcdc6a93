"""GRPO for real: `finetune run` with `objective: grpo` on 1 and 2 CPU processes over gloo,
against TRL's GRPOTrainer step for step, and what a bad reward function does to a run.

The peer (tests/support/trl_grpo_peer.py) trains the same tiny model on the same prompts
with the same settings and rewards, its adapters made as ours are and each generation round
seeded as ours (`generation_seed`). Six prompts, two a step (8 completions in groups of 4):
10 steps cross three epochs, so the order prompts are drawn in is compared too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support import waits
from tests.trainer.test_dpo import records
from tests.trainer.test_training import finetune_run

pytestmark = pytest.mark.process
PEER = REPO / "tests/support/trl_grpo_peer.py"
GENERATIONS, MAX_COMPLETION, TEMPERATURE = 4, 8, 0.9
VOWELS = '''def vowel_share(completions, **_):
    """A reward with spread: the share of a completion's characters that are vowels."""
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in completions]
'''


def prompts(where: Path) -> Path:
    """Six arithmetic prompts with their answers, and a reward module of the user's own
    beside them (`letters:vowel_share`)."""
    where.mkdir(parents=True, exist_ok=True)
    data = where / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?",
                                        "answer": str(a + b)}) + "\n"
                            for a, b in ((1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (4, 0))))
    (where / "letters.py").write_text(VOWELS)
    return data


def grpo_manifest(model_dir: Path, data: Path, output: Path, *, method: str = "lora",
                  strategy: str = "ddp", processes: int = 1, steps: int = 10,
                  loss: str = "dapo", beta: float = 0.0, lr: float | None = None,
                  iterations: int = 1,
                  rewards: list[dict] | None = None) -> dict:
    spec = {
        "model": {"uri": str(model_dir)},
        "dataset": {"uri": str(data), "maxSeqLength": 64},
        "method": {"type": method},
        "objective": {"type": "grpo", "grpo": {
            "numGenerations": GENERATIONS, "maxCompletionLength": MAX_COMPLETION,
            "temperature": TEMPERATURE, "beta": beta, "loss": loss, "iterations": iterations,
            "rewards": rewards or [{"name": "exact_match"}, {"name": "letters:vowel_share"}]}},
        "strategy": {"type": strategy, "precision": "fp32", "gradientCheckpointing": False},
        "hyperparameters": {"maxSteps": steps, "batchSizePerDevice": 8 // processes,
                            "learningRate": lr or (2e-2 if method == "lora" else 2e-3),
                            "logEverySteps": 1, "warmupRatio": 0.0},
        "resources": {"gpusPerNode": 0, "processesPerNode": processes},
        "output": {"uri": str(output), "checkpointEverySteps": 100},
    }
    if method == "lora":
        spec["method"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    return {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": f"grpo-{strategy}-{method}"}, "spec": spec}


def completions_by_step(rows: list[dict]) -> dict[int, list[str]]:
    out = defaultdict(list)
    for row in rows:
        out[row["step"]].append(row["completion"])
    return dict(out)


def trl_steps(model_dir: Path, data: Path, where: Path, *, method: str, processes: int,
              steps: int, loss: str, beta: float, lr: float, iterations: int
              ) -> tuple[list[dict], list[dict]]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(processes)] if processes > 1 else [sys.executable])
    where.mkdir(parents=True, exist_ok=True)
    out, sampled = where / "trl.jsonl", where / "trl-completions.jsonl"
    command = [*launcher, str(PEER), "--model", str(model_dir), "--data", str(data),
               "--method", method, "--loss", loss, "--out", str(out), "--completions",
               str(sampled), "--beta", str(beta), "--lr", str(lr), "--temperature",
               str(TEMPERATURE), "--steps", str(steps), "--batch", str(8 // processes),
               "--generations", str(GENERATIONS), "--max-completion", str(MAX_COMPLETION),
               "--seed", "42", "--own-reward", "letters:vowel_share",
               "--iterations", str(iterations)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(data.parent), str(REPO / "trainer"), str(REPO)])}
    result = subprocess.run(command, capture_output=True, text=True, env=env,
                            timeout=waits.seconds_left())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in sampled.read_text().splitlines()]
    rows.sort(key=lambda r: (r["step"], r["rank"], r["index"]))
    return [json.loads(line) for line in out.read_text().splitlines()], rows


@pytest.mark.parametrize(("method", "processes", "loss", "beta", "iterations"), [
    ("lora", 1, "dapo", 0.0, 2), ("lora", 2, "grpo", 0.04, 1), ("full", 1, "dr_grpo", 0.04, 1),
    ("full", 2, "bnpo", 0.0, 1)])
def test_every_step_agrees_with_trls_grpo_trainer(tiny_model_dir, tmp_path, method, processes,
                                                  loss, beta, iterations):
    """10 steps, fp32: the sampled completions identical, and the loss, reward, reward_std,
    kl and clipped share of every step within 1e-4 of GRPOTrainer's, the gradient norm
    within 0.1 % (the gradients themselves agree), for each loss type. Two optimizer steps
    on each round (`iterations`): the second one's ratio to the sampling model is
    clipped. Each loss type once, each method on 1 and on 2 processes, each with and
    without a KL term (a reference): the cases cover each setting, not their product
    (each costs a run of ours and one of TRL's, about 85 s of the suite)."""
    data = prompts(tmp_path / "data")
    steps = 10
    job = grpo_manifest(tiny_model_dir, data, tmp_path / "out", method=method,
                        processes=processes, loss=loss, beta=beta, steps=steps,
                        iterations=iterations)
    ours = finetune_run(job, tmp_path)
    assert ours.returncode == 0, ours.stdout[-3000:] + ours.stderr[-3000:]
    lr = job["spec"]["hyperparameters"]["learningRate"]
    theirs, their_samples = trl_steps(tiny_model_dir, data, tmp_path / "trl", method=method,
                                      processes=processes, steps=steps, loss=loss, beta=beta,
                                      lr=lr, iterations=iterations)
    our_samples = [json.loads(line) for line in
                   (tmp_path / "out/completions.jsonl").read_text().splitlines()]
    assert completions_by_step(our_samples) == completions_by_step(their_samples)
    assert len(completions_by_step(our_samples)) == steps // iterations
    mine = records(tmp_path / "out")
    assert [r["step"] for r in mine] == [t["step"] for t in theirs] == list(range(1, 11))
    for our, their in zip(mine, theirs, strict=True):
        figures = our["objectiveMetrics"]
        assert our["loss"] == pytest.approx(their["loss"], abs=1e-4), our["step"]
        assert our["gradNorm"] == pytest.approx(their["grad_norm"], rel=1e-3), our["step"]
        for name in ("reward", "reward_std", "entropy", "clip_ratio/region_mean",
                     *(("kl",) if beta else ())):
            if name not in their:  # a step that sampled nothing reports no reward
                assert name not in figures, (our["step"], name)
                continue
            assert figures[name] == pytest.approx(their[name], abs=1e-4), (our["step"], name)
    assert not beta or "kl" in mine[-1]["objectiveMetrics"]
    if iterations > 1:  # the second step on a round moves off the sampling model: clipped
        assert max(r["objectiveMetrics"]["clip_ratio/region_mean"] for r in mine) > 0


def shared_job(model_dir: Path, data: Path, output: Path, strategy: str = "ddp") -> dict:
    """The shared runs' job: 2 processes, LoRA, beta 0.04, two steps on each round, a
    checkpoint after every step (all four kept)."""
    job = grpo_manifest(model_dir, data, output, strategy=strategy, processes=2, steps=4,
                        beta=0.04, iterations=2)
    job["spec"]["output"].update({"checkpointEverySteps": 1, "keepLast": 4})
    return job


@pytest.fixture()
def grpo_runs(tiny_model_dir, shared):
    """One finished run of `shared_job` per strategy in the session."""

    def get(strategy: str) -> Path:
        def make(where: Path) -> None:
            job = shared_job(tiny_model_dir, prompts(where / "data"), where / "out", strategy)
            result = finetune_run(job, where)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

        return shared.get(f"grpo-{strategy}", make, name=f"grpo-{strategy}")

    return get


def sampled(output: Path) -> list[str]:
    """The completions a run sampled, in the order it wrote them."""
    return [json.loads(line)["completion"]
            for line in (output / "completions.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_strategies_sample_and_train_as_ddp(grpo_runs, strategy):
    """FSDP2 and ZeRO-3 sample with weights gathered layer by layer, every rank decoding
    until all are done: the same completions, rewards and losses as DDP (the KL to the
    reference and the ratio to the sampling model included)."""
    reference, sharded = grpo_runs("ddp") / "out", grpo_runs(strategy) / "out"
    assert sampled(sharded) == sampled(reference)
    mine, theirs = records(sharded), records(reference)
    assert [r["loss"] for r in mine] == pytest.approx([r["loss"] for r in theirs], abs=1e-5)
    for name in ("kl", "clip_ratio/region_mean"):
        assert [r["objectiveMetrics"][name] for r in mine] == pytest.approx(
            [r["objectiveMetrics"][name] for r in theirs], abs=1e-5)


@pytest.mark.parametrize("strategy", ["zero3"])
def test_a_full_weight_reference_is_sharded_as_the_model_is(tiny_model_dir, shared, strategy):
    """Full weights with beta > 0: the frozen reference copy read and sharded as the trained
    model is (ZeRO-3's partitions, each process holding its share), and the same
    completions, losses and KL as DDP's whole copy; the KL grows from 0 as the weights move
    off the reference. FSDP2's reference goes through the model's own sharding
    (`_shard`), which the FSDP runs here and in test_dpo.py hold."""
    def run(name: str) -> Path:
        def make(where: Path) -> None:
            job = grpo_manifest(tiny_model_dir, prompts(where / "data"), where / "out",
                                method="full", strategy=name, processes=2, steps=3,
                                beta=0.04)
            result = finetune_run(job, where)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

        return shared.get(f"grpo-full-{name}", make, name=f"grpo-full-{name}") / "out"

    whole, sharded = run("ddp"), run(strategy)
    assert sampled(sharded) == sampled(whole)
    mine, theirs = records(sharded), records(whole)
    assert [r["loss"] for r in mine] == pytest.approx([r["loss"] for r in theirs], abs=1e-5)
    kl = [r["objectiveMetrics"]["kl"] for r in mine]
    assert kl == pytest.approx([r["objectiveMetrics"]["kl"] for r in theirs], abs=1e-6)
    assert kl[0] == pytest.approx(0, abs=1e-7) and kl[-1] > 1e-5


def resumed_from(finished: Path, step: int, model_dir: Path, where: Path) -> Path:
    """The finished run's output as it was after `step` (the later checkpoints, the export
    and the records gone), run again to the end; the output folder."""
    import shutil

    output = where / "out"
    shutil.copytree(finished / "out", output)
    for later in range(step + 1, 5):
        shutil.rmtree(output / "checkpoints" / f"step-{later:08d}")
    shutil.rmtree(output / "final")
    for name in ("progress.jsonl", "completions.jsonl"):
        (output / name).unlink()
    job = shared_job(model_dir, finished / "data/prompts.jsonl", output)
    result = finetune_run(job, where / "here")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"step-{step:08d} (step {step}/4)" in result.stdout
    return output


@pytest.mark.parametrize("step", [2, 3])
def test_a_grpo_run_resumes_exactly_from_its_checkpoint(grpo_runs, tiny_model_dir, tmp_path,
                                                        step):
    """Resumed after step 2, between two rounds, it samples what the uninterrupted run
    sampled at step 3 (each round's generation is seeded by its index) and trains the same.
    Resumed after step 3, inside the round sampled at step 3, it trains step 4 on that
    round's completions and their sampling log-probabilities as saved, not on a round
    sampled again from the moved weights: the same loss, KL and clipping."""
    finished = grpo_runs("ddp")
    output, uninterrupted = resumed_from(finished, step, tiny_model_dir, tmp_path), \
        finished / "out"
    resumed, before = records(output), records(uninterrupted)[step:]
    assert [r["step"] for r in resumed] == list(range(step + 1, 5))
    for name in ("loss", "gradNorm"):
        assert [r[name] for r in resumed] == pytest.approx([r[name] for r in before],
                                                           rel=1e-5), name
    for again, first in zip(resumed, before, strict=True):
        assert again["objectiveMetrics"] == pytest.approx(first["objectiveMetrics"], abs=1e-6)
    sampled = output / "completions.jsonl"
    again = completions_by_step([json.loads(line) for line in sampled.read_text().splitlines()]
                                ) if sampled.exists() else {}
    first = completions_by_step([json.loads(line) for line in
                                 (uninterrupted / "completions.jsonl").read_text().splitlines()])
    assert again == {s: first[s] for s in first if s > step}


GIVEN = '''def given(completions, score, **_):
    """A reward the prompt decides: its record's `score`, whatever the answer."""
    return [float(value) for value in score]
'''


def test_held_out_prompts_are_answered_and_scored_at_each_evaluation(tiny_model_dir, tmp_path):
    """An eval split of three prompts on two FSDP processes (two prompts for rank 0, one
    for rank 1, which makes an empty `generate` call to keep the gathers in step), each
    answered four times: the eval figures count every held-out completion once and no
    training one (a reward the prompt decides: 0 in training, 1, 2 and 3 held out, so
    eval_reward is 2 exactly); in the log, the records after the first evaluation,
    progress.json and TensorBoard, with no eval loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = tmp_path / "data"
    prompts(data)
    (data / "prompts.jsonl").rename(data / "train.jsonl")
    (data / "train.jsonl").write_text("".join(
        json.dumps({**json.loads(line), "score": 0}) + "\n"
        for line in (data / "train.jsonl").read_text().splitlines()))
    (data / "validation.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {n} times {n}?", "answer": str(n * n), "score": n})
        + "\n" for n in (1, 2, 3)))
    (data / "scores.py").write_text(GIVEN)
    job = grpo_manifest(tiny_model_dir, data, tmp_path / "out", strategy="fsdp",
                        processes=2, steps=4, rewards=[{"name": "scores:given"}])
    job["spec"]["dataset"]["evalSplit"] = "validation"
    job["spec"]["hyperparameters"]["evalEverySteps"] = 2
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    evaluations = [line for line in result.stdout.splitlines() if line.startswith("eval")]
    assert evaluations == ["eval at step 2: reward 2.0000, reward std 0.8528",
                           "eval: reward 2.0000, reward std 0.8528"], result.stdout[-3000:]
    mine = records(tmp_path / "out")
    assert [r["objectiveMetrics"]["reward"] for r in mine] == [0.0] * 4
    assert all("eval_reward" not in r["objectiveMetrics"] for r in mine[:2])  # before it
    for record in (*mine[2:], json.loads((tmp_path / "out/progress.json").read_text())):
        figures = record["objectiveMetrics"]
        assert figures["eval_reward"] == 2.0
        assert figures["eval_rewards/scores:given/mean"] == 2.0
        assert figures["eval_frac_reward_zero_std"] == 1.0  # each group scored alike
        assert 1 <= figures["eval_completions/mean_length"] <= MAX_COMPLETION
        assert record["evalLoss"] is None
    events = EventAccumulator(str(tmp_path / "out/tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/reward")] == [(2, 2.0), (4, 2.0)]
    assert "eval/loss" not in events.Tags()["scalars"]


def test_it_learns_to_answer_with_a_number(tiny_model_dir, tmp_path):
    """The example's task with its format reward (a digit in the answer): a random tiny
    model's answers hold one about one time in six; after 30 steps of full-weight GRPO
    nearly all do. Measured (11-28, seeds 0-3): the mean reward of the first 5 steps
    0.14-0.21, of the last 5 0.98-1.0; asserted: a rise of at least 0.3."""
    data = tmp_path / "arithmetic.jsonl"
    data.write_text((REPO / "examples/data/arithmetic.jsonl").read_text())
    job = grpo_manifest(tiny_model_dir, data, tmp_path / "out", method="full", steps=30,
                        lr=1e-2, rewards=[{"name": "format", "pattern": r".*\d.*"}])
    job["spec"]["objective"]["grpo"].update({"numGenerations": 8, "temperature": 1.0})
    job["spec"]["hyperparameters"]["batchSizePerDevice"] = 16
    job["spec"]["dataset"]["maxSeqLength"] = 48
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rewards = [r["objectiveMetrics"]["reward"] for r in records(tmp_path / "out")]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, rewards


BROKEN = '''def raises(completions, **_):
    raise KeyError("score")


def short(completions, **_):
    return [1.0]
'''


def test_a_reward_that_cannot_be_imported_stops_the_run_before_it_starts(tiny_model_dir,
                                                                         tmp_path):
    data = prompts(tmp_path / "data")
    job = grpo_manifest(tiny_model_dir, data, tmp_path / "out",
                        rewards=[{"name": "scoring:exact"}])
    result = finetune_run(job, tmp_path)
    said = result.stdout + result.stderr
    assert result.returncode == 2, said[-3000:]
    assert ("spec.objective.grpo.rewards scoring:exact: module scoring cannot be imported: no "
            f"scoring.py in {data.parent} nor on the trainer's Python path — ship scoring.py "
            "beside the data (the job's dataset folder), or on the trainer's Python path"
            ) in said
    assert said.count("module scoring cannot be imported") == 1  # every rank's, said once
    assert "restart" not in result.stderr.replace("no restart would", "")  # none was made
    assert not (tmp_path / "out/checkpoints").exists()


@pytest.mark.parametrize(("name", "problem"), [
    ("broken:raises", "raised KeyError: 'score' at {folder}/broken.py:2 — fix "
     "{folder}/broken.py:2, so that it returns a float"),
    ("broken:short", "returned 1 values for 8 completions")])
def test_a_reward_that_fails_stops_the_run_at_its_first_step_named(tiny_model_dir, tmp_path,
                                                                   name, problem):
    """Bad input, said once: the worker exits as for bad data (no restart), naming the
    reward, what it did (where in the user's code, when it raised) and the fix."""
    data = prompts(tmp_path / "data")
    (data.parent / "broken.py").write_text(BROKEN)
    job = grpo_manifest(tiny_model_dir, data, tmp_path / "out", rewards=[{"name": name}])
    result = finetune_run(job, tmp_path)
    said = result.stdout + result.stderr
    assert result.returncode == 2, said[-3000:]
    problem = problem.format(folder=data.parent)
    assert f"spec.objective.grpo.rewards {name}: {problem}" in said, said[-3000:]
    assert "restarting" not in said and "step 1/" not in result.stdout


def test_a_run_whose_rewards_never_differ_within_a_group_is_warned_of_once(tiny_model_dir,
                                                                           tmp_path):
    """A reward no completion earns: every advantage, every loss 0, and the run would end
    Succeeded having learnt nothing. At the tenth such step the log says so, once."""
    from finetune_trainer.objectives.grpo.loss import flat_rewards_warning

    job = grpo_manifest(tiny_model_dir, prompts(tmp_path / "data"), tmp_path / "out",
                        steps=11, rewards=[{"name": "format", "pattern": "(?!)"}])
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    warned = [n for n, line in enumerate(lines) if line.startswith("warning: every group")]
    assert [lines[n] for n in warned] == [flat_rewards_warning(10)], result.stdout[-3000:]
    assert lines[warned[0] + 1].startswith("step 10/11 "), result.stdout[-3000:]
