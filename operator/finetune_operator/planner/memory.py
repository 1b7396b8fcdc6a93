"""Per-GPU memory of one training process, as a breakdown a user can read.

The model follows what this repository's trainer does (finetune_trainer.model and
.parallel), not a generic textbook: trainable weights stay fp32 and compute runs in the
compute dtype; every strategy keeps LoRA's frozen base in the compute dtype (2 bytes a
weight in bf16/fp16: the adapters are the only fp32 weights); DDP allocates gradient
buckets as large as the gradients; FSDP2 shards the weights and gathers one decoder
layer at a time (two with prefetch) in the compute dtype, the root module (embeddings,
head) staying gathered through forward and backward; DeepSpeed ZeRO keeps a 16-bit
module and fp32 master weights, gradients and Adam moments partitioned as its own
estimators count them (2Ψ + 18Ψ/N for ZeRO-2, 18Ψ/N + 4·largest layer for ZeRO-3).

Memory peaks at one of two moments, and the total is the larger:
- `forwardBackward`: the end of the forward pass — every saved activation, the
  loss buffers, weights and optimizer states;
- `optimizerStep`: gradients, weights, optimizer states and the optimizer's own
  temporaries, with activations gone.
Activations per decoder layer are counted from the tensors autograd saves for a
Llama-style block (RMSNorm, q/k/v/o, SwiGLU) with memory-efficient attention (no s²
term), and LoRA dropout masks; with gradient checkpointing, one layer input per layer
plus one layer's activations recomputed in backward; with selective checkpointing, the
layer input and the matmul and attention outputs. The loss buffers are one chunk of fp32
logits with the fused loss (finetune_trainer.loss: the hidden-state and head gradients are
made in the forward pass), or every token's logits, fp32 copy and log-softmax without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from finetune_operator.planner.architecture import ModelShape
from finetune_trainer.config import (
    CheckpointPolicy,
    ConcreteStrategy,
    LoraConfig,
    MethodType,
    Offload,
    Precision,
)

GiB = 1024**3
CUDA_CONTEXT_BYTES = 1 * GiB
"""CUDA context, cuBLAS workspaces and NCCL channel buffers of one process (measured
0.5–1 GiB on A100/H100 with lazy module loading; the upper end is used)."""
NF4_BYTES_PER_PARAM = 4.127 / 8
"""bitsandbytes NF4 with double quantisation: 4 bits + 8-bit absmax per 64 weights +
fp32 second-level constants per 256 blocks."""
DEEPSPEED_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default reduce_bucket_size (elements): the gradient bucket ZeRO allocates."""
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000
"""DeepSpeed's default stage3_max_live_parameters."""
LOSS_BYTES_PER_LOGIT = 12
"""Without the fused loss: logits, their fp32 copy and log-softmax output per vocab entry
and token (4+4+4; bf16/fp16 logits are counted as fp32, 2 bytes over)."""
FUSED_LOSS_CHUNK_BYTES = 256 * 2**20
"""finetune_trainer.loss.CHUNK_BYTES: the fp32 logits of at most this many bytes at once."""
FUSED_LOSS_MIN_ROWS = 256
EAGER_ACTIVATIONS = 1.10
COMPILED_ACTIVATIONS = 0.87
"""What a decoder layer's saved tensors come to against the count below, measured
(`benchmarks/throughput.py --only gpu-8b-lora,gpu-8b-lora-eager`, one H100, torch 2.11,
11-27: Llama-3-8B shape, LoRA r16 all-linear, 2 x 4096 packed tokens, no checkpointing):
eager 72.8 GiB at its peak, where the count made 68.3 (its activations 1.09x the count);
per-layer torch.compile 56.1 GiB (0.76x): inductor's partitioner recomputes the element-
wise work (RMSNorm's fp32 copies, SwiGLU's activation) in backward instead of saving it.
Eager is counted 10% over, compiled at 0.87: the 8B job within +10% of its peak either
way, never under; the 1B and 3B runs of 11-23 (compiled, at older code) within -3%/+6%."""

# the trainer config's vocabularies, named once there: the planner plans what it can run
Method = MethodType
Strategy = ConcreteStrategy
Device = Literal["cuda", "cpu"]
_LORA = LoraConfig()

BREAKDOWN_LINES = ("weights", "gradients", "optimizerStates", "activations",
                   "temporaryBuffers", "cudaContext")


class TrainingSetup(BaseModel):
    """What one training process is asked to do."""

    model_config = ConfigDict(frozen=True)
    method: Method = "lora"
    lora_rank: int = _LORA.r
    lora_targets: list[str] = Field(default_factory=lambda: list(_LORA.target_modules))
    lora_dropout: float = _LORA.dropout
    strategy: Strategy = "ddp"
    offload: Offload = "none"
    precision: Precision = "bf16"
    micro_batch: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = True
    checkpoint_policy: CheckpointPolicy = "full"
    fused_loss: bool = True
    gradient_accumulation: int = 1
    world_size: int = 1
    compile: bool = False
    """Per-layer torch.compile (`strategy.compile`; DDP and FSDP2, not 4-bit layers): saves
    less per layer (COMPILED_ACTIVATIONS). Unset compile is planned eager, the larger."""
    reference_forward: bool = False
    """DPO with adapters: every batch also runs forward, without grad, with the adapters off
    (the reference); full weights take the reference once before training instead."""
    generation_rows: int = 0
    """GRPO: the completions a process samples at once (its share of a round); 0: none."""
    generation_tokens: int = 0
    """Each one's prompt and completion tokens at most: the KV cache's length."""
    generation_new_tokens: int = 0
    """Tokens sampled one after the other (maxCompletionLength): the decoding steps."""
    generation_every: int = 1
    """Optimizer steps a round of sampling serves (GRPO's iterations)."""
    reference_copy: bool = False
    """A frozen copy of the weights beside the model (GRPO with full weights and beta > 0),
    sharded as the model is (`reference_bytes`)."""
    device: Device = "cuda"
    """`cpu`: CPU workers (gloo) — no CUDA context, and AdamW runs its foreach kernels,
    which hold a temporary copy of the second moments; on CUDA the fused kernel does not."""


class MemoryEstimate(BaseModel):
    """Bytes per process at its peak, line by line."""

    breakdown: dict[str, int]
    """The lines at the peak moment (they sum to `total`)."""
    total: int
    temporary_buffers: dict[str, int]
    """What `temporaryBuffers` is made of at the peak (buckets, gathered parameters, loss
    buffers, ...)."""
    peak_phase: Literal["forwardBackward", "optimizerStep", "generation"]
    phases: dict[str, int]
    """Both candidate peaks, for the curious."""
    trainable_params: int
    total_params: int
    notes: list[str] = Field(default_factory=list)


def _bytes(precision: Precision) -> int:
    return 4 if precision == "fp32" else 2


def trainable_params(shape: ModelShape, setup: TrainingSetup) -> int:
    if setup.method == "full":
        return shape.total_params
    return shape.lora_params(setup.lora_rank, setup.lora_targets)


def quantized_params(shape: ModelShape) -> int:
    """Weights QLoRA stores in 4 bits: the decoder's nn.Linear layers. MoE experts are
    fused 3-D weights in transformers 5 and the router is no Linear either: bitsandbytes
    leaves them, and prepare_model_for_kbit_training then casts them to fp32."""
    return shape.num_layers * sum(x.fan_in * x.fan_out for x in shape.layer_linears()
                                  if not (shape.is_moe and x.name == "gate"))


def activation_bytes_per_layer_token(shape: ModelShape, setup: TrainingSetup,
                                     residual: int) -> float:
    """Bytes autograd saves for one decoder layer and one token, without checkpointing."""
    p = _bytes(setup.precision)
    h = shape.hidden_size
    norms = 2 * (4 + residual + p) * h + (shape.norms_per_layer - 2) * (4 + residual) * h
    attention = p * (3 * shape.q_dim + 2 * shape.kv_dim)
    if shape.is_moe:
        mlp = p * 4 * (shape.experts_per_token * shape.expert_intermediate_size
                       + shape.shared_expert_intermediate_size) + 4 * shape.num_experts
    else:
        mlp = p * 4 * shape.intermediate_size
    lora = 0.0
    if setup.method != "full" and setup.lora_dropout > 0:
        # each adapted linear drops out its own copy of the input: a mask byte and the
        # dropped input, cast to the adapters' dtype (peft): fp32 on replicas under
        # autocast, the compute dtype where FSDP gathers the adapters in it (measured)
        per_element = 1 + p if residual == 4 or setup.strategy == "fsdp" else 5
        targets = setup.lora_targets
        inputs = sum(x.fan_in for x in shape.layer_linears()
                     if targets == ["all-linear"] or x.name in targets)
        lora = per_element * inputs
    compiled = (setup.compile and setup.strategy in ("ddp", "fsdp")
                and setup.method != "qlora")
    return (norms + attention + mlp + lora) * (COMPILED_ACTIVATIONS if compiled
                                               else EAGER_ACTIVATIONS)


def selective_bytes_per_layer_token(shape: ModelShape, setup: TrainingSetup,
                                    residual: int) -> float:
    """Bytes selective checkpointing keeps for one layer and token: the layer input and
    the outputs of q/k/v/o, attention, and the MLP's matmuls."""
    p = _bytes(setup.precision)
    h = shape.hidden_size
    attention = p * (2 * shape.q_dim + 2 * shape.kv_dim + h) + 4 * shape.num_heads
    if shape.is_moe:
        mlp = p * (3 * (shape.experts_per_token * shape.expert_intermediate_size
                        + shape.shared_expert_intermediate_size) + h) + 4 * shape.num_experts
    else:
        mlp = p * (2 * shape.intermediate_size + h)
    return residual * h + attention + mlp


def loss_buffer_bytes(shape: ModelShape, setup: TrainingSetup, tokens: int,
                      residual: int) -> tuple[float, float]:
    """Bytes alive for the loss at the end of the forward pass: (freed before the first
    layer's backward, kept until the head's backward)."""
    vocab = shape.vocab_size
    if not setup.fused_loss:
        return tokens * LOSS_BYTES_PER_LOGIT * vocab, 0.0
    # one chunk of fp32 logits (and the 16-bit matmul output it is cast from) while the
    # forward pass ends; the hidden-state and head gradients it made wait for backward
    rows = min(tokens, max(FUSED_LOSS_MIN_ROWS, FUSED_LOSS_CHUNK_BYTES // (4 * vocab)))
    mixed = setup.precision != "fp32"
    chunk = rows * vocab * (4 + (_bytes(setup.precision) if mixed else 0))
    hidden_grad = tokens * residual * shape.hidden_size
    head_grad = 4 * shape.head_params if setup.method == "full" else 0
    return chunk, hidden_grad + head_grad


@dataclass
class StrategyMemory:
    """What a strategy keeps per process: its weights, gradients and optimizer states, the
    width of the residual stream its activations are saved in, and its temporary buffers
    by the phase they are alive in."""

    weights: float
    grads: float
    optimizer: float
    residual: int
    """Bytes per element of the activations between layers."""
    persistent: dict[str, float] = field(default_factory=dict)
    """Temporary buffers alive in both phases."""
    forward_only: dict[str, float] = field(default_factory=dict)
    """Alive at the end of the forward pass only."""
    grads_always: bool = False
    """Gradient storage allocated once and kept (DeepSpeed)."""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Sizes:
    """The parameter counts every strategy's arithmetic starts from."""

    p: int  # bytes per element in the compute dtype
    n: int  # ranks the states are sharded over
    total: int
    trainable: int
    frozen: int  # the base under LoRA and QLoRA, whose weights are all frozen
    base: float | None  # QLoRA's base: 4-bit linears, the rest in 16 or 32 bits
    mixed: bool


def _sizes(shape: ModelShape, setup: TrainingSetup) -> _Sizes:
    total = shape.total_params
    frozen = 0 if setup.method == "full" else total
    base = None
    if setup.method == "qlora":
        q = quantized_params(shape)
        # the other frozen parameters (norms, embeddings, head) stay in bf16; fp16 casts
        # them to fp32 for its range (finetune_trainer.model.load_model)
        kept = 2 if setup.precision == "bf16" else 4
        base = NF4_BYTES_PER_PARAM * q + kept * (frozen - q)
    return _Sizes(p=_bytes(setup.precision), n=setup.world_size, total=total,
                  trainable=trainable_params(shape, setup), frozen=frozen, base=base,
                  mixed=setup.precision != "fp32")


def ddp_memory(shape: ModelShape, setup: TrainingSetup, s: _Sizes) -> StrategyMemory:
    """Every rank holds the whole model; buckets as large as the trainable gradients."""
    method = setup.method
    residual = 4 if (method == "full" or not s.mixed
                     or (method == "qlora" and setup.precision != "bf16")) else s.p
    if method == "full":
        weights = 4.0 * s.total
    elif method == "lora":
        weights = s.p * s.frozen + 4.0 * s.trainable
    else:
        weights = s.base + 4.0 * s.trainable
    memory = StrategyMemory(weights, 4.0 * s.trainable, 8.0 * s.trainable, residual,
                            persistent={"ddpGradientBuckets": 4.0 * s.trainable})
    if s.mixed and method == "full":
        # autocast caches the 16-bit copy of every fp32 weight it casts for a matmul (all
        # but the embedding lookup) until the forward pass ends
        memory.forward_only["autocastWeightCopies"] = s.p * (
            s.total - shape.embedding_params * (0 if shape.tied_embeddings else 1))
    memory.notes.append("DDP: every rank holds the whole model; buckets as large as the "
                        "trainable gradients")
    return memory


def reference_bytes(setup: TrainingSetup, s: _Sizes) -> float:
    """A process's share of a frozen reference copy: FSDP2 shards it as it reads the trained
    model (fp32, gathered in the compute dtype layer by layer, as the model's own layers
    are), ZeRO-3 partitions it in the compute dtype; elsewhere each process holds it whole
    in the compute dtype."""
    if setup.strategy == "fsdp":
        return 4.0 * s.total / s.n
    if setup.strategy == "zero3":
        return s.p * s.total / s.n
    return float(s.p * s.total)


def fsdp_memory(shape: ModelShape, setup: TrainingSetup, s: _Sizes) -> StrategyMemory:
    """FSDP2: everything sharded; the root module and one prefetched layer gathered."""
    method, n = setup.method, s.n
    if method == "full":
        weights = 4.0 * s.total / n
    else:  # the frozen base in the compute dtype (4-bit for QLoRA), fp32 adapters
        weights = ((s.base if method == "qlora" else s.p * s.frozen) + 4.0 * s.trainable) / n
    memory = StrategyMemory(weights, 4.0 * s.trainable / n, 8.0 * s.trainable / n, s.p)
    if setup.offload == "cpu" and setup.device == "cuda":
        memory.weights, memory.grads, memory.optimizer = 0.0, 0.0, 0.0
        memory.notes.append("FSDP CPU offload: sharded weights, gradients and Adam on the "
                            "host")
    root = shape.embedding_params + shape.head_params + shape.hidden_size
    # the root kept gathered, one layer prefetched
    memory.forward_only["fsdpGatheredParameters"] = s.p * (root + 2 * shape.layer_params())
    if method == "full":
        # the root's gradients are reduced last: unsharded through the backward pass
        memory.forward_only["fsdpUnshardedRootGradients"] = s.p * (
            shape.head_params or shape.embedding_params)
    memory.notes.append("FSDP2: weights, gradients and Adam sharded over "
                        f"{n} rank{'s' if n > 1 else ''}; embeddings and head stay gathered"
                        + (f"; the frozen base in {setup.precision}, adapters in fp32"
                           if method == "lora" else ""))
    return memory


def zero_memory(shape: ModelShape, setup: TrainingSetup, s: _Sizes) -> StrategyMemory:
    """DeepSpeed ZeRO-1/2/3: a 16-bit module, fp32 master weights, states partitioned."""
    stage = int(setup.strategy.removeprefix("zero"))
    p, n, trainable = s.p, s.n, s.trainable
    module = (s.base if setup.method == "qlora" else p * s.frozen) + p * trainable
    # fp32 master copy of the trainable partition (a clone even when training in fp32)
    master = 4.0 * trainable / n
    grads32 = 4.0 * trainable / n
    if stage == 1:
        weights, grads16 = float(module), p * trainable
    elif stage == 2:
        weights, grads16 = float(module), (p * trainable / n if s.mixed else 0.0)
    else:
        weights, grads16 = module / n, 0.0
    memory = StrategyMemory(weights, grads16 + grads32, master + 8.0 * trainable / n, p,
                            grads_always=True)
    if setup.offload != "none":
        memory.grads, memory.optimizer = 0.0, 0.0
        if stage == 3:
            memory.weights = 0.0  # offload_param: the 16-bit partitions live on the host
        memory.notes.append(f"ZeRO offload to {setup.offload}: optimizer states and fp32 "
                            "gradients on the host")
    bucket = min(DEEPSPEED_REDUCE_BUCKET, trainable) if setup.device == "cpu" else (
        DEEPSPEED_REDUCE_BUCKET)  # torch.empty: only the touched part is resident on CPU
    memory.persistent["zeroReduceBucket"] = (4 if stage == 1 else p) * bucket
    if stage == 3:
        largest = shape.largest_layer_params()
        # DeepSpeed's own term: 16-bit parameters and gradients of the largest layer
        memory.persistent["zeroGatheredLayer"] = 2.0 * p * largest
        # parameters gathered in forward stay until backward while fewer than
        # stage3_max_live_parameters (1e9) are live: whole small models stay gathered
        memory.forward_only["zeroLiveParameters"] = p * max(
            0, min(s.total, DEEPSPEED_MAX_LIVE_PARAMETERS) - largest)
    memory.notes.append(f"DeepSpeed ZeRO-{stage}: {'16-bit' if s.mixed else 'fp32'} module, "
                        f"fp32 master weights, states partitioned over {n}")
    return memory


STRATEGY_MEMORY = {"ddp": ddp_memory, "fsdp": fsdp_memory, "zero1": zero_memory,
                   "zero2": zero_memory, "zero3": zero_memory}


def activation_bytes(shape: ModelShape, setup: TrainingSetup, residual: int
                     ) -> tuple[float, float]:
    """(activations, loss buffers) of one micro-batch at the end of the forward pass."""
    p = _bytes(setup.precision)
    tokens = setup.micro_batch * setup.seq_len
    per_layer = activation_bytes_per_layer_token(shape, setup, residual)
    outside = (residual + 4 + residual + p) * shape.hidden_size  # embeddings, final norm
    freed, held = loss_buffer_bytes(shape, setup, tokens, residual)
    if not setup.gradient_checkpointing:
        return tokens * (shape.num_layers * per_layer + outside), freed + held
    # each layer keeps its input (or, selective, its expensive outputs); the layer
    # recomputed in backward (after the freed loss buffers are gone) only adds where it is
    # larger than they were
    kept = (selective_bytes_per_layer_token(shape, setup, residual)
            if setup.checkpoint_policy == "selective" else residual * shape.hidden_size)
    recomputed = max(0.0, tokens * per_layer - freed)
    return tokens * (shape.num_layers * kept + outside) + recomputed, freed + held


def estimate_memory(shape: ModelShape, setup: TrainingSetup) -> MemoryEstimate:
    """The peak bytes of one process for `setup` on a model of `shape`: the strategy's
    states, one micro-batch's activations, and the larger of the two candidate peaks."""
    sizes = _sizes(shape, setup)
    memory = STRATEGY_MEMORY[setup.strategy](shape, setup, sizes)
    activations, loss_buffers = activation_bytes(shape, setup, memory.residual)
    step_only: dict[str, float] = {}  # alive during the optimizer step only
    if setup.device == "cpu" and not (setup.strategy.startswith("zero")
                                      and setup.offload != "none"):
        local = sizes.trainable / (1 if setup.strategy == "ddp" else sizes.n)
        step_only["optimizerStepTemporaries"] = 4.0 * local  # foreach AdamW: sqrt(v)
    context = CUDA_CONTEXT_BYTES if setup.device == "cuda" else 0
    accumulate = setup.gradient_accumulation > 1 or memory.grads_always
    temps = {"forwardBackward": {**memory.persistent, **memory.forward_only,
                                 "lossBuffers": loss_buffers},
             "optimizerStep": {**memory.persistent, **step_only}}
    phases = {
        "forwardBackward": {"weights": memory.weights,
                            "gradients": memory.grads if accumulate else 0.0,
                            "optimizerStates": memory.optimizer, "activations": activations},
        "optimizerStep": {"weights": memory.weights, "gradients": memory.grads,
                          "optimizerStates": memory.optimizer, "activations": 0.0}}
    if setup.generation_rows:
        # GRPO samples before the step's forward passes: no activations, no gradients
        # (zeroed), the KV cache of the round's completions and one position's logits
        kv = (2 * shape.num_layers * shape.kv_dim * sizes.p * setup.generation_rows
              * setup.generation_tokens)
        phases["generation"] = {"weights": memory.weights,
                                "gradients": memory.grads if memory.grads_always else 0.0,
                                "optimizerStates": memory.optimizer, "activations": 0.0,
                                "kvCache": kv + 4.0 * setup.generation_rows * shape.vocab_size}
        temps["generation"] = dict(memory.persistent)
    if setup.reference_copy:
        for phase in phases.values():
            phase["referenceWeights"] = reference_bytes(setup, sizes)
    lines = {phase: {**{k: int(v) for k, v in phases[phase].items()},
                     "temporaryBuffers": int(sum(temps[phase].values())),
                     "cudaContext": context} for phase in phases}
    totals = {phase: sum(lines[phase].values()) for phase in phases}
    peak = max(totals, key=lambda k: totals[k])
    notes = memory.notes
    if shape.approximate:
        notes.append(f"model_type {shape.model_type!r} is not one the planner was checked "
                     "against; counted as a Llama-style decoder")
    return MemoryEstimate(
        breakdown=lines[peak], total=totals[peak],
        temporary_buffers={k: int(v) for k, v in temps[peak].items()}, peak_phase=peak,
        phases=totals, trainable_params=sizes.trainable, total_params=sizes.total,
        notes=notes)
