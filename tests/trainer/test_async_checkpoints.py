"""Checkpoints written in the background (#17): training goes on while the previous
checkpoint is written (DCP under ddp and fsdp, our checkpoint engine under DeepSpeed), and
every guarantee of the synchronous saves still holds: a checkpoint is complete or absent,
at most one is in flight, `keepLast` prunes only after the newer one is complete, a failed
write is a CheckpointError, SIGTERM leaves a complete newest checkpoint and exits 143, and
a resume repeats the uninterrupted run exactly.

The `Checkpointer` itself on 2 gloo ranks (torchrun, a toy model), then real `finetune run`s
on the tiny model checkpointing every step or two.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune_trainer.checkpoint import complete_checkpoints
from tests.support import waits
from tests.support.bench_scripts import bench_script
from tests.trainer.test_faults import assert_same_weights
from tests.trainer.test_training import finetune_run, losses, manifest

GIB, MIB = 2**30, 2**20
BACKGROUND = re.compile(r"^checkpoint (\S+)/step-(\d{8}): staged in ([\d.]+) s, written in "
                        r"([\d.]+) s in the background", re.MULTILINE)
WAITED = re.compile(r"^checkpoint (\S+)/step-(\d{8}): written in ([\d.]+) s while training "
                    r"waited", re.MULTILINE)

def test_keep_last_never_prunes_the_best_evaluations_checkpoint():
    """Early stopping exports the best evaluation's weights from its checkpoint, so pruning
    passes it by, however many newer ones there are; without early stopping (no best)
    keepLast alone decides."""
    from finetune_trainer.checkpoint import prunable

    complete = [Path(f"/out/checkpoints/step-{step:08d}") for step in (2, 4, 6, 8)]
    assert [p.name for p in prunable(complete, 1, None)] == [
        "step-00000002", "step-00000004", "step-00000006"]
    assert [p.name for p in prunable(complete, 1, 4)] == ["step-00000002", "step-00000006"]
    assert [p.name for p in prunable(complete, 2, 2)] == ["step-00000004"]
    assert prunable(complete, 2, 8) == complete[:2]  # the newest is kept anyway


def test_a_background_save_stages_only_where_the_host_has_room(monkeypatch):
    """The staged copy stays in host memory until written: half of what is free, and on CPU
    workers (whose state is that memory) a twentieth of the process, #22's budget."""
    from finetune_trainer import checkpoint

    monkeypatch.setattr(checkpoint, "host_memory_free", lambda: 64 * GIB)
    monkeypatch.setattr(checkpoint, "_resident_bytes", lambda: 4 * GIB)
    assert checkpoint.staging_refused(17 * GIB, "cuda", 1) is None  # a 1.5B full fine-tune
    assert "more than half of the 64.0 GiB of host memory free" in checkpoint.staging_refused(
        17 * GIB, "cuda", 2)
    assert checkpoint.staging_refused(100 * MIB, "cpu", 2) is None  # LoRA adapters
    assert "more than a twentieth of the 4.0 GiB" in checkpoint.staging_refused(2 * GIB, "cpu", 1)
    monkeypatch.setattr(checkpoint, "host_memory_free", lambda: None)  # not Linux
    assert checkpoint.staging_refused(17 * GIB, "cuda", 8) is None


# --- the Checkpointer on 2 ranks ---------------------------------------------------------

SCRIPT = r'''
import resource, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

from finetune_trainer.checkpoint import (CheckpointError, Checkpointer, TrainerState,
                                         complete_checkpoints, load)
from finetune_trainer.config import Hyperparameters, StrategyConfig
from finetune_trainer.parallel import build_strategy, init_distributed
from finetune_trainer.train import StopRequest

out, kind = Path(sys.argv[1]), sys.argv[2]
root = out / "checkpoints"
device = init_distributed()
rank = dist.get_rank()


def make():
    torch.manual_seed(0)
    strategy = build_strategy(StrategyConfig(type=kind, precision="fp32"),
                              Hyperparameters(max_steps=8), device, ["Linear"])
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    strategy.setup(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    return strategy, torch.optim.lr_scheduler.LambdaLR(strategy.base_optimizer, lambda s: 1.0)


def train(strategy, scheduler):
    loss = strategy.model(torch.randn(8, 256)).pow(2).mean()
    strategy.backward(loss, boundary=True)
    strategy.step()
    scheduler.step()


def weights(strategy):  # collective under fsdp (full_tensor)
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in strategy.model.named_parameters()}


def moments(strategy):  # Adam's step and moments, in parameter order (collective under fsdp)
    optimizer = strategy.optimizer
    return [(v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for group in optimizer.param_groups for p in group["params"]
            for _, v in sorted(optimizer.state[p].items())]


def state(step):
    return TrainerState(step=step, epoch=0, step_in_epoch=step, tokens_seen=step, total_steps=8)


def expect(complete, partial):
    dist.barrier()  # every rank looks after rank 0 renamed and pruned
    found = ([p.name for p in complete_checkpoints(out)],
             sorted(p.name for p in root.glob("*.partial")))
    assert found == (complete, partial), found


strategy, scheduler = make()
stop = StopRequest()
said = []
checkpoints = Checkpointer(strategy, scheduler, out, keep_last=1, settings={"job": "t"},
                           say=said.append)
train(strategy, scheduler)
checkpoints.save(state(1))
# in flight: not complete until finished, whatever the thread has written meanwhile
expect([], ["step-00000001.partial"])
train(strategy, scheduler)
at_two, moments_at_two = weights(strategy), moments(strategy)
checkpoints.save(state(2))  # completes step 1 first: never two in flight
expect(["step-00000001"], ["step-00000002.partial"])
# the loop's per-step agreement: while any rank is still writing, no rank completes it...
agreement = stop.agree(dist.group.WORLD, writing=rank == 0)
assert not agreement.wait() and not agreement.written
# ...and once every rank's write has ended, every rank knows at the same step boundary
while checkpoints.writing():
    time.sleep(0.01)
agreement = stop.agree(dist.group.WORLD, writing=checkpoints.writing())
assert not agreement.wait() and agreement.written
train(strategy, scheduler)  # the weights change while step 2 is written
train(strategy, scheduler)
assert checkpoints.finish().name == "step-00000002"
expect(["step-00000002"], [])  # keepLast 1, pruned once 2 completed
assert checkpoints.finish() is None
assert all(" in the background" in line for line in said), said

fresh, fresh_scheduler = make()
assert load(fresh, fresh_scheduler, root / "step-00000002").step == 2
restored = weights(fresh)
assert all(torch.equal(restored[n], at_two[n]) for n in at_two)  # as staged, not as later
restored = moments(fresh)
assert len(restored) == len(moments_at_two) > 0
assert all(torch.equal(a, b) for a, b in zip(restored, moments_at_two))

checkpoints.save(state(3), background=False)  # SIGTERM's: complete on return
expect(["step-00000003"], [])
assert "while training waited" in said[-1], said

# a write that fails in the background: a shard file over the size limit (EFBIG)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # above the RNG file
train(strategy, scheduler)
checkpoints.save(state(4))  # staging succeeds; the failure comes with the write
try:
    checkpoints.finish()
    raise AssertionError("a failed background write went unnoticed")
except CheckpointError as error:
    message = str(error)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
assert f"{out}: writing checkpoint step-00000004.partial failed" in message, message
# DCP's per-rank failure (torch words EFBIG as "unexpected pos"): from the thread's write
assert "failed (rank 0: " in message or "failed (rank 1: " in message, message
assert "it resumes from step-00000003, which is complete and untouched" in message, message
expect(["step-00000003"], ["step-00000004.partial"])
if rank == 0:
    print("CHECKPOINTER OK " + " | ".join(said), flush=True)
dist.destroy_process_group()
'''


@pytest.mark.process
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_checkpointer_completes_one_write_at_a_time_and_surfaces_its_failure(
        tmp_path, strategy):
    script = tmp_path / "checkpointer.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script), str(tmp_path / "out"), strategy],
        capture_output=True, text=True, timeout=waits.seconds_left())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "CHECKPOINTER OK" in result.stdout, result.stdout


# --- real runs ---------------------------------------------------------------------------

STEPS = 20


def every_step_job(model_dir: Path, output: Path) -> dict:
    """A full fine-tune (weights compared whole) checkpointing after every step, so a write
    is in flight at almost any moment."""
    job = manifest(model_dir, output, method="full", steps=STEPS, checkpoint_every=1)
    job["metadata"]["name"] = "t-async"
    return job


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> tuple[Path, str]:
    where = tmp_path_factory.mktemp("async-uninterrupted")
    result = finetune_run(every_step_job(tiny_model_dir, where / "out"), where)
    assert result.returncode == 0, result.stdout + result.stderr
    return where / "out", result.stdout


@pytest.mark.process
def test_a_checkpoint_written_behind_is_complete_at_the_first_step_after_its_write(
        tiny_model_dir, tmp_path):
    """Once every rank's write has ended, the loop makes the checkpoint complete at that
    step boundary. It was completed only at the next save, so a crash between two saves
    resumed from the one before. Each rank says at the start of a step whether its write is
    still going, so a write that ends during step n completes the checkpoint at the end of
    step n + 1. Steps of 32 passes (~0.5 s here) give step 5's write (~0.4 s) the three
    steps before step 9 starts, several times what it needs."""
    job = manifest(tiny_model_dir, tmp_path / "out", method="full", steps=10,
                   checkpoint_every=5, accumulation=32)
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = result.stdout
    completed = text.index("/step-00000005: staged in")
    assert text.index("step 5/10 |") < completed < text.index("step 10/10 |"), text[-3000:]


@pytest.mark.process
def test_checkpoints_every_step_are_written_behind_training_and_complete(uninterrupted):
    output, log = uninterrupted
    names = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert names == [f"step-{STEPS - 1:08d}", f"step-{STEPS:08d}"]  # keepLast 2, no .partial
    assert all((output / "checkpoints" / name / "trainer_state.json").is_file()
               for name in names)
    background = BACKGROUND.findall(log)
    assert [int(step) for _, step, _, _ in background] == list(range(1, STEPS)), log
    # the last step's: no step left to write behind, so no host copy staged for it (#22)
    assert [int(step) for _, step, _ in WAITED.findall(log)] == [STEPS], log
    staged = [float(s) for _, _, s, _ in background]
    written = [float(w) for _, _, _, w in background]
    print(f"\nddp, tiny model, {len(staged)} checkpoints behind: training held "
          f"{sum(staged) / len(staged):.3f} s a save to stage it, "
          f"{sum(written) / len(written):.3f} s written in the background")


@pytest.mark.process
def test_sigterm_with_a_write_in_flight_leaves_a_complete_checkpoint_and_resumes_exactly(
        uninterrupted, tiny_model_dir, tmp_path):
    reference, _ = uninterrupted
    output = tmp_path / "out"
    job = every_step_job(tiny_model_dir, output)
    process = finetune_run(job, tmp_path, wait=False)
    deadline = time.monotonic() + waits.seconds_left()
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if json.loads((output / "progress.json").read_text())["step"] >= 3:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=waits.seconds_left())
    assert process.returncode == 143, log
    stopped_at = json.loads((output / "progress.json").read_text())["step"]
    assert 3 <= stopped_at < STEPS, log
    assert complete_checkpoints(output)[-1].name == f"step-{stopped_at:08d}"
    assert not list((output / "checkpoints").glob("*.partial"))
    # the write in flight completed first, then this step's was written before the exit
    in_background = [int(step) for _, step, _, _ in BACKGROUND.findall(log)]
    assert in_background == list(range(1, stopped_at)), log
    assert [int(step) for _, step, _ in WAITED.findall(log)] == [stopped_at], log
    assert log.rstrip().splitlines()[-1].startswith(f"interrupted; checkpoint at step "
                                                    f"{stopped_at} in "), log

    resumed = finetune_run(job, tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"step-{stopped_at:08d} (step {stopped_at}/{STEPS})" in resumed.stdout
    assert not list((output / "checkpoints").glob("*.partial"))
    assert losses(output) == pytest.approx(losses(reference), rel=1e-6)
    assert_same_weights(output, reference)


@pytest.mark.process
@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "zero3"])
def test_a_sharded_run_resumes_exactly_from_a_checkpoint_written_in_the_background(
        tiny_model_dir, tmp_path, strategy):
    """FSDP2's sharded (DTensor) state staged by DCP, DeepSpeed's partitioned optimizer
    state by our checkpoint engine, written behind training: a resume from the middle
    checkpoint repeats the last steps."""
    def job(output: Path) -> dict:
        made = manifest(tiny_model_dir, output, strategy=strategy, method="full", steps=6,
                        checkpoint_every=2)
        made["spec"]["output"].update(keepLast=3, asyncCheckpoints="on")
        return made

    first = tmp_path / "first"
    result = finetune_run(job(first / "out"), first)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [int(step) for _, step, _, _ in BACKGROUND.findall(result.stdout)] == [2, 4]
    assert [int(step) for _, step, _ in WAITED.findall(result.stdout)] == [6]  # the last
    assert [p.name for p in complete_checkpoints(first / "out")] == [
        "step-00000002", "step-00000004", "step-00000006"]
    assert not list((first / "out" / "checkpoints").glob("*.partial"))

    again = tmp_path / "again"
    shutil.copytree(first / "out" / "checkpoints", again / "out" / "checkpoints")
    shutil.rmtree(again / "out" / "checkpoints" / "step-00000006")
    resumed = finetune_run(job(again / "out"), again)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "step-00000004 (step 4/6)" in resumed.stdout
    assert losses(again / "out") == pytest.approx(losses(first / "out")[4:], rel=1e-6)
    assert_same_weights(again / "out", first / "out")


@pytest.mark.process
def test_with_async_checkpoints_off_the_loop_waits_and_each_checkpoint_completes_at_once(
        tiny_model_dir, tmp_path):
    """`output.asyncCheckpoints: off` (here under ZeRO-2): the loop waits for each write,
    and the checkpoint is complete before the next step (not at the next save)."""
    job = manifest(tiny_model_dir, tmp_path / "out", strategy="zero2", steps=4,
                   checkpoint_every=2)
    job["spec"]["output"]["asyncCheckpoints"] = "off"
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not BACKGROUND.findall(result.stdout)
    assert [int(step) for _, step, _ in WAITED.findall(result.stdout)] == [2, 4]
    log = result.stdout
    assert log.index("/step-00000002: written in") < log.index("step 3/4 |"), log
    assert [p.name for p in complete_checkpoints(tmp_path / "out")] == [
        "step-00000002", "step-00000004"]


@pytest.mark.process
def test_the_stall_benchmark_reads_every_checkpoint_of_both_sides(tiny_model_dir, tmp_path):
    """benchmarks/checkpoint_stall.py run small: it finds the trainer's line for every
    checkpoint, written in the background and synchronously (a reworded line fails here,
    not on the day the benchmark runs). Its figures are the benchmark's to print."""
    found = bench_script("checkpoint_stall").compare(tiny_model_dir, tmp_path, "ddp", steps=4,
                                                     every=2, repeats=1)
    assert {side: [len(run["stalls"]) for run in runs]
            for side, runs in found["runs"].items()} == {"background": [2], "sync": [2]}
    assert all(stall > 0 for runs in found["runs"].values() for run in runs
               for stall in run["stalls"])


def test_deepspeeds_files_are_staged_with_every_container_as_it_was():
    """The module states' `param_shapes` stay torch.Size (DeepSpeed's `zero_to_fp32` calls
    their `numel()`); every tensor is a copy the next step cannot change."""
    from collections import OrderedDict, namedtuple

    import torch

    from finetune_trainer.deepspeed_saves import staged_copy

    Pair = namedtuple("Pair", "weight step")
    weight = torch.ones(3)
    state = {"param_shapes": [OrderedDict(w=torch.Size([3]))], "pair": Pair(weight, 7),
             "tensors": (weight, [weight]), "version": "0.19"}
    staged = staged_copy(state)
    weight.add_(1)  # the optimizer's next step
    assert type(staged["param_shapes"][0]) is OrderedDict
    assert type(staged["param_shapes"][0]["w"]) is torch.Size
    assert type(staged["pair"]) is Pair and staged["pair"].step == 7
    assert type(staged["tensors"]) is tuple and type(staged["tensors"][1]) is list
    for copy in (staged["pair"].weight, staged["tensors"][0], staged["tensors"][1][0]):
        assert copy.equal(torch.ones(3))
    assert staged["version"] == "0.19"
