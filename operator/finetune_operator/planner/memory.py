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

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from finetune_operator.planner.architecture import ModelShape

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

Method = Literal["full", "lora", "qlora"]
Strategy = Literal["ddp", "fsdp", "zero1", "zero2", "zero3"]
Offload = Literal["none", "cpu", "nvme"]
Precision = Literal["bf16", "fp16", "fp32"]
CheckpointPolicy = Literal["full", "selective"]
Device = Literal["cuda", "cpu"]

BREAKDOWN_LINES = ("weights", "gradients", "optimizerStates", "activations",
                   "temporaryBuffers", "cudaContext")


class TrainingSetup(BaseModel):
    """What one training process is asked to do."""

    model_config = ConfigDict(frozen=True)
    method: Method = "lora"
    lora_rank: int = 16
    lora_targets: list[str] = Field(default_factory=lambda: ["all-linear"])
    lora_dropout: float = 0.05
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
    peak_phase: Literal["forwardBackward", "optimizerStep"]
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
    return norms + attention + mlp + lora


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


def estimate_memory(shape: ModelShape, setup: TrainingSetup) -> MemoryEstimate:
    """The peak bytes of one process for `setup` on a model of `shape`."""
    p = _bytes(setup.precision)
    n = setup.world_size
    total = shape.total_params
    trainable = trainable_params(shape, setup)
    # adapters come on top of the base, whose weights are all frozen
    frozen = 0 if setup.method == "full" else total
    tokens = setup.micro_batch * setup.seq_len
    layer = shape.layer_params()
    root = shape.embedding_params + shape.head_params + shape.hidden_size
    mixed = setup.precision != "fp32"
    notes: list[str] = []
    strategy, offload, method = setup.strategy, setup.offload, setup.method

    persistent: dict[str, float] = {}  # temporary-buffer lines alive in both phases
    forward_only: dict[str, float] = {}  # alive at the end of the forward pass only
    step_only: dict[str, float] = {}     # alive during the optimizer step only
    grads_always = False      # gradient storage allocated once and kept (DeepSpeed)

    if method == "qlora":
        q = quantized_params(shape)
        # the other frozen parameters (norms, embeddings, head) stay in bf16; fp16 casts
        # them to fp32 for its range (finetune_trainer.model.load_model)
        kept = 2 if setup.precision == "bf16" else 4
        base = NF4_BYTES_PER_PARAM * q + kept * (frozen - q)
    else:
        base = None

    if strategy == "ddp":
        residual = 4 if (method == "full" or not mixed
                         or (method == "qlora" and setup.precision != "bf16")) else p
        if method == "full":
            weights = 4.0 * total
        elif method == "lora":
            weights = p * frozen + 4.0 * trainable
        else:
            weights = base + 4.0 * trainable
        grads = 4.0 * trainable
        optimizer = 8.0 * trainable
        persistent["ddpGradientBuckets"] = 4.0 * trainable
        if mixed and method == "full":
            # autocast caches the 16-bit copy of every fp32 weight it casts for a matmul
            # (all but the embedding lookup) until the forward pass ends
            forward_only["autocastWeightCopies"] = p * (total - shape.embedding_params * (
                0 if shape.tied_embeddings else 1))
        notes.append("DDP: every rank holds the whole model; buckets as large as the "
                     "trainable gradients")
    elif strategy == "fsdp":
        compute = p
        residual = compute
        if method == "full":
            weights = 4.0 * total / n
        else:  # the frozen base in the compute dtype (4-bit for QLoRA), fp32 adapters
            weights = ((base if method == "qlora" else p * frozen) + 4.0 * trainable) / n
        grads = 4.0 * trainable / n
        optimizer = 8.0 * trainable / n
        gathered = compute * (root + 2 * layer)  # root kept gathered, one layer prefetched
        if offload == "cpu" and setup.device == "cuda":
            weights, grads, optimizer = 0.0, 0.0, 0.0
            notes.append("FSDP CPU offload: sharded weights, gradients and Adam on the host")
        forward_only["fsdpGatheredParameters"] = gathered
        if method == "full":
            # the root's gradients are reduced last: unsharded through the backward pass
            forward_only["fsdpUnshardedRootGradients"] = compute * (
                shape.head_params or shape.embedding_params)
        notes.append("FSDP2: weights, gradients and Adam sharded over "
                     f"{n} rank{'s' if n > 1 else ''}; embeddings and head stay gathered"
                     + (f"; the frozen base in {setup.precision}, adapters in fp32"
                        if method == "lora" else ""))
    else:  # DeepSpeed ZeRO
        stage = int(strategy.removeprefix("zero"))
        residual = p
        module = (base if method == "qlora" else p * frozen) + p * trainable
        # fp32 master copy of the trainable partition (a clone even when training in fp32)
        master = 4.0 * trainable / n
        grads32 = 4.0 * trainable / n
        if stage == 1:
            weights, grads16 = float(module), p * trainable
        elif stage == 2:
            weights, grads16 = float(module), (p * trainable / n if mixed else 0.0)
        else:
            weights, grads16 = module / n, 0.0
        grads = grads16 + grads32
        optimizer = master + 8.0 * trainable / n
        grads_always = True
        if offload != "none":
            grads, optimizer = 0.0, 0.0
            if stage == 3:
                weights = 0.0  # offload_param: the 16-bit partitions live on the host
            notes.append(f"ZeRO offload to {offload}: optimizer states and fp32 gradients "
                         "on the host")
        bucket = min(DEEPSPEED_REDUCE_BUCKET, trainable) if setup.device == "cpu" else (
            DEEPSPEED_REDUCE_BUCKET)  # torch.empty: only the touched part is resident on CPU
        persistent["zeroReduceBucket"] = (4 if stage == 1 else p) * bucket
        if stage == 3:
            largest = shape.largest_layer_params()
            # DeepSpeed's own term: 16-bit parameters and gradients of the largest layer
            persistent["zeroGatheredLayer"] = 2.0 * p * largest
            # parameters gathered in forward stay until backward while fewer than
            # stage3_max_live_parameters (1e9) are live: whole small models stay gathered
            forward_only["zeroLiveParameters"] = p * max(
                0, min(total, DEEPSPEED_MAX_LIVE_PARAMETERS) - largest)
        notes.append(f"DeepSpeed ZeRO-{stage}: {'16-bit' if mixed else 'fp32'} module, "
                     f"fp32 master weights, states partitioned over {n}")

    # --- activations (one micro-batch) ---------------------------------------------
    per_layer = activation_bytes_per_layer_token(shape, setup, residual)
    outside = (residual + 4 + residual + p) * shape.hidden_size  # embeddings, final norm
    freed, held = loss_buffer_bytes(shape, setup, tokens, residual)
    loss_buffers = freed + held
    if setup.gradient_checkpointing:
        # each layer keeps its input (or, selective, its expensive outputs); the layer
        # recomputed in backward (after the freed loss buffers are gone) only adds where it
        # is larger than they were
        kept = (selective_bytes_per_layer_token(shape, setup, residual)
                if setup.checkpoint_policy == "selective" else residual * shape.hidden_size)
        recomputed = max(0.0, tokens * per_layer - freed)
        activations = tokens * (shape.num_layers * kept + outside)
        activations += recomputed
    else:
        activations = tokens * (shape.num_layers * per_layer + outside)

    # --- the optimizer step's own temporaries --------------------------------------
    if setup.device == "cpu" and not (strategy.startswith("zero") and offload != "none"):
        local = trainable / (1 if strategy == "ddp" else n)
        step_only["optimizerStepTemporaries"] = 4.0 * local  # foreach AdamW: sqrt(v)

    context = CUDA_CONTEXT_BYTES if setup.device == "cuda" else 0
    accumulate = setup.gradient_accumulation > 1 or grads_always
    forward_temps = {**persistent, **forward_only, "lossBuffers": loss_buffers}
    step_temps = {**persistent, **step_only}
    forward_phase = {
        "weights": weights, "gradients": grads if accumulate else 0.0,
        "optimizerStates": optimizer, "activations": activations,
        "temporaryBuffers": sum(forward_temps.values()), "cudaContext": context}
    step_phase = {
        "weights": weights, "gradients": grads, "optimizerStates": optimizer,
        "activations": 0.0, "temporaryBuffers": sum(step_temps.values()),
        "cudaContext": context}
    forward_lines = {k: int(v) for k, v in forward_phase.items()}
    step_lines = {k: int(v) for k, v in step_phase.items()}
    totals = {"forwardBackward": sum(forward_lines.values()),
              "optimizerStep": sum(step_lines.values())}
    peak = max(totals, key=lambda k: totals[k])
    lines = forward_lines if peak == "forwardBackward" else step_lines
    temps = forward_temps if peak == "forwardBackward" else step_temps
    if shape.approximate:
        notes.append(f"model_type {shape.model_type!r} is not one the planner was checked "
                     "against; counted as a Llama-style decoder")
    return MemoryEstimate(
        breakdown=lines, total=totals[peak], temporary_buffers={
            k: int(v) for k, v in temps.items()},
        peak_phase=peak, phases=totals, trainable_params=trainable, total_params=total,
        notes=notes)
