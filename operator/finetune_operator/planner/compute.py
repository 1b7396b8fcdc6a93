"""FLOPs per token and an estimated step time on a named GPU.

Model FLOPs follow the PaLM / torchtitan convention: 6·N + 12·L·H·Q·T per trained token
(N: parameters except the embedding table, the output head included; L layers, H heads
of size Q, T sequence length). The GPU does more or less than that: LoRA computes no
weight gradients for the frozen base (4·N), and checkpointing repeats the forward pass
(+2·N). Step time divides the work by an assumed utilisation of the GPU's dense 16-bit
peak, and takes the larger of compute and gradient/parameter traffic (communication is
overlapped with compute by DDP buckets, FSDP prefetch and ZeRO's buckets).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from finetune_operator.gpu_catalog import VmSize
from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.memory import TrainingSetup, trainable_params
from finetune_trainer import flops

EXPECTED_MFU = {"H100-80GB": 0.40, "H200-141GB": 0.40, "H100-NVL-94GB": 0.40,
                "A100-40GB": 0.50, "A100-80GB": 0.50, "A100-80GB-PCIe": 0.50,
                "V100-32GB": 0.35, "V100-16GB": 0.35, "T4-16GB": 0.30}
"""Utilisation assumed when the job fits: ~40% on H100 and ~50% on A100 for 1B-70B
models are published single-node figures (torchtitan, ANCHORS.md); V100 and T4 have no
such anchor and get a conservative guess."""


COMPILE_SPEEDUP = 1.2
"""Per-layer torch.compile's gain on a step: 1.22x measured on one H100 (1B full, bf16,
4 x 4096 tokens, no checkpointing: 19,841 → 24,116 tokens/s, issue #22); DeepSpeed's
engines and 4-bit layers are not compiled, which makes it a reason to prefer DDP / FSDP."""


class Throughput(BaseModel):
    """The estimated speed; camelCase in `finetune plan -o json`, like the rest of the plan."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)
    model_flops_per_token: float
    """6·N + 12·L·H·Q·T: what MFU is measured against."""
    hardware_flops_per_token: float
    """What the GPU computes (LoRA skips frozen weight gradients; checkpointing recomputes)."""
    compute_seconds: float
    communication_seconds: float
    generation_seconds: float = 0.0
    """GRPO: sampling a round's completions, shared by its `iterations` steps: decoding
    reads every weight (and the KV cache) once per token, at the GPU's memory bandwidth."""
    step_seconds: float
    """One optimizer step (all micro-batches) on every GPU, its share of sampling in."""
    tokens_per_second: float
    """Summed over all GPUs."""
    assumed_mfu: float


def model_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """What published MFU figures use: every weight trained (the trainer's MFU series
    counts frozen LoRA bases at 4 instead of 6 FLOPs per parameter)."""
    n = shape.active_non_embedding_params + (shape.vocab_size * shape.hidden_size)
    return flops.model_flops_per_token(n, shape.num_layers, shape.num_heads * shape.head_dim,
                                       seq_len)


def hardware_flops_per_token(shape: ModelShape, setup: TrainingSetup) -> float:
    n = shape.active_non_embedding_params + shape.vocab_size * shape.hidden_size
    attention = 4.0 * shape.num_layers * shape.q_dim * setup.seq_len  # forward QK^T and AV
    forward = 2.0 * n + attention
    backward = (2.0 if setup.method == "full" else 1.0) * forward
    # selective checkpointing recomputes element-wise ops only: no matmul FLOPs
    full = setup.gradient_checkpointing and setup.checkpoint_policy == "full"
    recompute = forward if full else 0.0
    reference = forward if setup.reference_forward else 0.0
    return forward + backward + recompute + reference


def communication_bytes(shape: ModelShape, setup: TrainingSetup) -> float:
    """Bytes each rank moves per optimizer step (ring algorithms, (n-1)/n factors)."""
    n = setup.world_size
    if n == 1:
        return 0.0
    ring = (n - 1) / n
    p = 4 if setup.precision == "fp32" else 2
    trainable = trainable_params(shape, setup)
    total = shape.total_params
    if setup.strategy == "ddp":
        return 2 * ring * 4 * trainable  # all-reduce of fp32 gradients
    if setup.strategy in ("zero1", "zero2"):
        return ring * (p * trainable + p * trainable)  # reduce-scatter + all-gather
    # fsdp / zero3: gather parameters for forward and backward, reduce-scatter gradients
    micro = setup.gradient_accumulation
    return ring * (2 * micro * p * total + 4 * trainable)


DECODE_BANDWIDTH_USE = 0.6
"""The share of the memory bandwidth a decoding step uses (transformers' generate with a
KV cache; an assumption until measured on a GPU)."""


def generation_seconds(shape: ModelShape, setup: TrainingSetup, vm: VmSize) -> float:
    """A round's sampling on one GPU: prefill of the prompts at the step's utilisation,
    then each new token reads the weights and the (growing) KV cache once."""
    if not setup.generation_rows:
        return 0.0
    p = 4 if setup.precision == "fp32" else 2
    new = setup.generation_new_tokens
    prompt = max(setup.generation_tokens - new, 0)
    kv_per_token = 2 * shape.num_layers * shape.kv_dim * p * setup.generation_rows
    reads = new * (p * shape.total_params + kv_per_token * (prompt + new / 2))
    decode = reads / (vm.gpu.memory_bandwidth * DECODE_BANDWIDTH_USE)
    mfu = EXPECTED_MFU.get(vm.gpu.name, 0.35)
    prefill = (setup.generation_rows * prompt * 2.0 * shape.total_params
               / (vm.gpu.peak_flops_16bit * mfu))
    return decode + prefill


def estimate_throughput(shape: ModelShape, setup: TrainingSetup, vm: VmSize,
                        nodes: int) -> Throughput:
    mfu = EXPECTED_MFU.get(vm.gpu.name, 0.35)
    tokens_per_gpu = setup.micro_batch * setup.seq_len * setup.gradient_accumulation
    hardware = hardware_flops_per_token(shape, setup)
    compute = tokens_per_gpu * hardware / (vm.gpu.peak_flops_16bit * mfu)
    if setup.precision == "fp32":
        compute *= 8  # no 16-bit tensor cores (TF32 at best); an order-of-magnitude guess
    busbw = vm.gpu.nvlink_busbw or 12e9  # PCIe Gen4 all-reduce inside a VM
    if nodes > 1:
        busbw = min(busbw, vm.inter_node_busbw)
    communication = communication_bytes(shape, setup) / busbw
    generation = generation_seconds(shape, setup, vm)
    step = max(compute, communication) + generation / setup.generation_every
    return Throughput(model_flops_per_token=model_flops_per_token(shape, setup.seq_len),
                      hardware_flops_per_token=hardware, compute_seconds=compute,
                      communication_seconds=communication, generation_seconds=generation,
                      step_seconds=step,
                      tokens_per_second=tokens_per_gpu * setup.world_size / step,
                      assumed_mfu=mfu)
