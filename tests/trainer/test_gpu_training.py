"""GPU-only runs: QLoRA (bitsandbytes 4-bit), a CPU job beside the GPUs, bf16 over nccl, the
step sized for this GPU, MFU and NVML series, a step that never waits for the GPU, memory
another process holds, ZeRO with no op to build. Skipped without CUDA."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support import waits
from tests.trainer.test_training import DATA, finetune_run, losses, manifest

pytestmark = pytest.mark.gpu


def test_qlora_trains_and_exports_an_adapter(tiny_model_dir, tmp_path):
    job = manifest(tiny_model_dir, tmp_path / "out", method="qlora", precision="bf16",
                   processes=1, checkpointing=True)
    job["spec"]["resources"] = {"gpusPerNode": 1}
    result = finetune_run(job, tmp_path, "--nproc", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    trajectory = losses(tmp_path / "out")
    assert trajectory[-1] < trajectory[0]
    assert (tmp_path / "out/final/adapter_config.json").is_file()


def test_the_step_is_sized_for_the_gpu_it_runs_on(tiny_model_dir, tmp_path):
    """`finetune run` sizes unset checkpointing and micro-batch for this machine's GPU by
    its free memory (nvidia-smi), not for the spec's gpuType (a T4 here)."""
    job = manifest(tiny_model_dir, tmp_path / "out", precision="bf16", processes=1)
    del job["spec"]["strategy"]["gradientCheckpointing"]
    job["spec"]["resources"] = {"gpusPerNode": 1, "gpuType": "T4"}
    result = finetune_run(job, tmp_path, "--nproc", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step settings sized for this machine's 1 x " in result.stdout, result.stdout
    assert "gradientCheckpointing unset → off:" in result.stdout
    assert "per GPU fits with 10% headroom" in result.stdout
    assert "of 15.0 GiB per GPU" not in result.stdout  # the T4's


def test_a_cpu_job_trains_on_cpus_there(tiny_model_dir, tmp_path):
    """A job of CPU workers (examples/01, `make demo`) on a GPU machine: two workers, more
    than a one-GPU machine has, on CPUs as its plan says (each took its local rank's GPU)."""
    job = manifest(tiny_model_dir, tmp_path / "out", processes=2)
    result = finetune_run(job, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 node x 2 CPU processes" in result.stdout
    assert losses(tmp_path / "out")


def test_bf16_over_nccl_matches_fp32_closely(tiny_model_dir, tmp_path):
    runs = {}
    for precision in ("bf16", "fp32"):
        job = manifest(tiny_model_dir, tmp_path / precision / "out", method="full",
                       precision=precision, processes=1)
        job["spec"]["resources"] = {"gpusPerNode": 1}
        result = finetune_run(job, tmp_path / precision, "--nproc", "1")
        assert result.returncode == 0, result.stdout + result.stderr
        runs[precision] = losses(tmp_path / precision / "out")
        progress = json.loads((tmp_path / precision / "out/progress.json").read_text())
        assert progress["phase"] == "Succeeded"
    assert runs["bf16"] == pytest.approx(runs["fp32"], rel=2e-2)


def test_a_gpu_run_reports_mfu_and_nvml_series(tiny_model_dir, tmp_path):
    """On a GPU the MFU and the NVML series appear (absent on CPU, tested there)."""
    import signal
    import time

    from tests.trainer.test_metrics import metrics_ports, scrape

    job = manifest(tiny_model_dir, tmp_path / "out", method="full", precision="bf16",
                   processes=1, steps=400, checkpoint_every=1000)
    job["spec"]["resources"] = {"gpusPerNode": 1}
    port = metrics_ports(1)
    process = finetune_run(job, tmp_path, "--nproc", "1", "--metrics-port", str(port),
                           wait=False)
    try:
        deadline, seen = time.monotonic() + waits.seconds_left(), {}
        while time.monotonic() < deadline and process.poll() is None:
            seen = scrape(port)
            if "finetune_mfu" in seen and "finetune_gpu_utilization_ratio" in seen:
                break
            time.sleep(0.5)
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert 0 < seen["finetune_mfu"]["value"] < 1
        assert seen["finetune_gpu_memory_total_bytes"]["value"] > 2**30
        assert seen["finetune_gpu_power_watts"]["value"] > 0
        assert seen["finetune_step_phase_seconds"]["value"] >= 0
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=waits.seconds_left())


@pytest.mark.parametrize(("strategy", "method", "compiled"), [
    ("ddp", "lora", False), ("fsdp", "full", False), ("ddp", "full", True)])
def test_a_step_never_waits_for_the_gpu(tiny_model_dir, tmp_path, monkeypatch, strategy,
                                        method, compiled):
    """#22: no host synchronisation inside a training step; the loop reads the GPU only at
    log steps, checkpoints and evaluation, between steps. Every step after the first (lazy
    initialisation, compilation) runs under torch's sync debug mode set to error, so an
    `.item()`, a `nonzero`, a blocking copy to or from the GPU in the step raises. Log and
    checkpoint steps fall inside the run, with a background checkpoint written meanwhile."""
    import signal

    import torch

    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.parallel import _free_port
    from finetune_trainer.train import Trainer

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(name, value)
    config = TrainerConfig.model_validate({
        "job": {"name": f"nosync-{strategy}-{method}"}, "model": {"uri": str(tiny_model_dir)},
        "dataset": {"uri": str(DATA), "format": "chat", "maxSeqLength": 96},
        "method": {"type": method},
        "strategy": {"type": strategy, "precision": "bf16", "compile": compiled,
                     "gradientCheckpointing": False},
        "hyperparameters": {"maxSteps": 8, "batchSizePerDevice": 4, "microBatchSize": 2,
                            "logEverySteps": 3, "warmupRatio": 0.0},
        "output": {"uri": str(tmp_path / "out"), "checkpointEverySteps": 4},
        "metrics": {"port": _free_port()}, "preflight": {"enabled": False}})
    from torch._dynamo.callback import callback_handler

    guarded, compiled_in_steps = [], []
    running = []  # the guarded step under way, if one is
    train_step = Trainer.train_step

    def guarded_step(trainer) -> bool:
        if trainer.state.step == 0:
            return train_step(trainer)
        running.append(trainer.state.step + 1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return train_step(trainer)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            running.clear()
            guarded.append(trainer.state.step)

    # a compile inside a later step is a stall of its own, asserted below; Inductor's
    # constant folding reads tensors back while it compiles, so the guard is off meanwhile
    def compile_began(*args) -> None:
        if running:
            torch.cuda.set_sync_debug_mode(0)
            compiled_in_steps.append((running[0], *map(str, args)))

    def compile_ended(*_) -> None:
        if running:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(Trainer, "train_step", guarded_step)
    callback_handler.register_start_callback(compile_began)
    callback_handler.register_end_callback(compile_ended)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert Trainer(config, tmp_path).train() == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)  # the trainer's StopRequest took it
        callback_handler.remove_start_callback(compile_began)
        callback_handler.remove_end_callback(compile_ended)
    assert guarded == list(range(2, 9))
    # compiled layers are compiled in the first step only: one shape of row, the count of
    # samples' bounds dynamic (attention.forward_kwargs)
    assert compiled_in_steps == [], compiled_in_steps


@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_dpo_on_a_gpu_starts_at_ln2_and_learns_the_preference(tiny_model_dir, tmp_path,
                                                              method):
    """DPO in bf16 on one GPU (packed pairs through the GPU's attention path): at step 1
    the policy is its reference (adapters off, a 4-bit base for qlora; for full weights
    the table taken before the step), so the loss is ln 2; then the margin grows."""
    import math

    from tests.trainer.test_dpo import PAIRS, dpo_manifest, records

    job = dpo_manifest(tiny_model_dir, PAIRS, tmp_path / "out", method=method, processes=1,
                       batch=8, steps=12, checkpoint_every=100)
    job["spec"]["strategy"]["precision"] = "bf16"
    job["spec"]["resources"] = {"gpusPerNode": 1}
    if method == "qlora":
        job["spec"]["method"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    result = finetune_run(job, tmp_path, "--nproc", "1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = records(tmp_path / "out")
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=5e-3)
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert steps[-1]["objectiveMetrics"]["rewards/margins"] > 0.05


HOLD_GPU_MEMORY = ("import time, torch; held = torch.ones(6 * 2**30, dtype=torch.uint8, "
                   "device='cuda'); print('holding', flush=True); time.sleep(900)")


def test_memory_another_process_holds_is_said_before_the_model_loads(tiny_model_dir,
                                                                     tmp_path):
    """#63: a benchmark's leftover model took a third of an H100 and the plan said "fits";
    now each rank reads its GPU's free memory before allocating and says what another
    process holds, with the plan's peak beside it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_GPU_MEMORY], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        job = manifest(tiny_model_dir, tmp_path / "out", precision="bf16", processes=1)
        job["spec"]["resources"] = {"gpusPerNode": 1}
        result = finetune_run(job, tmp_path, "--nproc", "1")
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 0, result.stdout + result.stderr
    said = re.search(r"warning: rank 0's GPU 0: ([\d.]+) GiB of its [\d.]+ GiB is in use before "
                     r"this job allocated anything \(another process: nvidia-smi names it\); "
                     r"the plan's peak, [\d.]+ (GiB|MiB) per process, fits", result.stdout)
    assert said is not None, result.stdout
    assert float(said.group(1)) >= 6.0


@pytest.mark.parametrize(("strategy", "method"), [("zero2", "full"), ("zero3", "lora")])
def test_zero_on_a_gpu_builds_no_op_at_start(tiny_model_dir, tmp_path, strategy, method):
    """#59: on CPU workers DeepSpeed JIT-builds its shared-memory comm op (a compiler in the
    image, or the op built into it); on a GPU, ZeRO goes over NCCL with torch's AdamW and
    builds nothing, so the CUDA image starts it with no compiler at hand: here none can be
    found (CC and CXX are `false`, CUDA_HOME is nowhere) and the job trains."""
    job = manifest(tiny_model_dir, tmp_path / "out", strategy=strategy, method=method,
                   precision="bf16", processes=1)
    job["spec"]["resources"] = {"gpusPerNode": 1}
    result = finetune_run(job, tmp_path, "--nproc", "1", env={
        "CC": "false", "CXX": "false", "CUDA_HOME": str(tmp_path / "no-cuda-toolkit")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Error building extension" not in result.stdout + result.stderr
    assert losses(tmp_path / "out")
