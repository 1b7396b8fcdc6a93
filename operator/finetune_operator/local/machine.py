"""`finetune run` fitted to this machine: the processes it runs (the GPUs visible, else the
spec's CPU workers), the gradient accumulation that keeps the spec's global batch on them,
the job as run here (what is planned and what checkpoints record), and this machine's GPUs
as the planner sees a VM size."""

from __future__ import annotations

import math
import os
import shutil
import subprocess

from finetune_operator import gpu_catalog as catalog
from finetune_operator.api import FineTuneJob
from finetune_operator.planner import VmSize
from finetune_operator.planner.plan import gib
from finetune_operator.validation import setting_errors


def default_processes(job: FineTuneJob, gpus: int) -> int:
    """Processes on this machine: the spec's CPU workers, or the `gpus` that are visible."""
    resources = job.spec.resources
    if not resources.on_gpus:
        return resources.nodes * resources.processes()
    return max(1, min(gpus, resources.nodes * resources.gpus_per_node))


class MachineMismatch(ValueError):
    """The spec's global batch cannot be kept on this machine's processes."""


def fit_to_machine(job: FineTuneJob, processes: int, gpus: int) -> tuple[int, list[str]]:
    """The gradient accumulation that keeps the spec's global batch on `processes` local
    workers, and one line for each way this run differs from the spec (CPU instead of the
    GPUs it asks for, fewer or more workers). Raises MachineMismatch when the global batch
    does not divide."""
    spec, resources = job.spec, job.spec.resources
    hp = spec.hyperparameters
    world = resources.nodes * resources.processes()
    if resources.on_gpus and processes > gpus > 0:  # a worker each; the rest would fail
        raise MachineMismatch(
            f"--nproc {processes}: this machine shows {gpus} GPU{'s' if gpus > 1 else ''} "
            f"(CUDA_VISIBLE_DEVICES, else nvidia-smi) and each GPU worker needs one of its "
            f"own — pass --nproc {gpus} or fewer (more gradientAccumulationSteps keep the "
            "global batch)")
    notes = []
    if resources.on_gpus and gpus == 0:
        if refused := on_cpus_refused(job, processes):
            raise MachineMismatch(
                f"{refused} — no GPU is visible here (CUDA_VISIBLE_DEVICES, else nvidia-smi), so "
                "`finetune run` would train on CPU processes: run it where one is")
        sized = (f"{resources.gpu_type}'s GPUs" if resources.gpu_type else "its GPUs")
        notes.append(f"no GPU is visible here: training on {processes} CPU process"
                     f"{'es' if processes > 1 else ''} instead of the {world} GPU"
                     f"{'s' if world > 1 else ''} the spec asks for (slow; fine for a check), "
                     f"with the step settings and precision ({spec.strategy.precision}) of "
                     f"the job on {sized}, so that its checkpoints resume there")
    if processes == world:
        return hp.gradient_accumulation_steps, notes
    global_batch = world * hp.batch_size_per_device * hp.gradient_accumulation_steps
    per_step = processes * hp.batch_size_per_device
    if global_batch % per_step:
        raise MachineMismatch(
            f"spec.hyperparameters: the spec's global batch of {global_batch} sequences "
            f"({world} worker{'s' if world > 1 else ''} x batchSizePerDevice "
            f"{hp.batch_size_per_device} x "
            f"gradientAccumulationSteps {hp.gradient_accumulation_steps}) cannot be kept on "
            f"{processes} local process{'es' if processes > 1 else ''} — pass --nproc with a "
            f"divisor of {global_batch // hp.batch_size_per_device}, or change "
            "batchSizePerDevice")
    accumulation = global_batch // per_step
    notes.append(f"{processes} local process{'es' if processes > 1 else ''} instead of the "
                 f"spec's {world}: gradientAccumulationSteps {accumulation} keeps the global "
                 f"batch of {global_batch} sequences")
    return accumulation, notes


def on_cpus_refused(job: FineTuneJob, processes: int) -> str | None:
    """Why a GPU job cannot train on `processes` CPU workers (QLoRA's 4-bit kernels,
    DeepSpeed's fp16): the rules a manifest of CPU workers meets, asked of this one, so the
    trainer is not started to refuse it once per restart."""
    on_cpus = job.spec.resources.model_copy(update={
        "nodes": 1, "gpus_per_node": 0, "processes_per_node": processes})
    problems = setting_errors(job.model_copy(update={
        "spec": job.spec.model_copy(update={"resources": on_cpus})}))
    return "; ".join(f"{p.path}: {p.message}" for p in problems) or None


def as_run_here(job: FineTuneJob, processes: int, accumulation: int) -> FineTuneJob:
    """The job this machine runs: one node of `processes` workers (GPU workers where the
    spec asks for GPUs, planned as such even when none is visible), `fit_to_machine`'s
    accumulation, and a set microBatchSize the largest that still divides the step and is
    no larger than the spec's. What is planned, written to the trainer config and compared
    with the checkpoints' settings, so a run resumes on the machine it ran on."""
    spec = job.spec
    hp, resources = spec.hyperparameters, spec.resources
    here = ({"nodes": 1, "gpus_per_node": processes} if resources.on_gpus else
            {"nodes": 1, "processes_per_node": processes})
    step = {"gradient_accumulation_steps": accumulation}
    if hp.micro_batch_size is not None:
        step["micro_batch_size"] = math.gcd(hp.micro_batch_size,
                                            hp.batch_size_per_device * accumulation)
    return job.model_copy(update={"spec": spec.model_copy(update={
        "resources": resources.model_copy(update=here),
        "hyperparameters": hp.model_copy(update=step)})})


def this_machine(processes: int) -> VmSize | None:
    """The GPUs `processes` workers get here (the first visible ones, as CUDA assigns
    them), as the planner sees a VM size: by what nvidia-smi says is free on them now.
    None when nvidia-smi is missing or cannot say (an old driver without compute_cap)."""
    if shutil.which("nvidia-smi") is None:
        return None
    command = ["nvidia-smi", "--query-gpu=name,memory.total,memory.free,compute_cap",
               "--format=csv,noheader,nounits"]
    if listed := os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        command.append(f"--id={listed}")
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False,
                                timeout=60)
    except subprocess.TimeoutExpired:
        return None
    cards = catalog.cards_from_nvidia_smi(result.stdout)[:processes]
    if result.returncode != 0 or not cards:
        return None
    return catalog.this_machine(cards, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def described(machine: VmSize) -> str:
    """`this_machine` for people: its GPUs and what is free on each."""
    return (f"{machine.gpus} x {machine.gpu.name} ({gib(machine.gpu.memory_bytes)} free on "
            f"{'each' if machine.gpus > 1 else 'it'})")


def visible_gpus() -> int:
    if (listed := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return len([d for d in listed.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in result.stdout.splitlines())
