"""Before the model loads: whether the GPU has the room the plan needs.

The planner sizes a job for the whole GPU (the gpuType's memory; `finetune run` plans
for what nvidia-smi says is free at its start). Another process holding part of it — a
second job on a shared GPU, a notebook's kernel, a benchmark's leftover model — turns
"fits" into an out-of-memory error minutes later, after the model has loaded. Each rank
reads its GPU's free memory before allocating anything and says so, with the numbers.

A warning, not a refusal: the plan is an upper bound (the planner aims at up to 10% over
what a step holds, never under), and the other process may let go before the peak comes;
refusing would stop runs that fit. The warning names the other process's share and the
ways out, so an out-of-memory error that follows explains itself.
"""

from __future__ import annotations

import torch

HELD_ELSEWHERE = 2 * 2**30
"""In use on a GPU before this process allocated anything, beyond which it is worth saying
(this process's own CUDA context is about 0.5 GiB of what is in use then)."""


def _gib(value: int) -> str:
    return f"{value / 2**30:.1f} GiB"


def room_warning(where: str, free: int, total: int, planned: int | None) -> str | None:
    """What to say of a GPU (`where`, e.g. "rank 0's GPU 0") with `free` of `total` bytes
    free before this job's first allocation, for a plan peaking at `planned` bytes per
    process (None: not known); None when there is nothing to say."""
    held = total - free
    if planned is not None and planned > free:
        return (f"{where} has {_gib(free)} free of {_gib(total)} before this job allocated "
                f"anything, and the plan's peak is {_gib(planned)} per process: another "
                f"process holds {_gib(held)} of it (nvidia-smi names it). The run may run "
                "out of memory: free the GPU, or lower what a step holds "
                "(hyperparameters.microBatchSize, strategy.gradientCheckpointing: true)")
    if held > HELD_ELSEWHERE:
        fits = (f"; the plan's peak, {_gib(planned)} per process, fits in the {_gib(free)} "
                "left" if planned is not None else "")
        return (f"{where}: {_gib(held)} of its {_gib(total)} is in use before this job "
                f"allocated anything (another process: nvidia-smi names it){fits}")
    return None


def check_room(device, rank: int, planned: int | None) -> str | None:
    """`room_warning` for this rank's GPU, read now (before the model loads); printed and
    returned. Nothing on CPU workers."""
    if device.type != "cuda":
        return None

    free, total = torch.cuda.mem_get_info(device)
    warning = room_warning(f"rank {rank}'s GPU {device.index or 0}", free, total, planned)
    if warning is not None:
        print(f"warning: {warning}", flush=True)
    return warning
