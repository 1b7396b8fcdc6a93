"""Model FLOPs per token and the GPU peaks MFU is measured against.

The PaLM / torchtitan convention: a trained token costs 6 FLOPs per matmul parameter
(forward 2, backward 4) plus 12·L·W·T for attention scores (L layers, W = heads x head
size, T sequence length). Embedding lookups are free; the output head is a matmul and
counts. LoRA-aware: a frozen weight still costs its forward and its input gradient (4),
but no weight gradient, so MFU does not flatter adapter runs with work never done.
Recomputation under gradient checkpointing is not model work and is left out, as MFU
(unlike hardware utilisation) defines.

Importable without torch: the planner shares the formula.
"""

from __future__ import annotations

PEAK_FLOPS_16BIT = (
    # (substring of torch.cuda.get_device_name(), dense bf16/fp16 tensor FLOP/s) — most
    # specific first. Vendor datasheet figures without sparsity.
    ("GB200", 2.5e15), ("B200", 2.25e15), ("H200", 989e12), ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12),
    ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12), ("A10", 125e12),
    ("L4", 121e12), ("V100", 125e12), ("T4", 65e12),
)


def model_flops_per_token(params: float, layers: int, attention_width: int, seq_len: float,
                          frozen_params: float = 0.0) -> float:
    """`params`: matmul parameters (all weights but the embedding table, the output head
    included; LoRA adapters included); `frozen_params`: those of them not trained."""
    trained = params - frozen_params
    return 6.0 * trained + 4.0 * frozen_params + 12.0 * layers * attention_width * seq_len


def peak_flops(device_name: str) -> float | None:
    """Dense 16-bit peak of one GPU, or None when the GPU is not in the table (no MFU then)."""
    for fragment, flops in PEAK_FLOPS_16BIT:
        if fragment.lower() in device_name.lower():
            return flops
    return None


def model_shape(model) -> tuple[float, float, int, int]:
    """(matmul params, frozen matmul params, layers, attention width) of a live Hugging
    Face (or peft) causal LM, counted before any sharding."""
    config = model.config
    embeddings = model.get_input_embeddings()
    embedding_ids = {id(p) for p in embeddings.parameters()}
    params = frozen = 0.0
    for parameter in model.parameters():
        if id(parameter) in embedding_ids:
            continue
        count = _numel(parameter)
        params += count
        frozen += 0 if parameter.requires_grad else count
    head = model.get_output_embeddings()
    if head is not None and any(id(p) in embedding_ids for p in head.parameters()):
        tied = embeddings.weight.numel()  # a tied head is a matmul all the same
        params += tied
        frozen += 0 if embeddings.weight.requires_grad else tied
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return params, frozen, config.num_hidden_layers, heads * head_dim


def _numel(parameter) -> int:
    """Elements of the full weight: ZeRO-3 partitions keep it in ds_numel, 4-bit QLoRA
    weights are packed two to a byte and keep the real shape in their quant state."""
    if getattr(parameter, "ds_numel", None):
        return int(parameter.ds_numel)
    quant_state = getattr(parameter, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        return int(quant_state.shape.numel())
    return int(parameter.numel())
