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


def test_cpu_workers_and_models_it_does_not_fit_keep_sdpa(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert "CUDA only" in attention.why_not(model, torch.device("cpu"))
    cuda = torch.device("cuda")
    if attention.why_not(model, cuda) is not None:  # a torch without the varlen kernel
        assert "varlen" in attention.why_not(model, cuda)
        return
    model.config.sliding_window = 128
    assert "sliding_window" in attention.why_not(model, cuda)
    model.config.sliding_window = None
    model.config.attention_dropout = 0.1
    assert "attention_dropout" in attention.why_not(model, cuda)


def test_the_attention_refuses_a_forward_without_bounds():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="forward_kwargs"):
        attention.packed_attention(None, q, q, q, None)
