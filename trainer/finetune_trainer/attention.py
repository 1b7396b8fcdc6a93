"""Attention over packed sequences with no work on the pairs a mask would throw away.

A packed row holds several samples; each must attend only to itself. Through SDPA,
transformers builds a block-diagonal mask from the restarting position_ids and the kernel
computes every query x key pair of the row before masking most of them out (with a mask,
SDPA also falls off its fastest causal kernels). Flash attention's variable-length form
takes the samples' boundaries instead (`cu_seq_lens`, cumulative lengths over the
flattened batch) and computes each sample's own causal triangle: the work scales with
sum(len^2), not rows x width^2. torch ships that kernel (`torch.nn.attention.varlen`, CUDA
only); this module registers it with transformers' attention interface under `NAME` and
computes the boundaries on the host, where the batch is collated (no device sync).

Used on CUDA, in bf16 or fp16 runs, for models whose attention is plain causal softmax
attention (no sliding window, soft-capping, sinks or dropout); everything else keeps SDPA
and the mask. The kernel computes in bf16 or fp16 only, so an fp32 run keeps SDPA: its
attention stays fp32, as asked (and its o_proj takes fp32 input).
"""

from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface

NAME = "finetune_packed"
"""The attention implementation's name in transformers' registry."""
_KERNEL_HEAD_DIMS = range(8, 257)


def sequence_bounds(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sample lengths over the flattened batch (int32, starts with 0): a sample
    starts wherever position_ids restart at 0 (padding is its own segment, see data.py)."""
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    if rows.numel() == 0 or not bool((rows[:, 0] == 0).all()):
        # a row that continues a sample would be attended together with the row before it
        raise ValueError("packed position_ids must start every row with 0")
    flat = rows.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    total = torch.tensor([flat.numel()], dtype=starts.dtype)
    return torch.cat([starts, total]).to(torch.int32)


def _find_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn  # not in every torch release
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


# Looked up once, at import: a cached lookup called inside a compiled layer made dynamo
# warn (and trace through functools) in every compiled run.
_KERNEL, _KERNEL_PARAMETERS = _find_kernel()


def why_not(model, device: torch.device, precision: str) -> str | None:
    """None when packed attention can replace the model's in a run of `precision`
    (`strategy.precision`); else why not, in a phrase."""
    if device.type != "cuda":
        return "variable-length attention runs on CUDA only"
    if precision not in ("bf16", "fp16"):
        return f"the flash kernel computes in bf16 or fp16, and this run is {precision}"
    if _KERNEL is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "set_attn_implementation"):
        return f"{type(model).__name__} does not take a registered attention implementation"
    for attribute in ("sliding_window", "attn_logit_softcapping", "layer_types"):
        value = getattr(config, attribute, None)
        if attribute == "layer_types":
            if value and any(kind != "full_attention" for kind in value):
                return "some of its layers use sliding-window or linear attention"
        elif value and (attribute != "sliding_window"
                        or getattr(config, "use_sliding_window", True)):
            return f"its config sets {attribute} ({value})"
    if getattr(config, "attention_dropout", 0.0):
        return f"its config sets attention_dropout ({config.attention_dropout})"
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None)
    if head_dim is None or head_dim not in _KERNEL_HEAD_DIMS or head_dim % 8:
        return f"head size {head_dim} is not one the flash kernel takes (8..256, by 8)"
    return None


def install(model) -> None:
    """Make `model` (a transformers model, not wrapped) attend through `packed_attention`;
    every forward must then pass `cu_seq_lens_q` (see `forward_kwargs`)."""
    AttentionInterface.register(NAME, packed_attention)
    model.set_attn_implementation(NAME)


def forward_kwargs(batch: dict) -> dict:
    """What a forward passes on to the attention of every layer (the names transformers'
    flash-attention path uses). Compiled layers are compiled once: the longest sample is
    bounded by the row width, a static number, and the count of bounds, which varies with
    the samples a batch holds, is marked dynamic. Unmarked, torch compiled every layer for
    the first count, then again with it dynamic at the first batch of another count (one
    compile more, inside a training step)."""
    if "cu_seq_lens" not in batch:
        return {}
    bounds = batch["cu_seq_lens"]
    torch._dynamo.maybe_mark_dynamic(bounds, 0)
    width = batch["input_ids"].shape[1]
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
            "max_length_q": width, "max_length_k": width}


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """transformers' attention-function contract: query (batch, heads, length, head_dim),
    key/value with their own head count; returns (batch, length, heads, head_dim), None."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        raise RuntimeError(f"{NAME} attention needs the samples' bounds: call the model with "
                           "attention.forward_kwargs(batch)")
    if dropout:
        raise RuntimeError(f"{NAME} attention does not do attention dropout")
    kernel, parameters = _KERNEL, _KERNEL_PARAMETERS
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    dtype = (torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda")
             else query.dtype)
    if dtype not in (torch.float16, torch.bfloat16):
        dtype = torch.bfloat16

    def tokens_first(x, count):
        return x.transpose(1, 2).reshape(batch * length, count, head_dim).to(dtype)

    options = {"scale": scaling}
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    if "enable_gqa" in parameters:
        options["enable_gqa"] = kv_heads != heads
    elif kv_heads != heads:  # older kernels want one key/value head per query head
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        kv_heads = heads
    out = kernel(tokens_first(query, heads), tokens_first(key, kv_heads),
                 tokens_first(value, kv_heads), bounds, bounds, kwargs["max_length_q"],
                 kwargs["max_length_k"], **options)
    return out.view(batch, length, heads, head_dim), None
