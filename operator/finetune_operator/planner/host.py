"""Host memory of one node, as a breakdown a user can read (#17).

What the ranks of the node holding the most (node 0, where rank 0 reads the model) keep
in host memory, following what the trainer does (finetune_trainer.model.Loading):
- while loading: replicas on GPUs (ddp, zero1, zero2) and QLoRA read straight onto each
  GPU; FSDP builds the model empty on every rank and rank 0 reads the weights one at a
  time (from a whole from_pretrained copy where the checkpoint cannot be streamed: one copy
  of the weights in the dtype they are read in, counted so); ZeRO-3 builds it partitioned
  and rank 0 reads the checkpoint whole (one copy) while the partitions fill, on the host
  too under parameter offload. CPU workers read a copy per replica.
- while training: what CPU offload moves off the GPUs (FSDP: the rank's shard of weights,
  gradients and Adam moments; ZeRO: fp32 master weights, gradients and Adam moments, and
  under ZeRO-3 the 16-bit parameter partitions), for every rank of the node. NVMe offload
  keeps them on disk. Background checkpoints stage only where half the free host memory
  holds them (output.asyncCheckpoints: auto), so they are not counted.
- every process: torch, the CUDA libraries and context, NCCL, the tokenised dataset.
The node's peak is its processes plus the larger of the two phases.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.memory import NF4_BYTES_PER_PARAM, TrainingSetup, trainable_params

GiB = 1024**3
PROCESS_BYTES = 2 * GiB
"""Host memory of one training process beside the model. About 0.4 GiB measured on CPU
workers (torch, transformers, gloo: benchmarks/loading_memory.py measures above it); on
GPUs the CUDA context's host side, the CUDA libraries and NCCL's buffers add to it. An
allowance, not a measurement on GPUs."""

HOST_LINES = ("weightsWhileLoading", "offloadedTrainingState", "processes")


class HostMemoryEstimate(BaseModel):
    """Bytes of host memory on node 0 at its peak, line by line."""

    breakdown: dict[str, int]
    """`weightsWhileLoading`, `offloadedTrainingState` (the phase not at the peak shown
    too), `processes`."""
    total: int
    peak_phase: Literal["loading", "training"]
    ranks_per_node: int
    notes: list[str] = Field(default_factory=list)


def read_copy_bytes(shape: ModelShape, setup: TrainingSetup) -> float:
    """Bytes of the whole model one rank reads into host memory while loading (0: read
    straight onto the GPU or one weight at a time)."""
    p = 4 if setup.precision == "fp32" else 2
    if setup.method == "qlora":
        return 0.0 if setup.device == "cuda" else NF4_BYTES_PER_PARAM * shape.total_params
    if setup.strategy in ("ddp", "zero1", "zero2") and setup.device == "cuda":
        return 0.0
    if setup.strategy == "zero3":
        return float(p * shape.total_params)  # read into the compute-dtype partitions
    # from_pretrained's dtype: fp32 master weights for a full fine-tune, the compute dtype
    # for LoRA's frozen base
    return float((4 if setup.method == "full" else p) * shape.total_params)


def offloaded_bytes(shape: ModelShape, setup: TrainingSetup) -> tuple[float, float]:
    """(16-bit or fp32 weights, the rest of the training state) one rank keeps on the host
    under CPU offload."""
    if setup.offload != "cpu" or setup.device != "cuda":
        return 0.0, 0.0
    p = 4 if setup.precision == "fp32" else 2
    n, total = setup.world_size, shape.total_params
    trainable = trainable_params(shape, setup)
    frozen = 0 if setup.method == "full" else total
    if setup.strategy == "fsdp":
        weights = (4.0 * total if setup.method == "full" else p * frozen + 4.0 * trainable) / n
        return weights, 12.0 * trainable / n  # gradients, Adam's two moments
    if setup.strategy.startswith("zero"):
        weights = p * (frozen + trainable) / n if setup.strategy == "zero3" else 0.0
        return weights, 16.0 * trainable / n  # fp32 gradients, master weights, moments
    return 0.0, 0.0


def estimate_host_memory(shape: ModelShape, setup: TrainingSetup,
                         ranks_per_node: int) -> HostMemoryEstimate:
    """Node 0's peak host memory for `setup` with `ranks_per_node` ranks on each node."""
    read = read_copy_bytes(shape, setup)
    replicas = setup.device == "cpu" and setup.strategy in ("ddp", "zero1", "zero2")
    read *= ranks_per_node if replicas else 1  # else rank 0 alone reads
    weights, state = (x * ranks_per_node for x in offloaded_bytes(shape, setup))
    # ZeRO-3's partitions fill while rank 0 still holds its copy; FSDP's copy shrinks as
    # its shards fill
    loading = read + (weights if setup.strategy == "zero3" else 0.0)
    training = weights + state
    processes = float(PROCESS_BYTES * ranks_per_node)
    lines = {"weightsWhileLoading": int(loading), "offloadedTrainingState": int(training),
             "processes": int(processes)}
    notes = []
    if setup.offload == "nvme":
        notes.append("NVMe offload: optimizer states (and ZeRO-3 parameters) on disk, not "
                     "in host memory")
    return HostMemoryEstimate(
        breakdown=lines, total=int(processes + max(loading, training)),
        peak_phase="loading" if loading >= training else "training",
        ranks_per_node=ranks_per_node, notes=notes)
