"""Packed attention's inputs on the host: the samples' bounds from position_ids, and when
the kernel is (not) used. The kernel itself runs on CUDA only (test_packed_attention_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from finetune_trainer import attention
from finetune_trainer.data import collate
from finetune_trainer.train import Collation


def sample(length: int) -> dict[str, list[int]]:
    return {"input_ids": [5] * length, "labels": [-100] + [5] * (length - 1),
            "position_ids": list(range(length))}


def test_bounds_are_the_samples_and_the_padding_over_the_flattened_batch():
    packed_row = {key: sample(3)[key] + sample(2)[key] for key in ("input_ids", "labels",
                                                                  "position_ids")}
    batch = collate([packed_row, sample(4)], pad_id=0)  # width 5: the second row gets 1 pad
    bounds = attention.sequence_bounds(batch["position_ids"])
    assert bounds.dtype == torch.int32
    # row 0: samples of 3 and 2; row 1: a sample of 4, then its padding (its own segment)
    assert bounds.tolist() == [0, 3, 5, 9, 10]


def test_a_row_that_does_not_start_a_sample_is_refused():
    with pytest.raises(ValueError, match="start every row with 0"):
        attention.sequence_bounds(torch.tensor([[1, 2, 0]]))
    with pytest.raises(ValueError, match="start every row with 0"):  # not only the first row
        attention.sequence_bounds(torch.tensor([[0, 1, 2], [3, 0, 1]]))


def test_micro_batches_carry_bounds_only_when_asked():
    sequences = [sample(3), sample(2)]
    assert "cu_seq_lens" not in Collation(pad_id=0).tensors(sequences)
    batch = Collation(pad_id=0, bounds=True).tensors(sequences)
    assert batch["cu_seq_lens"].tolist() == [0, 3, 5, 6]
    assert attention.forward_kwargs(batch) == {
        "cu_seq_lens_q": batch["cu_seq_lens"], "cu_seq_lens_k": batch["cu_seq_lens"],
        "max_length_q": 3, "max_length_k": 3}
    assert attention.forward_kwargs(Collation(pad_id=0).tensors(sequences)) == {}


def test_compiled_layers_get_rows_of_one_width():
    batch = Collation(pad_id=0, bounds=True, width=8).tensors([sample(3), sample(2)])
    assert batch["input_ids"].shape == (2, 8)
    # the padding of each row is one segment of its own
    assert batch["cu_seq_lens"].tolist() == [0, 3, 8, 10, 16]


def test_cpu_workers_fp32_runs_and_models_it_does_not_fit_keep_sdpa(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert "CUDA only" in attention.why_not(model, torch.device("cpu"), "bf16")
    cuda = torch.device("cuda")
    if attention.why_not(model, cuda, "bf16") is not None:  # a torch without the varlen kernel
        assert "varlen" in attention.why_not(model, cuda, "bf16")
        return
    assert attention.why_not(model, cuda, "fp16") is None
    # the kernel is bf16/fp16 only: an fp32 run's attention stays fp32 (it had handed its
    # fp32 o_proj bf16 output: "expected mat1 and mat2 to have the same dtype", on a GPU)
    assert "this run is fp32" in attention.why_not(model, cuda, "fp32")
    model.config.sliding_window = 128
    assert "sliding_window" in attention.why_not(model, cuda, "bf16")
    model.config.sliding_window = None
    model.config.attention_dropout = 0.1
    assert "attention_dropout" in attention.why_not(model, cuda, "bf16")


def test_a_compiled_layer_is_compiled_once_for_any_count_of_samples():
    """The bounds' length varies with the samples a micro-batch holds. Unmarked, the first
    batch of a new count recompiled every compiled layer inside a training step (seen on a
    GPU under the no-sync test); marked dynamic, one compile serves every count."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def layer(hidden, cu_seq_lens_q, max_length_q, **_):
        return hidden * max_length_q + cu_seq_lens_q[-1]

    torch._dynamo.reset()
    for lengths in ([3, 2], [1, 1, 1, 2], [5], [2, 1, 2]):  # 3, 5, 2 and 4 bounds a batch
        batch = Collation(pad_id=0, bounds=True, width=5).tensors([sample(n) for n in lengths])
        layer(torch.ones(2), **attention.forward_kwargs(batch))
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_the_attention_refuses_a_forward_without_bounds():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="forward_kwargs"):
        attention.packed_attention(None, q, q, q, None)


def test_the_attention_traces_into_a_compiled_layer_without_a_warning(monkeypatch):
    """Every compiled layer calls packed_attention: its kernel is looked up at import, so
    that dynamo traces nothing but the call (a cached lookup there made dynamo warn in every
    compiled run). The CUDA kernel is played by a CPU function of the same signature."""
    import warnings

    from torch._dynamo.testing import CompileCounter

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
               is_causal=False):
        return query * 2

    monkeypatch.setattr(attention, "_KERNEL", kernel)
    monkeypatch.setattr(attention, "_KERNEL_PARAMETERS", frozenset({"scale", "is_causal"}))
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def layer(query, **kwargs):
        return attention.packed_attention(None, query, query, query, None, **kwargs)[0]

    batch = Collation(pad_id=0, bounds=True, width=5).tensors([sample(5)])
    query = torch.ones(1, 2, 5, 8)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = layer(query, **attention.forward_kwargs(batch))
    torch._dynamo.reset()
    assert counter.frame_count == 1
    assert out.shape == (1, 5, 2, 8)
    assert [str(w.message) for w in caught] == []
