"""Model FLOPs: the work a step does, and the GPU peaks MFU is measured against.

A token costs 6 FLOPs per matmul parameter it passes (forward 2, backward 4); a frozen
weight (a LoRA base) 4, its input gradient but no weight gradient, so MFU does not flatter
adapter runs with work never done. Embedding lookups are free; the output head is a matmul
and counts. Attention costs 12·L·W FLOPs (forward 4, backward 8; L layers, W = heads x
head size) per query-key pair actually attended: causal, within each document of a packed
row, so a row of ten short documents costs what they cost, not what one row-long document
would (`attended_pairs`). DPO with a reference taken at every batch adds that forward
(2 per base parameter, 4·L·W per pair): work the objective needs. Recomputation under
gradient checkpointing is not model work and is left out, as MFU (unlike hardware
utilisation) defines.

PaLM's and torchtitan's convention counts attention as 12·L·W·T per token (T the row's
length: every token attending to the whole row, causal masking ignored); it is kept as
`full_row_pairs` beside ours, for comparing with figures published that way, and by the
planner, whose figures are compared with them (docs/performance.md).

Importable without torch: the planner shares the formulas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def attended_pairs(position_ids: Sequence[int]) -> int:
    """Query-key pairs causal attention computes within each document of a row: a document
    starts wherever the positions do not continue the previous one (packed rows restart
    them at 0), and its k-th token attends to k keys (d(d+1)/2 for a document of d)."""
    total = run = 0
    previous = None
    for position in position_ids:
        run = run + 1 if previous is not None and position == previous + 1 else 1
        total += run
        previous = position
    return total


def full_row_pairs(length: int) -> int:
    """PaLM's and torchtitan's count for a row of `length` tokens: every token attending
    to all of them (T per token)."""
    return length * length


@dataclass(frozen=True)
class ModelWork:
    """FLOPs of a model's step from what the step holds: tokens through it and the
    query-key pairs they attend."""

    dense_per_token: float
    """Matmul FLOPs of a trained token (6 per trained parameter, 4 per frozen one), plus a
    reference's forward where one is taken at every batch."""
    attention_per_pair: float
    """12·L·W, plus the reference's forward 4·L·W."""

    @classmethod
    def of(cls, params: float, frozen_params: float, layers: int, attention_width: int,
           reference_params: float = 0.0) -> ModelWork:
        """`reference_params`: matmul parameters of a reference model run forward (no
        grad) on every batch, 0 where there is none."""
        trained = params - frozen_params
        dense = 6.0 * trained + 4.0 * frozen_params + 2.0 * reference_params
        attention = (12.0 + (4.0 if reference_params else 0.0)) * layers * attention_width
        return cls(dense_per_token=dense, attention_per_pair=attention)

    def flops(self, tokens: float, pairs: float) -> float:
        return self.dense_per_token * tokens + self.attention_per_pair * pairs


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
