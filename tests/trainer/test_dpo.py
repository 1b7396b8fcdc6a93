"""DPO for real: `finetune run` with `objective: dpo` on 2 CPU processes over gloo, against
TRL's DPOTrainer step for step, under every strategy, and resumed from a checkpoint.

The peer (tests/support/trl_dpo_peer.py) trains the same tiny model on the same pairs with
the same settings, seeded so that its adapters start where ours do. Each step of both
trains on all 8 pairs (one batch holds them), so the sampling order cannot differ.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune_trainer.layout import REFERENCE_FILE
from tests.conftest import REPO
from tests.support import waits
from tests.trainer.test_training import DATA, finetune_run, manifest

pytestmark = pytest.mark.process
PAIRS = REPO / "examples/data/tiny-preferences.jsonl"
PEER = REPO / "tests/support/trl_dpo_peer.py"
MAX_LENGTH = 96


def dpo_manifest(model_dir: Path, data: Path, output: Path, *, method: str = "lora",
                 strategy: str = "ddp", processes: int = 2, batch: int = 4, steps: int = 6,
                 loss: str = "sigmoid", smoothing: float = 0.0, beta: float = 0.1,
                 lr: float | None = None, checkpoint_every: int = 3) -> dict:
    dpo = {"beta": beta, "loss": loss}
    if smoothing:
        dpo["labelSmoothing"] = smoothing
    spec = {
        "model": {"uri": str(model_dir)},
        "dataset": {"uri": str(data), "maxSeqLength": MAX_LENGTH},
        "method": {"type": method},
        "objective": {"type": "dpo", "dpo": dpo},
        "strategy": {"type": strategy, "precision": "fp32", "gradientCheckpointing": False},
        "hyperparameters": {"maxSteps": steps, "batchSizePerDevice": batch,
                            "learningRate": lr or (5e-3 if method == "lora" else 5e-4),
                            "logEverySteps": 1, "warmupRatio": 0.0},
        "resources": {"gpusPerNode": 0, "processesPerNode": processes},
        "output": {"uri": str(output), "checkpointEverySteps": checkpoint_every},
    }
    if method == "lora":
        spec["method"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    return {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": f"dpo-{strategy}-{method}"}, "spec": spec}


def records(output: Path) -> list[dict]:
    """Our progress records, one per step."""
    lines = (output / "progress.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda r: r["step"])


def trl_steps(model_dir: Path, data: Path, out: Path, *, method: str, processes: int,
              batch: int, steps: int, loss: str, smoothing: float, beta: float, lr: float
              ) -> list[dict]:
    # --standalone: torchrun's own rendezvous on a port it picks (no port to race for)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(processes)] if processes > 1 else [sys.executable])
    command = [*launcher, str(PEER), "--model", str(model_dir), "--data", str(data),
               "--method", method, "--loss", loss, "--out", str(out), "--beta", str(beta),
               "--smoothing", str(smoothing), "--lr", str(lr), "--steps", str(steps),
               "--batch", str(batch), "--max-length", str(MAX_LENGTH), "--seed", "42"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, env=env,
                            timeout=waits.seconds_left())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def first_pairs(where: Path, count: int = 8) -> Path:
    path = where / "pairs.jsonl"
    path.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[:count]))
    return path


@pytest.fixture()
def eight_pairs(tmp_path) -> Path:
    """The first 8 shipped pairs (a function's fixture: the comparisons spread over the
    pytest-xdist workers)."""
    return first_pairs(tmp_path)


@pytest.fixture()
def trl_reference(tiny_model_dir, shared):
    """TRL's steps on the first 8 pairs, one run per method and loss in the session, on one
    process with the 8 pairs in its one batch: what two processes of 4 pairs each compute
    too (DDP averages the halves' gradients, TRL the halves' logged figures), so our runs
    on one process and on two are compared with the same run, made once (TRL on two
    processes, a torchrun of its own for each comparison, cost as much as ours)."""

    def get(method: str, loss: str, smoothing: float, steps: int, beta: float,
            lr: float) -> list[dict]:
        def make(where: Path) -> None:
            trl_steps(tiny_model_dir, first_pairs(where), where / "trl.jsonl", method=method,
                      processes=1, batch=8, steps=steps, loss=loss, smoothing=smoothing,
                      beta=beta, lr=lr)

        folder = shared.get(f"trl dpo {method} {loss} {smoothing} {steps} {beta} {lr}", make,
                            name=f"trl-dpo-{method}-{loss}")
        return [json.loads(line) for line in (folder / "trl.jsonl").read_text().splitlines()]

    return get


@pytest.mark.parametrize(("method", "processes", "loss", "smoothing"), [
    ("lora", 2, "sigmoid", 0.0), ("full", 2, "sigmoid", 0.0), ("lora", 1, "ipo", 0.0),
    ("full", 1, "robust", 0.1)])
def test_every_step_agrees_with_trls_dpo_trainer(tiny_model_dir, eight_pairs, trl_reference,
                                                 tmp_path, method, processes, loss,
                                                 smoothing):
    """20 steps, fp32: the loss, the reward margin and the chosen and rejected rewards of
    every step within 1e-4 of DPOTrainer's (the reference: the base with the adapters off,
    or, for full weights, the table taken before step 1 against TRL's frozen copy). Each
    loss type, each method on 1 and on 2 processes: the cases cover each setting, not
    their product."""
    batch, steps, beta = 8 // processes, 20, 0.1
    lr = 5e-3 if method == "lora" else 5e-4
    job = dpo_manifest(tiny_model_dir, eight_pairs, tmp_path / "out", method=method,
                       processes=processes, batch=batch, steps=steps, loss=loss,
                       smoothing=smoothing, beta=beta, checkpoint_every=100)
    ours = finetune_run(job, tmp_path)
    assert ours.returncode == 0, ours.stdout[-3000:] + ours.stderr[-3000:]
    theirs = trl_reference(method, loss, smoothing, steps, beta, lr)
    mine = records(tmp_path / "out")
    assert [r["step"] for r in mine] == [t["step"] for t in theirs] == list(range(1, 21))
    for our, their in zip(mine, theirs, strict=True):
        assert our["loss"] == pytest.approx(their["loss"], abs=1e-4), our["step"]
        for name in ("margins", "chosen", "rejected", "accuracies"):
            assert our["objectiveMetrics"][f"rewards/{name}"] == pytest.approx(
                their[f"rewards/{name}"], abs=1e-4), \
                (our["step"], name)
    assert mine[-1]["loss"] < mine[0]["loss"] - 0.05  # it learns the preference
    assert mine[-1]["objectiveMetrics"]["rewards/margins"] > 0.1


@pytest.fixture()
def dpo_runs(tiny_model_dir, shared):
    """One finished 2-process DPO run (6 steps on all 64 pairs, checkpoints at 3 and 6) per
    strategy and method in the session."""

    def get(strategy: str, method: str) -> Path:
        def make(where: Path) -> None:
            job = dpo_manifest(tiny_model_dir, PAIRS, where / "out", method=method,
                               strategy=strategy)
            result = finetune_run(job, where)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            (where / "stdout").write_text(result.stdout)

        return shared.get(f"dpo-{strategy}-{method}", make, name=f"dpo-{strategy}-{method}")

    return get


def test_cpu_offload_trains_the_same_pairs(dpo_runs, tiny_model_dir, tmp_path):
    """ZeRO-3 with its optimizer and weights offloaded to the host (FSDP's CPUOffloadPolicy
    is for GPU workers only): the same DPO steps as without."""
    job = dpo_manifest(tiny_model_dir, PAIRS, tmp_path / "out", method="full",
                       strategy="zero3")
    job["spec"]["strategy"]["offload"] = "cpu"
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["loss"] for r in records(tmp_path / "out")] == pytest.approx(
        [r["loss"] for r in records(dpo_runs("zero3", "full") / "out")], rel=1e-3)


def test_a_dpo_run_stops_early_on_its_eval_loss_and_exports_the_best(tiny_model_dir,
                                                                     tmp_path):
    """The eval loss of DPO is the mean pair loss of the held-out pairs; early stopping
    counts it as for SFT. A threshold no evaluation can clear makes the first evaluation
    the best and the next one no better: the run ends at that step, exporting step 2's
    adapter."""
    job = dpo_manifest(tiny_model_dir, PAIRS, tmp_path / "out", steps=20, checkpoint_every=100)
    job["spec"]["dataset"]["evalFraction"] = 0.125
    job["spec"]["hyperparameters"].update({"evalEverySteps": 2, "earlyStoppingPatience": 1,
                                           "earlyStoppingThreshold": 100.0})
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "stopped early at step 4 of 20: 1 evaluation did not improve" in result.stdout
    assert "the export is of step 2, the best evaluation's" in result.stdout
    evaluations = [float(line.rsplit(" ", 1)[1]) for line in result.stdout.splitlines()
                   if line.startswith("eval at step")]
    assert len(evaluations) == 2 and 0 < evaluations[0] < 0.7  # pair losses, not token ones
    progress = json.loads((tmp_path / "out/progress.json").read_text())
    assert (progress["step"], progress["phase"]) == (4, "Succeeded")
    assert progress["evalLoss"] == pytest.approx(evaluations[0], abs=1e-4)


STRATEGIES = [("fsdp", "lora"), ("zero2", "lora"), ("zero3", "lora"), ("fsdp", "full"),
              ("zero2", "full"), ("zero3", "full")]


@pytest.mark.parametrize(("strategy", "method"), STRATEGIES)
def test_strategies_train_the_same_pairs_as_ddp(dpo_runs, strategy, method):
    reference = records(dpo_runs("ddp", method) / "out")
    assert len(reference) == 6 and reference[-1]["loss"] < reference[0]["loss"]
    mine = records(dpo_runs(strategy, method) / "out")
    assert [r["loss"] for r in mine] == pytest.approx([r["loss"] for r in reference], rel=1e-3)
    assert [r["objectiveMetrics"]["rewards/margins"] for r in mine] == pytest.approx(
        [r["objectiveMetrics"]["rewards/margins"] for r in reference], rel=1e-3, abs=1e-5)


@pytest.mark.parametrize(("strategy", "method"), [("ddp", "lora"), ("ddp", "full"),
                                                  ("fsdp", "full"), ("zero2", "full"),
                                                  ("zero3", "lora")])
def test_a_dpo_run_resumes_exactly_from_its_checkpoint(dpo_runs, tiny_model_dir, tmp_path,
                                                       strategy, method):
    """Stopped after step 3 (its step-6 checkpoint and export gone): the rerun resumes there,
    with the reference of full weights read back, not taken again of trained weights, and
    steps 4-6 repeat the uninterrupted run. Each strategy's checkpoints and each method's
    reference once (a resume of each strategy's own: test_training.py)."""
    finished = dpo_runs(strategy, method) / "out"
    output = tmp_path / "out"
    shutil.copytree(finished, output)
    shutil.rmtree(output / "checkpoints" / "step-00000006")
    shutil.rmtree(output / "final")
    (output / "progress.jsonl").unlink()
    job = dpo_manifest(tiny_model_dir, PAIRS, output, method=method, strategy=strategy)
    result = finetune_run(job, tmp_path / "here")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step-00000003 (step 3/6)" in result.stdout
    assert (f"reference log-probabilities read from {output / REFERENCE_FILE}"
            in result.stdout) == (method == "full")
    assert "reference log-probabilities of" not in result.stdout
    resumed, uninterrupted = records(output), records(finished)[3:]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == pytest.approx(
        [r["loss"] for r in uninterrupted], rel=1e-4)


def test_a_precomputed_reference_trains_the_lora_pairs_as_the_per_batch_one(
        dpo_runs, tiny_model_dir, tmp_path):
    """`precomputeRefLogProbs` (TRL's `precompute_ref_log_probs`): the base's log-
    probabilities of every pair taken once, adapters off, before step 1, in place of its
    forward at every batch; the same steps as the per-batch reference. A resume that finds
    the table gone takes it again (an adapter run's base has not moved) and trains on as
    the uninterrupted run."""
    job = dpo_manifest(tiny_model_dir, PAIRS, tmp_path / "out")
    job["spec"]["objective"]["dpo"]["precomputeRefLogProbs"] = True
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "reference log-probabilities of 64 preference pairs taken" in result.stdout
    per_batch, mine = records(dpo_runs("ddp", "lora") / "out"), records(tmp_path / "out")
    assert len(mine) == 6 and mine[-1]["loss"] < mine[0]["loss"]
    assert [r["loss"] for r in mine] == pytest.approx([r["loss"] for r in per_batch],
                                                      rel=1e-5)
    assert [r["objectiveMetrics"]["rewards/margins"] for r in mine] == pytest.approx(
        [r["objectiveMetrics"]["rewards/margins"] for r in per_batch], rel=1e-4, abs=1e-6)

    output = tmp_path / "out"
    shutil.rmtree(output / "checkpoints" / "step-00000006")
    shutil.rmtree(output / "final")
    (output / "progress.jsonl").unlink()
    (output / REFERENCE_FILE).unlink()
    result = finetune_run(job, tmp_path / "again")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step-00000003 (step 3/6)" in result.stdout
    assert "reference log-probabilities of 64 preference pairs taken" in result.stdout
    assert [r["loss"] for r in records(output)] == pytest.approx(
        [r["loss"] for r in per_batch[3:]], rel=1e-5)


def test_a_full_weight_run_without_its_reference_is_refused_not_retaken(
        dpo_runs, tiny_model_dir, tmp_path):
    """The reference of full weights is the model before step 1: a resume that finds the
    table gone says so and trains nothing, rather than scoring pairs with trained weights."""
    output = tmp_path / "out"
    shutil.copytree(dpo_runs("ddp", "full") / "out", output)
    shutil.rmtree(output / "checkpoints" / "step-00000006")
    shutil.rmtree(output / "final")
    (output / REFERENCE_FILE).unlink()
    job = dpo_manifest(tiny_model_dir, PAIRS, output, method="full")
    result = finetune_run(job, tmp_path / "here")
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert f"{output / REFERENCE_FILE}: is missing" in said, said[-3000:]
    assert "start the run afresh" in said
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["step-00000003"]


def _files(folder: Path) -> dict[str, bytes]:
    """What a run leaves in `folder` (its model, checkpoints, progress), not the lock and
    the cached data digests every command's check touches."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).parts[0] not in ("logs", ".finetune")}


def test_an_sft_job_in_a_dpo_runs_folder_is_refused_and_its_model_kept(
        dpo_runs, tiny_model_dir, tmp_path):
    """#58 as a new user met it: a 6-step DPO run's folder (a copy of it), then an SFT
    manifest on other data and maxSteps 7 pointed there. It resumed the DPO checkpoint,
    trained one SFT step and replaced final/. Now `finetune run` refuses before anything
    starts, naming the objective and the data; the pods' own check says the same; final/
    and the checkpoints are byte for byte what they were."""
    output = tmp_path / "out"
    shutil.copytree(dpo_runs("ddp", "lora") / "out", output)
    before = _files(output)
    sft = manifest(tiny_model_dir, output, steps=7)
    refused = finetune_run(sft, tmp_path / "sft")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "trainer config:" not in refused.stdout and "starting" not in refused.stdout
    (line,) = [line for line in refused.stderr.splitlines() if line.strip()]
    assert "objective.type: dpo → sft" in line, line
    assert f"dataset content: {PAIRS} (1 file, " in line and f"→ {DATA} (1 file, " in line
    assert "dataset.format: auto → chat" in line
    assert "written by FineTuneJob default/dpo-ddp-lora from " in line
    assert "point spec.output.uri at a new folder, or start over with `finetune run --fresh`" in (
        line)
    assert "resumeWithChangedData" not in line  # another objective: no data knob helps
    assert _files(output) == before

    # the trainer's own check (the pods' init container): the same words, exit 4
    config = yaml.safe_load((output / ".finetune" / "trainer.yaml").read_text())
    config["objective"] = {"type": "sft"}
    config["dataset"] = {"uri": str(DATA), "format": "chat", "maxSeqLength": MAX_LENGTH}
    (tmp_path / "trainer.yaml").write_text(yaml.safe_dump(config))
    check = subprocess.run([sys.executable, "-m", "finetune_trainer", "--check-resume",
                            "--config", str(tmp_path / "trainer.yaml")],
                           capture_output=True, text=True, timeout=waits.seconds_left())
    assert check.returncode == 4, check.stdout + check.stderr
    assert "objective.type: dpo → sft" in check.stderr and "move its checkpoints/, final/" in (
        check.stderr)

    # its checkpoints moved away by hand, the model kept: a run from step 0 would replace it
    shutil.move(output / "checkpoints", tmp_path / "kept-checkpoints")
    again = finetune_run(dpo_manifest(tiny_model_dir, PAIRS, output), tmp_path / "dpo")
    assert again.returncode == 2, again.stdout + again.stderr
    assert "holds an exported model (final/) and no checkpoint it could resume from" in (
        again.stderr)
    assert _files(output / "final") == {
        name.removeprefix("final/"): data for name, data in before.items()
        if name.startswith("final/")}
