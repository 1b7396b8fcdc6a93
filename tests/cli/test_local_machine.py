"""`finetune run` on a machine unlike the spec's: it says so in one line and keeps the
spec's global batch, or refuses with the fix (#19, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune_operator.api import FineTuneJob
from finetune_operator.local.machine import MachineMismatch, as_run_here, fit_to_machine
from tests.conftest import REPO, minimal_job
from tests.support import waits

TRAINING_STACK_ONLY = str(REPO / "tests/support/training_stack_only")
"""On PYTHONPATH: the operator's client stack is refused in every process (its sitecustomize)."""


def job(nodes=2, gpus=8, batch=4, accumulation=1, processes=None) -> FineTuneJob:
    resources = {"nodes": nodes, "gpusPerNode": gpus}
    if processes:
        resources["processesPerNode"] = processes
    hyperparameters = {"maxSteps": 10, "batchSizePerDevice": batch,
                       "gradientAccumulationSteps": accumulation}
    return FineTuneJob.model_validate(minimal_job(resources=resources,
                                                  hyperparameters=hyperparameters))


def test_two_visible_gpus_keep_a_two_by_eight_jobs_global_batch():
    accumulation, notes = fit_to_machine(job(), processes=2, gpus=2)
    assert accumulation == 8  # 2 x 4 x 8 = 64 = 2 nodes x 8 GPUs x 4
    assert notes == ["2 local processes instead of the spec's 16: gradientAccumulationSteps 8 "
                     "keeps the global batch of 64 sequences"]


def test_cpu_instead_of_the_gpu_the_spec_asks_for_is_said():
    accumulation, notes = fit_to_machine(job(nodes=1, gpus=1), processes=1, gpus=0)
    assert accumulation == 1
    precision = job().spec.strategy.precision
    assert notes == ["no GPU is visible here: training on 1 CPU process instead of the 1 GPU "
                     "the spec asks for (slow; fine for a check), with the step settings and "
                     f"precision ({precision}) of the job on its GPUs, so that its checkpoints "
                     "resume there"]  # the GPU's micro-batch was said as if a GPU ran it


def test_the_same_machine_changes_nothing():
    assert fit_to_machine(job(nodes=1, gpus=0, processes=2), processes=2, gpus=0) == (1, [])


def test_a_global_batch_that_does_not_divide_is_refused_with_the_fix():
    with pytest.raises(MachineMismatch) as refused:
        fit_to_machine(job(nodes=1, gpus=0, processes=2, batch=3), processes=4, gpus=0)
    assert "global batch of 6 sequences" in str(refused.value)
    assert ("cannot be kept on 4 local processes — pass --nproc with a divisor of 2"
            in str(refused.value))


def test_more_processes_than_visible_gpus_are_refused_with_the_fix():
    with pytest.raises(MachineMismatch) as refused:
        fit_to_machine(job(nodes=1, gpus=8), processes=4, gpus=2)
    assert str(refused.value).startswith(
        "--nproc 4: this machine shows 2 GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi) and each "
        "GPU worker needs one of its own — pass --nproc 2 or fewer")
    assert fit_to_machine(job(nodes=1, gpus=8), processes=2, gpus=2)[0] == 4


def test_a_gpu_only_job_is_refused_where_no_gpu_is_visible():
    """QLoRA, or DeepSpeed in fp16, on the CPU processes `finetune run` falls back to: the
    rules a manifest of CPU workers meets, said before anything starts (the trainer refused
    it once per restart, then torchrun's traceback; DeepSpeed: 'Type fp16 is not supported
    on your device')."""
    qlora = job(nodes=1, gpus=1).model_copy(deep=True)
    qlora.spec.method.type = "qlora"
    with pytest.raises(MachineMismatch) as refused:
        fit_to_machine(qlora, processes=1, gpus=0)
    assert str(refused.value) == (
        "spec.method.type: qlora needs GPUs (bitsandbytes 4-bit kernels), and CPU workers "
        "(gpusPerNode: 0) have none — no GPU is visible here (CUDA_VISIBLE_DEVICES, else "
        "nvidia-smi), so `finetune run` would train on CPU processes: run it where one is")
    zero2 = job(nodes=1, gpus=2).model_copy(deep=True)
    zero2.spec.strategy.type, zero2.spec.strategy.precision = "zero2", "fp16"
    with pytest.raises(MachineMismatch, match=r"^spec.strategy.precision: fp16 under DeepSpeed"):
        fit_to_machine(zero2, processes=2, gpus=0)
    assert fit_to_machine(zero2, processes=2, gpus=2)[0] == 1  # on GPUs it runs


def finetune_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """`finetune ARGS` as a user types it in `folder` (where the manifest is)."""
    return subprocess.run([sys.executable, "-m", "finetune_operator.cli", *args], cwd=folder,
                          capture_output=True, text=True, timeout=waits.seconds_left())


def test_a_cpu_jobs_workers_see_no_gpu(monkeypatch):
    """A job of CPU workers on a machine with GPUs: the trainer takes the GPU of each
    worker's local rank wherever it sees one, so worker 1 of examples/01 failed on a machine
    with one GPU (on a GPU: test_gpu_training.py's test_a_cpu_job_trains_on_cpus_there)."""
    from finetune_operator.local.processes import worker_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert worker_env(2, verbose=False, on_gpus=False)["CUDA_VISIBLE_DEVICES"] == ""
    assert worker_env(1, verbose=False)["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_runs_collectives_bind_the_loopback_interface(monkeypatch):
    """#51, item 2: gloo (and NCCL) bind the address the host name resolves to, which the
    network reaches on a laptop whose name resolves to its LAN address; `finetune run`'s
    workers keep their sockets on the loopback interface (one a user set is kept)."""
    from finetune_operator.local.processes import worker_env

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    env = worker_env(2, verbose=False, on_gpus=False)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"  # Linux's name
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    assert worker_env(2, verbose=False, on_gpus=False)["GLOO_SOCKET_IFNAME"] == "eth1"


@pytest.mark.process
def test_finetune_run_refuses_it_before_anything_starts(tmp_path):
    manifest = minimal_job(model={"uri": "./model"}, dataset={"uri": "./data.jsonl"},
                           output={"uri": "./out"},
                           resources={"gpusPerNode": 0, "processesPerNode": 2},
                           hyperparameters={"maxSteps": 10, "batchSizePerDevice": 3})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # there: the machine is refused
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text("{}\n")
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "run", "job.yaml",
                             "--nproc", "4"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=waits.seconds_left())
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot be kept on 4 local processes" in result.stderr
    manifest["spec"]["resources"] = {"gpusPerNode": 8}  # more workers than GPUs here
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "run", "job.yaml",
                             "--nproc", "4"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=waits.seconds_left(),
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "job.yaml: --nproc 4: this machine shows 2 GPUs" in result.stderr
    manifest["spec"]["method"] = {"type": "qlora"}  # GPU-only, and no GPU is visible
    manifest["spec"]["strategy"] = {"precision": "bf16"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "run", "job.yaml"],
                            cwd=tmp_path, capture_output=True, text=True,
                            timeout=waits.seconds_left(),
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("job.yaml: spec.method.type: qlora needs GPUs")
    assert not (tmp_path / "out").exists()


@pytest.mark.process
def test_a_model_or_data_path_that_is_not_there_is_refused_before_anything_starts(tmp_path):
    """Before: the trainer's preflight found it 6 s later, prefixed `finetune-train:` with
    a hint about pvc:// mounts, and left out/.finetune/ and out/logs/run.lock behind."""
    manifest = minimal_job(model={"uri": "./tiny-lama"}, dataset={"uri": "./data.jsonl"},
                           output={"uri": "./out"},
                           resources={"gpusPerNode": 0, "processesPerNode": 1})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    result = finetune_in(tmp_path, "run", "job.yaml")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"job.yaml: spec.model.uri: {tmp_path / 'tiny-lama'} does not exist on this machine — "
        "fix the path (relative paths start at the manifest's folder): `finetune run` reads "
        "it on this machine",
        f"job.yaml: spec.dataset.uri: {tmp_path / 'data.jsonl'} does not exist on this "
        "machine — fix the path (relative paths start at the manifest's folder): `finetune "
        "run` reads it on this machine"]
    assert result.stdout == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.process
def test_an_empty_model_folder_or_data_file_is_refused_before_anything_starts(tmp_path):
    """There, but no saved model / no record: the trainer's checks found it 3-5 s later and
    left the output folder behind; `finetune validate` said nothing."""
    manifest = minimal_job(model={"uri": "./model"}, dataset={"uri": "./data.jsonl"},
                           output={"uri": "./out"},
                           resources={"gpusPerNode": 0, "processesPerNode": 1})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text("")
    finetune = [sys.executable, "-m", "finetune_operator.cli"]
    said = [f"job.yaml: spec.model.uri: {tmp_path / 'model'} holds no config.json, so it is "
            "not a saved model — point it at a folder written by save_pretrained (config.json "
            "and the weights)",
            f"job.yaml: spec.dataset.uri: {tmp_path / 'data.jsonl'} is empty — write at least "
            "one record to it, or name another file"]
    run = subprocess.run([*finetune, "run", "job.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=waits.seconds_left())
    assert run.returncode == 2 and run.stderr.splitlines() == said, run.stdout + run.stderr
    assert not (tmp_path / "out").exists()
    validate = subprocess.run([*finetune, "validate", "job.yaml"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=waits.seconds_left())
    # errors there too: a relative path means this machine, where nothing else can run it
    assert validate.stderr.splitlines()[1:] == said  # after the warning of relative paths


@pytest.mark.process
def test_a_model_the_checks_refuse_marks_the_run_failed_with_where_to_read_why(tmp_path):
    """A model the trainer cannot load (its config.json does not parse) fails its preflight:
    `finetune status` of the folder read `Stopped` ('interrupted, or ...'), not Failed as
    the README says of a failed run."""
    manifest = minimal_job(model={"uri": "./model"}, dataset={"uri": "./data.jsonl"},
                           output={"uri": "./out"},
                           resources={"gpusPerNode": 0, "processesPerNode": 1})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{not json")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    finetune = [sys.executable, "-m", "finetune_operator.cli"]
    run = subprocess.run([*finetune, "run", "job.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=waits.seconds_left())
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{tmp_path / 'model'}: cannot be loaded" in run.stderr, run.stderr
    status = subprocess.run([*finetune, "status", "out"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=waits.seconds_left())
    lines = status.stdout.splitlines()
    assert lines[0] == (f"demo  Failed  `finetune logs {tmp_path / 'out'}` shows why; once "
                        "mended, the same `finetune run` starts again (from the newest "
                        "checkpoint, if any)"), status.stdout
    assert lines[1].endswith("no step yet") and lines[-1].endswith(" UTC)")


@pytest.mark.parametrize(("accumulation", "expected"), [
    (3, 6),   # the spec's own machine: kept
    (24, 6),  # 1 process for 8: 6 divides 2 x 24
    (4, 2),   # 6 processes for 8: 2 x 4 = 8 sequences a step, the largest divisor of both
])
def test_the_micro_batch_divides_the_local_step_and_never_grows(accumulation, expected):
    """The spec's 8 workers run 2 x 3 sequences a step in one pass of 6; `finetune run` on
    another process count keeps a pass that divides its step and is no larger than the
    spec's."""
    from finetune_operator.trainer_config import build_trainer_config

    spec = minimal_job(resources={"nodes": 1, "gpusPerNode": 0, "processesPerNode": 8},
                       hyperparameters={"maxSteps": 10, "batchSizePerDevice": 2,
                                        "gradientAccumulationSteps": 3, "microBatchSize": 6},
                       model={"uri": "/models/tiny"}, dataset={"uri": "/data/train.jsonl"},
                       output={"uri": "/out"})
    here = as_run_here(FineTuneJob.model_validate(spec), processes=24 // accumulation,
                       accumulation=accumulation)
    local = build_trainer_config(here).hyperparameters
    assert local.gradient_accumulation_steps == accumulation
    assert local.micro_batch_size == expected


def test_the_job_run_here_is_one_node_of_the_local_workers():
    two_nodes = job(nodes=2, gpus=8, batch=4)
    on_gpus = as_run_here(two_nodes, processes=2, accumulation=8).spec
    assert (on_gpus.resources.nodes, on_gpus.resources.gpus_per_node) == (1, 2)
    assert on_gpus.hyperparameters.gradient_accumulation_steps == 8
    assert two_nodes.spec.resources.nodes == 2  # the spec itself is left as it is
    cpu = job(nodes=2, gpus=0, processes=4, batch=4)
    on_cpu = as_run_here(cpu, processes=3, accumulation=1).spec.resources
    assert (on_cpu.nodes, on_cpu.gpus_per_node, on_cpu.processes()) == (1, 0, 3)


@pytest.mark.process
def test_a_run_on_fewer_processes_than_the_spec_resumes_on_them(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """Stopped and started again on the same machine, a run whose accumulation was raised
    to keep the spec's global batch resumes: its checkpoints are compared with the settings
    it runs with here, not the spec's (they were refused: 'gradientAccumulationSteps 2 → 1')."""
    from tests.trainer.test_training import finetune_run, manifest

    spec = manifest(tiny_model_dir, tmp_path / "out", steps=4, checkpoint_every=2)
    # a cold datasets cache: the workers' first read of the data draws a bar (it showed)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    first = finetune_run(spec, tmp_path, "--nproc", "1")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "gradientAccumulationSteps 2 keeps the global batch" in first.stderr
    assert "on this machine, 1 node x 1 CPU process, " in first.stdout  # not the spec's 2
    assert "Generating train split" not in first.stdout + first.stderr
    assert "Generating train split" in (tmp_path / "out" / "logs" / "run.log").read_text()
    spec["spec"]["hyperparameters"]["maxSteps"] = 6
    again = finetune_run(spec, tmp_path, "--nproc", "1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resum" in again.stdout.lower() and "step-00000004" in again.stdout, again.stdout
    assert "step 6/6" in again.stdout
    log = (tmp_path / "out" / "logs" / "run.log").read_text().splitlines()
    starts = [line for line in log if line.startswith("=== finetune run, ")]
    assert len(starts) == 2 and log[0] == starts[0]  # where each run's lines begin
    ends = [line for line in log if line.startswith("done: model in ")]  # and end, as the
    assert len(ends) == 2 and log[-1] == again.stdout.splitlines()[-1]  # terminal said it
    assert log.index(ends[0]) < log.index(starts[1])
    # the same command once more: nothing left to do, said at once (it started the
    # workers, evaluated and exported the model again)
    done = finetune_run(spec, tmp_path, "--nproc", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].endswith(
        f"already done: 6/6 steps, the model is in {tmp_path / 'out' / 'final'} — raise "
        "hyperparameters.maxSteps to train on from the last checkpoint, or --fresh to start "
        "over")
    assert "starting" not in done.stdout


@pytest.mark.process
def test_the_training_stack_alone_plans_runs_and_follows_a_job(tiny_model_dir, tmp_path,
                                                              monkeypatch):
    """A GPU box given only the trainer's wheels (scripts/gpu-wheels.sh: no kopf, Kubernetes
    client, aiohttp, Optuna or Azure SDK) plans, runs and follows a job with the real
    commands, each of their processes refused those imports. Every manifest check loaded
    every backend, and the kubernetes one brought kopf and aiohttp: `finetune run` did not
    start there, nor `status` / `logs` of a run's folder."""
    from tests.trainer.test_training import manifest

    monkeypatch.setenv("PYTHONPATH", TRAINING_STACK_ONLY)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(tiny_model_dir, tmp_path / "out", steps=2)))
    said = {}
    for command in (["plan", str(path)], ["run", str(path), "--nproc", "1"],
                    ["status", str(path)], ["logs", str(tmp_path / "out")]):
        result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", *command],
                                capture_output=True, text=True, timeout=waits.seconds_left())
        assert result.returncode == 0, (command, result.stdout + result.stderr)
        said[command[0]] = result.stdout
    assert "verdict:" in said["plan"]
    assert said["status"].startswith("t-ddp-lora  Succeeded"), said["status"]
    assert f"exported {tmp_path / 'out' / 'final'}" in said["logs"]


@pytest.mark.process
def test_a_trainer_that_cannot_start_is_not_called_bad_input(tiny_model_dir, tmp_path,
                                                             monkeypatch):
    """A module missing where the trainer runs (on the GPU box: prometheus_client, which
    gpu-wheels.sh did not ship) fails the workers with its traceback and exit 5, what this
    environment cannot set up, restarted once at most; the run's exit 2 said "bad input" of
    a manifest, model and data that were fine."""
    from tests.trainer.test_training import manifest

    monkeypatch.setenv("PYTHONPATH", TRAINING_STACK_ONLY)
    monkeypatch.setenv("FINETUNE_ABSENT_MODULES", "prometheus_client")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(tiny_model_dir, tmp_path / "out", steps=2)))
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "run", str(path),
                             "--nproc", "1"], capture_output=True, text=True,
                            timeout=waits.seconds_left())
    assert result.returncode == 5, result.stdout + result.stderr
    assert "ModuleNotFoundError: No module named 'prometheus_client'" in result.stderr
    assert "(an import this image cannot do)" in result.stderr
    assert "restart 1 of at most 3" in result.stderr and "restart 2" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "training failed (exit 5): the line above says what the workers could not set up")


NVIDIA_SMI = """#!/bin/sh
# what nvidia-smi prints for this query on a machine with these cards; the arguments, for the test
echo "$@" > "$(dirname "$0")/args"
cat <<'ROWS'
NVIDIA H100 80GB HBM3, 81559, 61440, 9.0
NVIDIA H100 80GB HBM3, 81559, 80000, 9.0
ROWS
"""


@pytest.mark.process
def test_this_machine_is_planned_by_the_free_memory_nvidia_smi_reports(tmp_path, monkeypatch):
    """`finetune run` asks nvidia-smi (here a script printing what it prints for the query)
    about the GPUs its workers get, the ones CUDA_VISIBLE_DEVICES names: each worker gets
    the least free memory, and the catalog GPU's speed."""
    from finetune_operator.local.machine import described, this_machine

    (tmp_path / "nvidia-smi").write_text(NVIDIA_SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    machine = this_machine(processes=2)
    assert (tmp_path / "args").read_text().split() == [
        "--query-gpu=name,memory.total,memory.free,compute_cap",
        "--format=csv,noheader,nounits", "--id=2,3"]
    assert described(machine) == "2 x NVIDIA H100 80GB HBM3 (60.0 GiB free on each)"
    assert (machine.gpus, machine.gpu.memory_bytes) == (2, 61440 * 1024**2)
    assert machine.gpu.peak_flops_16bit == 989e12 and machine.gpu.bf16
    assert this_machine(processes=1).gpus == 1


@pytest.mark.process
def test_paths_a_run_cannot_use_are_refused_before_anything_is_written(tiny_model_dir,
                                                                       tmp_path):
    """Each was a traceback from deep inside the run (NotADirectoryError writing
    .finetune/, the trainer's "does not exist" for a model that is a file) or a preflight
    that passed a model folder without weights, whose workers then failed."""
    import shutil

    (tmp_path / "data.jsonl").write_text((REPO / "examples/data/tiny-chat.jsonl").read_text())
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    shutil.copytree(tiny_model_dir, tmp_path / "unweighted",
                    ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copytree(tiny_model_dir, tmp_path / "untokenized",
                    ignore=shutil.ignore_patterns("tokenizer.json"))
    cases = {
        ("./model", "./data.jsonl"): "spec.output.uri: {0}/data.jsonl is a file, not a folder",
        ("./model", "./data.jsonl/out"): "spec.output.uri: {0}/data.jsonl/out cannot be "
                                         "created: {0}/data.jsonl is a file",
        ("./data.jsonl", "./out"): "spec.model.uri: {0}/data.jsonl is a file, not a model folder",
        ("./unweighted", "./out"): "spec.model.uri: {0}/unweighted holds config.json but no "
                                   "weights (*.safetensors, *.bin)",
        ("./untokenized", "./out"): "spec.model.uri: {0}/untokenized holds no tokenizer "
                                    "(tokenizer.json, tokenizer.model or vocabulary files), "
                                    "which the trainer reads from the model's folder — save "
                                    "the model's tokenizer into it as well: "
                                    "tokenizer.save_pretrained(<the folder>)",
    }
    for (model, output), said in cases.items():
        manifest = minimal_job(model={"uri": model}, dataset={"uri": "./data.jsonl"},
                               output={"uri": output},
                               resources={"gpusPerNode": 0, "processesPerNode": 1})
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
        before = sorted(p.name for p in tmp_path.iterdir())
        run = finetune_in(tmp_path, "run", "job.yaml")
        assert run.returncode == 2, run.stdout + run.stderr
        fix = ("" if " — " in said else " — point spec.output.uri at a folder this user can "
               "write (it is created if missing)" if output != "./out" else " — point it at a "
               "folder written by save_pretrained (config.json and the weights)")
        assert run.stderr.splitlines() == [f"job.yaml: {said.format(tmp_path)}{fix}"], run.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.process
def test_ctrl_c_while_the_model_and_data_are_checked_ends_in_one_line(tiny_model_dir,
                                                                      tmp_path):
    """The terminal's SIGINT reaches its whole process group: a step before the workers
    printed a KeyboardInterrupt traceback, click said `Aborted!` and the exit was 1. Now the
    workers still loading are stopped as training is: one line, exit 143, the run not
    marked Failed."""
    import signal
    import time

    manifest = minimal_job(model={"uri": str(tiny_model_dir)},
                           dataset={"uri": str(REPO / "examples/data/tiny-chat.jsonl")},
                           output={"uri": "./out"},
                           resources={"gpusPerNode": 0, "processesPerNode": 1})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    run = subprocess.Popen([sys.executable, "-m", "finetune_operator.cli", "run", "job.yaml"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    seen = []
    for line in run.stdout:  # the workers start right after this line
        seen.append(line)
        if line.startswith("trainer config:"):
            break
    time.sleep(1)  # inside the workers' imports
    os.killpg(run.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
    output = "".join(seen) + run.communicate(timeout=waits.seconds_left())[0]
    assert run.returncode == 143, output
    assert output.splitlines()[-1] == ("interrupted before the first checkpoint; run the "
                                       "same command to start again"), output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert "Aborted" not in output
    assert not (tmp_path / "out" / "progress.json").exists()  # not Failed: nothing failed


@pytest.mark.process
def test_data_the_trainer_cannot_read_is_named_before_it_starts(tmp_path):
    """A .txt file, or a folder with no data file in it, passed `validate` and `finetune
    run` until the trainer's preflight refused it, the run marked Failed."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    (tmp_path / "notes.txt").write_text('{"text": "hello"}\n')
    (tmp_path / "empty").mkdir()
    said = {"./notes.txt": "{0}/notes.txt has an extension the trainer does not read (.txt) "
                           "— save it as one of .jsonl, .json, .parquet, .csv",
            "./empty": "{0}/empty holds no data file (.jsonl, .json, .parquet, .csv) — point "
                       "it at a data file or a folder of them"}
    for data, line in said.items():
        manifest = minimal_job(model={"uri": "./model"}, dataset={"uri": data},
                               output={"uri": "./out"},
                               resources={"gpusPerNode": 0, "processesPerNode": 1})
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
        run = finetune_in(tmp_path, "run", "job.yaml")
        assert run.returncode == 2, run.stdout + run.stderr
        assert run.stderr.splitlines() == [f"job.yaml: spec.dataset.uri: {line.format(tmp_path)}"]
        assert not (tmp_path / "out").exists()
        validate = finetune_in(tmp_path, "validate", "job.yaml")
        # an error: a relative path means this machine, where only `finetune run` reads it
        assert f"job.yaml: spec.dataset.uri: {line.format(tmp_path)}" in validate.stderr


def test_a_run_serves_its_metrics_on_loopback_from_ports_no_other_process_holds():
    """#51, item 2: `finetune run` serves each process's /metrics and /progress on 127.0.0.1
    only (a laptop's run is not served to its network); a second run beside one that holds
    the ports takes the next free ones and says so; a port asked for that is held is
    refused with the fix."""
    import socket

    from finetune_operator.local.ports import PortTaken, serving_here
    from finetune_operator.trainer_config import build_trainer_config
    from tests.trainer.test_metrics import metrics_ports

    first = metrics_ports(4)
    default = build_trainer_config(job(nodes=1, gpus=0, processes=2))
    assert (default.metrics.host, default.metrics.port) == ("0.0.0.0", 9108)  # in a pod
    assert not default.metrics.reuse_port  # a pod's ports are its own
    config = default.model_copy(update={"metrics": default.metrics.model_copy(
        update={"port": first})})

    here, said, hold = serving_here(config, processes=2)
    hold.close()
    assert (here.metrics.host, here.metrics.port) == ("127.0.0.1", first)
    assert said == (f"metrics: http://127.0.0.1:{first}/metrics, one per process: ports "
                    f"{first}-{first + 1}")
    with socket.socket() as other_run:  # another run's rank 1 listens there
        other_run.bind(("127.0.0.1", first + 1))
        other_run.listen()
        here, said, hold = serving_here(config, processes=2)
        hold.close()
        assert here.metrics.port == first + 2
        assert said == (f"metrics: http://127.0.0.1:{first + 2}/metrics, one per process: "
                        f"ports {first + 2}-{first + 3} (ports {first}-{first + 1} held by "
                        "another process)")
        with pytest.raises(PortTaken) as refused:
            serving_here(config, processes=1, asked=first + 1)
    assert str(refused.value) == (
        f"--metrics-port {first + 1}: port {first + 1} held by another process (another "
        "run?) — pass another port, or leave the option out to take the next free ones")


def test_the_ports_a_run_names_are_held_for_its_workers_until_it_ends():
    """The ports were found free when the `metrics:` line named them and bound only when the
    workers came up, after the model was fetched and loaded: meanwhile a connection the
    kernel gave one of them as its local port (a test's scrape, gloo's own), or another run
    choosing its ports then, took it, and that rank's /metrics was never served (a 2-process
    run's rank 1 on a busy machine, 11-28). Now `finetune run` holds them from the moment it
    names them: nothing binds them but the workers' endpoints, which listen beside the hold
    (each process's own), and another run started meanwhile takes the next ones."""
    import socket
    import urllib.request

    from finetune_operator.local.ports import CAN_HOLD, serving_here
    from finetune_operator.trainer_config import build_trainer_config
    from finetune_trainer.progress import ProgressServer
    from tests.trainer.test_metrics import metrics_ports

    if not CAN_HOLD:
        pytest.skip("no SO_REUSEPORT on this platform: the ports are only found free")
    first = metrics_ports(4)
    default = build_trainer_config(job(nodes=1, gpus=0, processes=2))
    config = default.model_copy(update={"metrics": default.metrics.model_copy(
        update={"port": first})})
    here, _, hold = serving_here(config, processes=2)
    try:
        assert here.metrics.port == first and here.metrics.reuse_port
        for port in (first, first + 1):  # nothing else binds them, a connection neither
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        beside, beside_said, beside_hold = serving_here(config, processes=2)  # another run
        beside_hold.close()
        assert beside.metrics.port == first + 2, beside_said
        # each worker's endpoint listens beside its port's hold, and alone answers
        servers = [ProgressServer(port, host="127.0.0.1", reuse_port=True)
                   for port in (first, first + 1)]
        try:
            for server in servers:
                assert server.httpd is not None and server.port in (first, first + 1)
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz",
                                            timeout=waits.seconds_left()) as answer:
                    assert answer.read() == b"ok\n"
        finally:
            for server in servers:
                server.close()
        # a restart's endpoints bind again: the hold kept the ports between attempts
        again = ProgressServer(first + 1, host="127.0.0.1", reuse_port=True)
        assert again.httpd is not None
        again.close()
    finally:
        hold.close()
    with socket.socket() as other:  # the run ended: another server may listen there again
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", first + 1))
        other.listen()


def test_a_long_path_is_named_whole_in_the_refusal(tmp_path):
    """A path longer than 80 characters was quoted and cut in the middle: the path the fix
    names could not be copied. (One with a line break is refused as no location at all.)"""
    from finetune_operator.local.paths import local_path_problems

    deep = tmp_path / ("a-rather-long-folder-name-" * 5) / "tiny-lama"
    job = FineTuneJob.model_validate(minimal_job(model={"uri": str(deep)}))
    (problem,) = local_path_problems(job, tmp_path, runs_here=True)
    assert len(str(deep)) > 120 and problem.message == f"{deep} does not exist on this machine"


def test_a_relative_path_that_is_not_there_is_an_error_an_absolute_one_a_warning(tmp_path):
    """A relative path means this machine (only `finetune run` reads one), so a missing one
    is wrong wherever it is checked; an absolute one may exist only inside the image."""
    from finetune_operator.local.paths import local_path_problems

    job = FineTuneJob.model_validate(minimal_job(model={"uri": "/models/llama"},
                                                 dataset={"uri": "./data/train.jsonl"}))
    model, data = local_path_problems(job, tmp_path)
    assert (model.path, model.severity) == ("spec.model.uri", "warning")
    assert (data.path, data.severity) == ("spec.dataset.uri", "error")
    assert data.message == f"{tmp_path / 'data/train.jsonl'} does not exist on this machine"
    assert data.fix == "fix the path (relative paths start at the manifest's folder)"
    relative_model = FineTuneJob.model_validate(minimal_job(model={"uri": "./model"}))
    (problem,) = local_path_problems(relative_model, tmp_path)
    assert problem.severity == "error" and problem.path == "spec.model.uri"


def test_the_demo_model_not_built_yet_says_make_demo_builds_it(tmp_path):
    """Examples 01 and 08 train the tiny model `make demo` builds: before it ran, their
    model path is missing, and the fix says what makes it (not "fix the path")."""
    from finetune_operator.local.paths import local_path_problems
    from finetune_trainer import layout

    examples = tmp_path / "examples"
    examples.mkdir()
    for name in ("01-tiny-cpu-lora.yaml", "08-dpo-lora.yaml"):
        manifest = yaml.safe_load((REPO / "examples" / name).read_text())
        job = FineTuneJob.model_validate(manifest)
        for runs_here in (False, True):
            model = next(p for p in local_path_problems(job, examples, runs_here=runs_here)
                         if p.path == "spec.model.uri")
            assert model.severity == "error"
            assert "does not exist on this machine" in model.message
            assert model.fix == ("run `make demo` first: it builds the tiny model these "
                                 f"examples use ({layout.DEMO_MODEL})")
    built = tmp_path / layout.DEMO_MODEL
    built.mkdir(parents=True)
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        (built / file).write_text("{}")
    job = FineTuneJob.model_validate(yaml.safe_load(
        (REPO / "examples/01-tiny-cpu-lora.yaml").read_text()))
    assert [p for p in local_path_problems(job, examples) if p.path == "spec.model.uri"] == []


def test_a_lora_adapter_as_the_model_is_named_with_the_way_to_a_whole_model(tmp_path):
    """SFT, then DPO from its export: final/ of a LoRA job is an adapter (no config.json),
    which `finetune run` and the trainer refused as `not a saved model` without saying what
    it is or how to get the model the DPO job needs (#58). Both say it in one wording."""
    from finetune_operator.local.paths import local_path_problems
    from finetune_operator.local.paths import unusable as _unusable
    from finetune_trainer import layout
    from finetune_trainer.config import ModelSource
    from finetune_trainer.model import ModelError, model_location

    adapter = tmp_path / "sft-output" / layout.FINAL_DIR
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    what, fix = layout.LORA_ADAPTER
    assert "LoRA adapter" in what
    assert "spec.output.mergeAdapter: true" in fix and f"{layout.MERGED_DIR}/" in fix
    assert _unusable(adapter, is_model=True) == (what, fix)
    job = FineTuneJob.model_validate(minimal_job(model={"uri": "./sft-output/final"}))
    (problem,) = local_path_problems(job, tmp_path, runs_here=True)
    assert str(problem) == f"spec.model.uri: {adapter} {what} — {fix}"
    with pytest.raises(ModelError) as refused:
        model_location(ModelSource(uri=str(adapter)))
    assert str(refused.value) == f"{adapter}: {what} — {fix}"
    (tmp_path / "empty").mkdir()  # no adapter either: as before
    assert _unusable(tmp_path / "empty", is_model=True)[0] == (
        "holds no config.json, so it is not a saved model")
