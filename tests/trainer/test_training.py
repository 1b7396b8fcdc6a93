"""Real fine-tunes: `finetune run` on 2 CPU processes over gloo, every strategy.

Each run is a subprocess tree (finetune run → torchrun → 2 workers) on the tiny model,
so what is tested is exactly what a user runs.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from finetune_operator.follow import run_log
from finetune_trainer.checkpoint import complete_checkpoints
from tests.conftest import REPO
from tests.support import waits

pytestmark = pytest.mark.process
DATA = REPO / "examples/data/tiny-chat.jsonl"


def manifest(model_dir: Path, output: Path, *, strategy: str = "ddp", method: str = "lora",
             steps: int = 6, batch: int = 2, accumulation: int = 1, processes: int = 2,
             checkpoint_every: int = 3, precision: str = "fp32", offload: str = "none",
             checkpointing: bool = False, merge: bool = False, fused_loss: bool = True,
             compile: bool = False, micro: int | None = None) -> dict:
    spec = {
        "model": {"uri": str(model_dir)},
        "dataset": {"uri": str(DATA), "format": "chat", "maxSeqLength": 96},
        "method": {"type": method},
        "strategy": {"type": strategy, "precision": precision, "offload": offload,
                     "gradientCheckpointing": checkpointing, "fusedLoss": fused_loss,
                     "compile": compile},
        "hyperparameters": {"maxSteps": steps, "batchSizePerDevice": batch,
                            "gradientAccumulationSteps": accumulation, "learningRate": 5e-3,
                            "logEverySteps": 1, "warmupRatio": 0.0},
        "resources": {"gpusPerNode": 0, "processesPerNode": processes},
        "output": {"uri": str(output), "checkpointEverySteps": checkpoint_every},
    }
    if merge:
        spec["output"]["mergeAdapter"] = True
    if micro is not None:
        spec["hyperparameters"]["microBatchSize"] = micro
    if method == "lora":
        spec["method"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    return {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": f"t-{strategy}-{method}"}, "spec": spec}


def finetune_run(job: dict, where: Path, *extra: str, wait: bool = True,
                 env: dict[str, str] | None = None):
    """`finetune run` of `job` as a user runs it; `env`: variables of the user's shell."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    command = [sys.executable, "-m", "finetune_operator.cli", "run", str(path), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env or {})}
    if not wait:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
    return subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=waits.seconds_left())


def new_file_mode() -> int:
    """The mode a file created here gets (0o644 under the usual umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def losses(output: Path) -> list[float]:
    records = [json.loads(line) for line in (output / "progress.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in records}
    return [by_step[s] for s in sorted(by_step)]


def shared_run(shared, model: Path, strategy: str, method: str = "lora", **options) -> Path:
    """The output folder of the session's one finished run of this manifest
    (tests/support/shared.py); its readers never change it (options that spell out a
    default, such as precision="fp32", name the same run)."""
    def make(where: Path) -> None:
        result = finetune_run(manifest(model, where / "out", strategy=strategy, method=method,
                                       **options), where)
        assert result.returncode == 0, result.stdout + result.stderr

    key = json.dumps(manifest(model, Path("out"), strategy=strategy, method=method, **options),
                     sort_keys=True)
    return shared.get(key, make, name=f"{strategy}-{method}") / "out"


@pytest.fixture()
def runs(tiny_model_dir, shared):
    """`shared_run` of the tiny model, read by the comparisons below."""

    def get(strategy: str, method: str = "lora", **options) -> Path:
        return shared_run(shared, tiny_model_dir, strategy, method, **options)

    get.model = tiny_model_dir
    return get


@pytest.mark.parametrize(("strategy", "method"), [
    ("fsdp", "lora"), ("fsdp", "full"), ("zero1", "lora"), ("zero2", "lora"), ("zero2", "full"),
    ("zero3", "lora"), ("zero3", "full")])
def test_strategies_train_the_same_numbers_as_ddp(runs, strategy, method):
    reference = losses(runs("ddp", method))
    assert len(reference) == 6
    assert reference[-1] < reference[0]  # it learns
    assert losses(runs(strategy, method)) == pytest.approx(reference, rel=1e-3)


@pytest.mark.parametrize(("strategy", "method", "precision"), [
    ("ddp", "full", "fp32"), ("ddp", "lora", "bf16"), ("zero3", "full", "fp32")])
def test_fused_loss_trains_the_same_numbers_as_whole_logits(runs, strategy, method, precision):
    """The chunked output layer + cross-entropy (the default) against logits computed
    whole: the same losses, so the same gradients reached the weights."""
    whole = losses(runs(strategy, method, precision=precision, fused_loss=False))
    assert losses(runs(strategy, method, precision=precision)) == pytest.approx(
        whole, rel=1e-3 if precision == "fp32" else 1e-2)


@pytest.mark.parametrize(("strategy", "method"), [("zero2", "full"), ("ddp", "full")])
def test_cpu_workers_are_not_told_deepspeed_found_no_gpu(runs, strategy, method):
    """DeepSpeed, imported for ZeRO and by accelerate at a full-weight save, warned on every
    rank of a job of CPU workers that it was 'unable to detect' a GPU and fell back to the
    CPU, the terminal's last words before `done:` in a DDP run."""
    kept = run_log(runs(strategy, method)).read_text()
    assert "exported" in kept and "unable to detect" not in kept, kept[-3000:]


def test_compiled_layers_train_the_same_numbers(runs):
    assert losses(runs("ddp", "full", compile=True)) == pytest.approx(
        losses(runs("ddp", "full")), rel=1e-4)


def test_batches_prefetched_on_a_thread_train_the_same_numbers(runs, tmp_path):
    """The GPU default (a collating thread), forced on CPU workers by the trainer config's
    benchmark switch: the trainer config `finetune run` wrote, run again by its torchrun."""
    from finetune_operator.local.processes import trainer_command

    done = runs("ddp", "full")
    config = yaml.safe_load((done / ".finetune" / "trainer.yaml").read_text())
    config["output"]["uri"] = str(tmp_path / "out")
    config["benchmark"] = {"prefetch": True}
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(trainer_command(path, 2), capture_output=True, text=True,
                            env=env, timeout=waits.seconds_left())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert losses(tmp_path / "out") == losses(done)


@pytest.mark.parametrize("strategy", ["zero3"])  # FSDP's CPUOffloadPolicy is for GPU
def test_cpu_offload_trains_the_same_numbers(runs, strategy):  # workers only (parallel.py)
    assert losses(runs(strategy, offload="cpu")) == pytest.approx(losses(runs("ddp")), rel=1e-3)


@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "zero3"])
def test_bf16_agrees_across_strategies(runs, strategy):
    """bf16 compute with fp32 master weights: the same numbers whatever shards them (and
    LoRA's frozen base stored in bf16 under each, #17)."""
    reference = losses(runs("ddp", precision="bf16"))
    fp32 = losses(runs("ddp"))
    assert reference != fp32 and reference == pytest.approx(fp32, rel=1e-2)  # bf16 really ran
    assert losses(runs(strategy, precision="bf16")) == pytest.approx(reference, rel=1e-3)


def test_gradient_checkpointing_and_merged_export(runs):
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    output = runs("ddp", checkpointing=True, merge=True)
    assert losses(output) == pytest.approx(losses(runs("ddp")), rel=1e-4)
    assert {p.stat().st_mode & 0o777 for p in (output / "merged").iterdir()} == {
        new_file_mode()}
    adapter = AutoPeftModelForCausalLM.from_pretrained(output / "final").eval()
    merged = AutoModelForCausalLM.from_pretrained(output / "merged").eval()
    ids = torch.tensor([[2, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        assert torch.allclose(adapter(ids).logits, merged(ids).logits, atol=1e-4)


def test_two_ranks_match_one_rank_with_double_accumulation(runs):
    two = losses(runs("ddp", "full"))
    one = losses(runs("ddp", "full", processes=1, accumulation=2))
    assert one == pytest.approx(two, rel=1e-3)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_resumes_on_fewer_workers_that_keep_the_global_batch(
        runs, tiny_model_dir, tmp_path, strategy):
    """Capacity shrinks from 2 workers to 1: the same job, `finetune run --nproc 1` (each
    step in 2 passes, so the same global batch), resumes from its step-3 checkpoint (DCP
    reshards it) and trains the steps the 2-worker run trained."""
    two = runs(strategy, "full")
    output = tmp_path / "out"
    shutil.copytree(two, output)
    shutil.rmtree(output / "checkpoints" / "step-00000006")  # as if stopped after step 3
    shutil.rmtree(output / "final")
    job = manifest(tiny_model_dir, output, strategy=strategy, method="full")
    resumed = finetune_run(job, tmp_path / "here", "--nproc", "1")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "1 process" in resumed.stdout and "in 2 passes of 2" in resumed.stdout
    assert "resuming from" in resumed.stdout and "step-00000003" in resumed.stdout
    assert "step 4/6 |" in resumed.stdout and "step 3/6 |" not in resumed.stdout
    assert losses(output) == pytest.approx(losses(two), rel=1e-3)  # steps 4-6 trained again


def test_a_zero_run_is_refused_on_other_workers_before_it_starts(runs, tiny_model_dir,
                                                                 tmp_path):
    """DeepSpeed loads a ZeRO checkpoint only on as many workers as wrote it: on 1 it
    failed on every restart. Refused in one line saying how many."""
    output = tmp_path / "out"
    shutil.copytree(runs("zero2", "full"), output)
    shutil.rmtree(output / "final")
    job = manifest(tiny_model_dir, output, strategy="zero2", method="full")
    refused = finetune_run(job, tmp_path / "here", "--nproc", "1")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "starting" not in refused.stdout
    assert "workers (resources.nodes x processes per node): 2 → 1" in refused.stderr
    assert "run it on 2 workers again" in refused.stderr


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_smaller_passes_train_the_same_numbers(runs, strategy):
    """microBatchSize 1 runs each rank's 2 sequences of a step as 2 passes: the same
    sequences per step, the same loss (the planner's choice changes memory, not training)."""
    split = runs(strategy, "full", micro=1)
    config = yaml.safe_load((split / ".finetune" / "trainer.yaml").read_text())
    assert config["hyperparameters"]["microBatchSize"] == 1
    assert "6 steps of 4 sequences, each process's in 2 passes of 1" in run_log(
        split).read_text()
    assert losses(split) == pytest.approx(losses(runs(strategy, "full")), rel=1e-3)


def test_lora_run_leaves_checkpoints_progress_and_an_adapter_that_generates(runs):
    output = runs("ddp", "lora")
    checkpoints = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert checkpoints == ["step-00000003", "step-00000006"]  # keepLast 2
    progress = json.loads((output / "progress.json").read_text())
    assert progress["phase"] == "Succeeded" and progress["step"] == progress["totalSteps"] == 6
    assert progress["tokensPerSecond"] > 0

    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    final = output / "final"
    assert (final / "adapter_config.json").is_file()
    assert not (final / "model.safetensors").exists()  # an adapter, not a full copy
    # #51, item 6: a card that says what this is and how to load it, not peft's template;
    # every file readable by a serving pod of another user (safetensors wrote 0600)
    card = (final / "README.md").read_text()
    assert "More Information Needed" not in card, card[:2000]
    assert f"adapter of `{runs.model}`" in card and str(DATA) in card, card
    assert "base_model:" not in card, card  # a local folder is no hub repo id (#58)
    assert "| steps | 6 of 6 |" in card and "| final training loss | " in card, card
    assert "AutoPeftModelForCausalLM.from_pretrained" in card, card
    assert {p.stat().st_mode & 0o777 for p in final.iterdir()} == {new_file_mode()}, {
        p.name: oct(p.stat().st_mode & 0o777) for p in final.iterdir()}
    model = AutoPeftModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is DDP?"}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 8


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_full_export_gathers_every_weight(runs, strategy):
    from safetensors.torch import load_file

    reference = load_file(runs("ddp", "full") / "final" / "model.safetensors")
    exported = load_file(runs(strategy, "full") / "final" / "model.safetensors")
    assert exported.keys() == reference.keys()
    for name, tensor in reference.items():
        assert exported[name].float().allclose(tensor.float(), atol=2e-3), name


def test_sigterm_checkpoints_and_the_restart_ends_where_an_uninterrupted_run_ends(
        runs, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    job = manifest(tiny_model_dir, tmp_path / "out", method="full", steps=6, checkpoint_every=4)
    process = finetune_run(job, tmp_path, wait=False)
    progress = tmp_path / "out" / "progress.json"
    deadline = time.monotonic() + waits.seconds_left()
    while time.monotonic() < deadline:
        if progress.exists() and json.loads(progress.read_text())["step"] >= 1:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=waits.seconds_left())
    assert process.returncode == 143, output
    stopped_at = json.loads(progress.read_text())["step"]
    assert 1 <= stopped_at < 6
    # one line, no traceback from torchrun's agent (#19, item 8)
    assert output.rstrip().splitlines()[-1] == (
        f"interrupted; checkpoint at step {stopped_at} in {tmp_path / 'out' / 'checkpoints'}; "
        "run the same command to resume"), output
    assert "Traceback" not in output and "SignalException" not in output
    assert (tmp_path / "out" / "checkpoints" / f"step-{stopped_at:08d}").is_dir()

    resumed = finetune_run(job, tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from {tmp_path / 'out' / 'checkpoints'}/step-{stopped_at:08d}" in (
        resumed.stdout)
    assert losses(tmp_path / "out") == pytest.approx(losses(runs("ddp", "full")), rel=1e-3)
    uninterrupted = load_file(runs("ddp", "full") / "final" / "model.safetensors")
    restarted = load_file(tmp_path / "out" / "final" / "model.safetensors")
    for name, tensor in uninterrupted.items():
        assert restarted[name].allclose(tensor, atol=1e-5), name


def test_half_written_checkpoint_is_never_loaded(runs, tiny_model_dir, tmp_path):
    import shutil

    finished = runs("ddp", "lora")
    shutil.copytree(finished / "checkpoints", tmp_path / "out" / "checkpoints")
    # the newest is incomplete: renamed back as if the writer died before the rename
    (tmp_path / "out/checkpoints/step-00000006").rename(
        tmp_path / "out/checkpoints/step-00000006.partial")
    result = finetune_run(manifest(tiny_model_dir, tmp_path / "out"), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming from" in result.stdout and "step-00000003 (step 3/6)" in result.stdout
    # the adapter, optimizer and schedule came back exactly: steps 4-6 repeat the original
    assert losses(tmp_path / "out") == pytest.approx(losses(finished)[3:], rel=1e-4)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_lora_in_bf16_checkpoints_fp32_adapters_and_resumes_exactly(
        runs, tiny_model_dir, tmp_path, strategy):
    """#17: the bf16 frozen base is never checkpointed (it comes from the model again); the
    fp32 adapters and their Adam moments are, and steps 4-6 after a resume repeat the run."""
    import torch

    finished = runs(strategy, precision="bf16")
    names, dtypes = _checkpointed_weights(finished / "checkpoints/step-00000003/model", strategy)
    assert names and all("lora_" in name for name in names), sorted(names)
    assert dtypes == {torch.float32}

    shutil.copytree(finished / "checkpoints", tmp_path / "out" / "checkpoints")
    shutil.rmtree(tmp_path / "out/checkpoints/step-00000006")
    result = finetune_run(manifest(tiny_model_dir, tmp_path / "out", strategy=strategy,
                                   precision="bf16"), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step-00000003 (step 3/6)" in result.stdout
    assert losses(tmp_path / "out") == pytest.approx(losses(finished)[3:], rel=1e-4)


def _checkpointed_weights(folder: Path, strategy: str) -> tuple[set[str], set]:
    """The names of the model weights a checkpoint holds, and the dtypes of the values a
    resume trains on: DCP's metadata under fsdp; under ZeRO the engine's module states
    (names; its 16-bit copies are empty) and the optimizer's fp32 master partitions."""
    import torch

    if strategy == "fsdp":
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        weights = {key.removeprefix("model."): item.properties.dtype
                   for key, item in metadata.items() if key.startswith("model.")}
        return set(weights), set(weights.values())
    states = torch.load(next(folder.glob("deepspeed/*rank_0_*model_states.pt")),
                        map_location="cpu", weights_only=False)
    optimizer = torch.load(next(folder.glob("deepspeed/*rank_0_*optim_states.pt")),
                           map_location="cpu", weights_only=False)
    assert not states["frozen_param_shapes"], "frozen weights in the checkpoint"
    masters = optimizer["optimizer_state_dict"]["fp32_flat_groups"]
    return set(states["module"]), {group.dtype for group in masters}


def test_bad_data_is_named_once_and_never_restarted(tiny_model_dir, tmp_path):
    """Each worker refuses the data before it joins (as in the pods), and the launcher says
    the first one's reason again: the terminal shows the reason once, the log keeps all."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": []}\n{"messages": [\n')
    job = manifest(tiny_model_dir, tmp_path / "out")
    job["spec"]["dataset"]["uri"] = str(data)
    result = finetune_run(job, tmp_path)
    assert result.returncode == 2
    said = [line for line in result.stderr.splitlines() if f"{data}:2: is not valid JSON" in line]
    assert len(said) == 1 and said[0].startswith(f"finetune-train: {data}:2: "), result.stderr
    assert result.stderr.splitlines()[-1] == (
        "training failed (exit 2): the line above names what is wrong and the fix; no restart "
        "would change it, so none was made")
    kept = run_log(tmp_path / "out").read_text()
    assert kept.count(f"{data}:2: is not valid JSON") == 3  # 2 ranks and the launcher


def test_a_folder_named_by_split_trains_on_one_and_evaluates_on_another(
        tiny_model_dir, tmp_path):
    """`evalSplit` names a split of the data folder: the trainer reads train.jsonl only
    (never test.jsonl) and evaluates on validation.jsonl, every evalEverySteps and at the
    end; a split the folder lacks is refused before any process starts."""
    lines = DATA.read_text().splitlines()
    folder = tmp_path / "data"
    folder.mkdir()
    splits = {"train": lines[:40], "validation": lines[40:52], "test": lines[52:]}
    for name, part in splits.items():
        (folder / f"{name}.jsonl").write_text("\n".join(part) + "\n")
    job = manifest(tiny_model_dir, tmp_path / "out", steps=4)
    job["spec"]["dataset"].update(uri=str(folder), packing=False, evalSplit="validation")
    job["spec"]["hyperparameters"]["evalEverySteps"] = 2
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training 40 sequences on 2 processes" in result.stdout, result.stdout
    assert "held out: 12 sequences, evaluated every 2 steps and at the end" in result.stdout
    assert (f"data: training on {folder} split train (train.jsonl), evaluating on {folder} "
            "split validation (validation.jsonl)") in result.stdout
    assert "eval at step 2: loss" in result.stdout
    progress = json.loads((tmp_path / "out" / "progress.json").read_text())
    assert progress["step"] == 4 and progress["evalLoss"] > 0, progress

    job["spec"]["dataset"]["evalSplit"] = "dev"
    job["spec"]["output"]["uri"] = str(tmp_path / "again")
    refused = finetune_run(job, tmp_path / "again")
    assert refused.returncode == 2
    assert (f"{folder}: has no dev split (train: train.jsonl; validation: validation.jsonl; "
            "test: test.jsonl) — set spec.dataset.evalSplit to validation or test"
            ) in refused.stderr
    assert refused.stderr.count("has no dev split") == 1  # every rank's, said once


def test_early_stopping_counts_evaluations_that_do_not_improve():
    from finetune_trainer.checkpoint import TrainerState
    from finetune_trainer.config import Hyperparameters
    from finetune_trainer.train import judged, stopped_early

    hp = Hyperparameters(max_steps=100, eval_every_steps=10, early_stopping_patience=2,
                         early_stopping_threshold=0.01)
    state = TrainerState(step=10, epoch=0, step_in_epoch=10, tokens_seen=0, total_steps=100)
    state = judged(state, 2.0, 0.01)  # the first is the best so far
    assert (state.best_eval_loss, state.best_eval_step, state.evals_since_best) == (2.0, 10, 0)
    state = judged(replace(state, step=20), 1.995, 0.01)  # lower, but not by the threshold
    assert (state.best_eval_loss, state.evals_since_best) == (2.0, 1)
    assert stopped_early(state, hp) is None
    state = judged(replace(state, step=30), 1.5, 0.01)  # better: counting starts again
    assert (state.best_eval_loss, state.best_eval_step, state.evals_since_best) == (1.5, 30, 0)
    for step in (40, 50):
        state = judged(replace(state, step=step), 1.6, 0.01)
    assert stopped_early(state, hp) == (
        "stopped early at step 50 of 100: 2 evaluations in a row did not improve on the best eval "
        "loss, 1.5000 at step 30 by more than 0.01 (hyperparameters.earlyStoppingPatience: "
        "2); the export is of step 30, the best evaluation's")
    assert stopped_early(state, hp.model_copy(update={"early_stopping_patience": None})) is None


def early_stopping_job(model_dir: Path, output: Path, **kwargs) -> dict:
    """20 steps, an evaluation every 2 with a patience of 2 and a threshold no evaluation
    can clear (the first is the best, the run stops at step 6), keepLast 1."""
    job = manifest(model_dir, output, steps=20, **kwargs)
    job["spec"]["output"]["keepLast"] = 1
    job["spec"]["dataset"]["evalFraction"] = 0.2
    job["spec"]["hyperparameters"].update(evalEverySteps=2, earlyStoppingPatience=2,
                                          earlyStoppingThreshold=100.0)
    return job


def test_a_run_stops_early_when_its_eval_loss_stops_improving(tiny_model_dir, tmp_path):
    """earlyStoppingPatience: the run ends at the step whose evaluation used up the
    patience, as at its last (a checkpoint of that step, Succeeded), on every rank, and
    exports the best evaluation's weights from its checkpoint, which keepLast 1 did not
    prune; a rerun over the same output does not train past it. A threshold no evaluation
    can clear makes the first evaluation the best and every later one no better."""
    job = early_stopping_job(tiny_model_dir, tmp_path / "out")
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = re.search(r"^stopped early at step 6 of 20: 2 evaluations in a row did not "
                     r"improve on the best eval loss, ([\d.]+) at step 2 by more than 100 "
                     r"\(hyperparameters.earlyStoppingPatience: 2\); the export is of step 2, "
                     r"the best evaluation's$",
                     result.stdout, re.MULTILINE)
    assert said, result.stdout[-3000:]
    assert "step 7/20" not in result.stdout
    assert result.stdout.count("eval at step") == 3  # 2, 4, 6; no second one at the end
    output = tmp_path / "out"
    progress = json.loads((output / "progress.json").read_text())
    assert (progress["step"], progress["phase"]) == (6, "Succeeded"), progress
    assert progress["stoppedEarly"] == said[0]  # what the operator's status will say
    # the export's: the best evaluation's, which a sweep ranks the trial by
    assert progress["evalLoss"] == pytest.approx(float(said[1]), abs=1e-4)
    kept = complete_checkpoints(output)  # step 3 pruned, the best one kept
    assert [p.name for p in kept] == ["step-00000002", "step-00000006"]
    assert f"the export is of step 2, the best evaluation's (eval loss {said[1]}), loaded " \
           f"from {kept[0]}" in result.stdout
    exported = lora_weights(output / "final")
    assert exported == lora_weights(kept[0], tmp_path)  # the best's, not the stopping step's
    assert exported != lora_weights(kept[1], tmp_path)
    newest = kept[-1]
    state = json.loads((newest / "trainer_state.json").read_text())
    assert state["best_eval_step"] == 2 and state["evals_since_best"] == 2
    assert state["best_eval_loss"] == pytest.approx(float(said[1]), abs=1e-4)

    again = finetune_run(job, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "stopped early at step 6 of 20:" in again.stdout
    assert "; not training further" in again.stdout
    assert "step 7/20" not in again.stdout
    assert "the export is of step 2, the best evaluation's" in again.stdout  # exported again
    assert lora_weights(output / "final") == exported


def lora_weights(where: Path, scratch: Path | None = None) -> dict[str, list]:
    """The LoRA weights of an export (peft's adapter file) or of a checkpoint (its DCP
    model folder, converted), by peft's names, as lists (comparable with ==)."""
    from safetensors.torch import load_file

    weights = (load_file(where / "adapter_model.safetensors") if scratch is None
               else dcp_weights(where, scratch))
    return {name.replace(".default", ""): tensor.tolist() for name, tensor in weights.items()
            if "lora_" in name}


def dcp_weights(checkpoint: Path, scratch: Path) -> dict:
    """The model weights of a DCP checkpoint (ddp, fsdp), converted to one torch.save file
    in `scratch`."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint / "model", scratch / f"{checkpoint.name}.pt")
    return torch.load(scratch / f"{checkpoint.name}.pt", weights_only=True)["model"]


def test_unknown_lora_target_fails_before_any_process_starts(tiny_model_dir, tmp_path):
    job = manifest(tiny_model_dir, tmp_path / "out")
    job["spec"]["method"]["lora"]["targetModules"] = ["query_key_value"]
    result = finetune_run(job, tmp_path)
    assert result.returncode == 2
    assert "query_key_value is not a linear layer of LlamaForCausalLM" in result.stderr


def test_cluster_locations_are_refused_locally(tmp_path):
    job = manifest(tmp_path / "model", tmp_path / "out")
    job["spec"]["model"]["uri"] = "pvc://models/llama"
    result = finetune_run(job, tmp_path)
    assert result.returncode == 2
    assert "spec.model.uri: pvc:// locations exist only on the cluster" in result.stderr


def test_sigterm_while_starting_stops_at_once_without_a_checkpoint(tiny_model_dir, tmp_path):
    """A gang told to stop before its first step (a pod deleted during start-up) exits 143
    right away instead of waiting for torchrun's kill timeout."""
    job = manifest(tiny_model_dir, tmp_path / "out", method="full", steps=6)
    process = finetune_run(job, tmp_path, wait=False)
    seen = []
    for line in process.stdout:  # the preflight table comes after the handler is in place
        seen.append(line)
        if line.startswith("all-reduce preflight"):
            break
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output = "".join(seen) + process.communicate(timeout=waits.seconds_left())[0]
    assert process.returncode == 143, output
    assert "interrupted before the first checkpoint; run the same command to start again" in (
        output)
    assert time.monotonic() - signalled < 25  # torchrun would wait 30 s before killing
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_changed_learning_rate_resumes_and_takes_effect(tiny_model_dir, tmp_path):
    """trained_with leaves the learning rate out, as a setting a rerun may change: it
    resumed, but the schedule's state brought the checkpoint's peak rate back (steps 5-6 of
    a rerun at 5e-2 logged 1e-3). Now the new rate applies from the first resumed step."""
    job = manifest(tiny_model_dir, tmp_path / "out", steps=4, processes=1, batch=2,
                   checkpoint_every=4)
    job["spec"]["hyperparameters"].update(learningRate=1e-3, scheduler="constant")
    first = finetune_run(job, tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    job["spec"]["hyperparameters"].update(learningRate=5e-2, maxSteps=6)
    again = finetune_run(job, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming from" in again.stdout
    rates = {r["step"]: r["learningRate"] for r in map(
        json.loads, (tmp_path / "out" / "progress.jsonl").read_text().splitlines())}
    assert [rates[s] for s in (1, 4, 5, 6)] == pytest.approx([1e-3, 1e-3, 5e-2, 5e-2]), rates


def test_a_changed_job_is_refused_before_it_starts_and_fresh_starts_over(
        runs, tiny_model_dir, tmp_path):
    """The first hour's trap: change the LoRA rank and rerun into the same output folder.
    Refused in one line naming the field, before any process starts; `--fresh` sets the earlier
    run aside (kept: checkpoints, export, history) and trains."""
    output = tmp_path / "out"
    shutil.copytree(runs("ddp", "lora"), output)  # 6 steps done with r=4
    changed = manifest(tiny_model_dir, output, steps=2)
    changed["spec"]["method"]["lora"]["r"] = 8
    refused = finetune_run(changed, tmp_path / "rerun")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    # before the config is written: no model fetched or loaded, no process started
    assert "trainer config:" not in refused.stdout and "starting" not in refused.stdout
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in refused.stderr
    assert "method.lora.r: 4 → 8" in lines[0] and "finetune run --fresh" in lines[0]
    before = sorted(p.name for p in (output / "checkpoints").iterdir())

    # the trainer's own check (the pods' init container) says the same, with exit 4
    trainer_config = yaml.safe_load((output / ".finetune" / "trainer.yaml").read_text())
    trainer_config["method"]["lora"]["r"] = 8
    (tmp_path / "trainer.yaml").write_text(yaml.safe_dump(trainer_config))
    check = subprocess.run([sys.executable, "-m", "finetune_trainer", "--check-resume",
                            "--config", str(tmp_path / "trainer.yaml")],
                           capture_output=True, text=True, timeout=waits.seconds_left())
    assert check.returncode == 4 and "method.lora.r: 4 → 8" in check.stderr

    old_adapter = (output / "final" / "adapter_model.safetensors").read_bytes()
    old_history = (output / "progress.jsonl").read_text()
    fresh = finetune_run(changed, tmp_path / "rerun", "--fresh")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    (kept,) = output.glob("before-*")
    assert (f"--fresh: the earlier run's checkpoints, final, tensorboard, progress.json, "
            f"progress.jsonl are kept in {kept}; starting over") in fresh.stdout
    assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == before  # nothing deleted
    assert [p.name for p in (output / "checkpoints").iterdir()] == ["step-00000002"]
    # the earlier export and history too: the new run wrote its own beside them
    assert (kept / "final" / "adapter_model.safetensors").read_bytes() == old_adapter
    assert (kept / "progress.jsonl").read_text() == old_history
    assert (output / "final" / "adapter_model.safetensors").read_bytes() != old_adapter
    steps = [json.loads(line)["step"] for line in (output / "progress.jsonl").open()]
    assert steps == [1, 2], steps


def test_data_changed_on_purpose_trains_on_where_the_spec_says_so(runs, tiny_model_dir,
                                                                  tmp_path):
    """The data of a finished 6-step run, a record added (a copy edited in place): a rerun
    with maxSteps 7 is refused, naming the data and the field that allows it; with
    spec.output.resumeWithChangedData it resumes at step 6, says the data changed, and
    trains step 7."""
    output, data = tmp_path / "out", tmp_path / "data" / "chat.jsonl"
    shutil.copytree(runs("ddp", "lora"), output)
    data.parent.mkdir()
    data.write_text(DATA.read_text() + DATA.read_text().splitlines()[0] + "\n")
    job = manifest(tiny_model_dir, output, steps=7)
    job["spec"]["dataset"]["uri"] = str(data)
    refused = finetune_run(job, tmp_path / "edited")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"(dataset content: {DATA} (1 file, " in refused.stderr
    assert f"→ {data} (1 file, " in refused.stderr
    assert refused.stderr.rstrip().endswith(
        "or, if the data changed on purpose, set spec.output.resumeWithChangedData: true to "
        "train on from the checkpoint"), refused.stderr

    job["spec"]["output"]["resumeWithChangedData"] = True
    resumed = finetune_run(job, tmp_path / "edited")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "step-00000006 (step 6/7)" in resumed.stdout
    assert ("the data changed since that checkpoint (dataset content: " in resumed.stdout
            and "as spec.output.resumeWithChangedData allows" in resumed.stdout)
    steps = [json.loads(line)["step"] for line in (output / "progress.jsonl").open()]
    assert steps[-1] == 7, steps


def _checkpoint_payload(checkpoint: Path) -> int:
    """Bytes of the tensors a checkpoint holds: from DCP's metadata (its files add ~2 KB a
    tensor and rank, which only a tiny model notices), or DeepSpeed's state files."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    deepspeed = checkpoint / "model" / "deepspeed"
    if deepspeed.is_dir():
        return sum(f.stat().st_size for f in deepspeed.glob("*.pt"))
    entries = FileSystemReader(str(checkpoint / "model")).read_metadata().state_dict_metadata
    return sum(math.prod(e.size) * e.properties.dtype.itemsize for e in entries.values()
               if isinstance(e, TensorStorageMetadata))


@pytest.mark.parametrize(("strategy", "method"), [
    ("ddp", "full"), ("fsdp", "lora"), ("zero2", "full"), ("zero3", "full")])
def test_the_planners_output_volume_matches_what_a_run_writes(runs, tiny_model_dir, strategy,
                                                               method):
    """#17: a checkpoint and the final model take the space the planner's disk estimate
    says (within 15%): trainable weights and Adam moments, DeepSpeed's module copy under
    ZeRO, never the frozen base."""
    from finetune_operator.planner.plan import plan_job
    from finetune_operator.planner.sources import read_local
    from finetune_operator.validation import parse_job

    out = runs(strategy, method)
    job = parse_job(manifest(tiny_model_dir, out, strategy=strategy, method=method))
    plan = plan_job(job, read_local(tiny_model_dir), strategy)
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 2  # keepLast; the planner counts one more, being written
    assert _checkpoint_payload(checkpoints[-1]) == pytest.approx(
        plan.disk_breakdown["checkpoints"] / 3, rel=0.15)
    final = sum(f.stat().st_size for f in (out / "final").glob("*.safetensors"))
    assert final == pytest.approx(plan.disk_breakdown["finalModel"], rel=0.15)
    assert plan.disk_breakdown["modelCache"] == 0  # a folder, read where it is


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_sharded_run_stopped_early_exports_the_best_evaluations_weights(
        tiny_model_dir, tmp_path, strategy):
    """The best checkpoint comes back through the strategy's own load (DCP into FSDP's
    shards; DeepSpeed's `load_checkpoint`) before the export gathers every weight: each is
    step 2's, as its checkpoint holds it (DCP converted; ZeRO's fp32 masters read by
    DeepSpeed's `zero_to_fp32`), and not the stopping step's."""
    from safetensors.torch import load_file

    job = early_stopping_job(tiny_model_dir, tmp_path / "out", strategy=strategy,
                             method="full")
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "the export is of step 2, the best evaluation's" in result.stdout
    kept = complete_checkpoints(tmp_path / "out")
    assert [p.name for p in kept] == ["step-00000002", "step-00000006"]
    exported = load_file(tmp_path / "out" / "final" / "model.safetensors")

    def weights(checkpoint: Path) -> dict:
        if strategy == "fsdp":
            return dcp_weights(checkpoint, tmp_path)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / "model"),
                                                        tag="deepspeed")

    best, last = weights(kept[0]), weights(kept[1])
    assert set(exported) <= set(best), sorted(set(exported) - set(best))
    for name, tensor in exported.items():
        assert tensor.float().equal(best[name].float()), name
    assert any(not tensor.float().equal(last[name].float()) for name, tensor in exported.items())
