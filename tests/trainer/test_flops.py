"""MFU's numerator: the PaLM / torchtitan FLOP count, LoRA-aware, from a live model."""

from __future__ import annotations

import pytest

from finetune_operator.planner.architecture import from_hf_config
from finetune_operator.planner.compute import model_flops_per_token as planner_flops
from finetune_trainer.flops import (
    ModelWork,
    attended_pairs,
    full_row_pairs,
    model_flops_per_token,
    model_shape,
    peak_flops,
)


def test_the_formula():
    # 6 per trained weight, 4 per frozen one, 12·L·W·T for attention
    assert model_flops_per_token(1e9, 16, 2048, 1024) == 6e9 + 12 * 16 * 2048 * 1024
    assert model_flops_per_token(1e9, 16, 2048, 1024, frozen_params=9e8) == \
        6e8 + 4 * 9e8 + 12 * 16 * 2048 * 1024


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("Tesla T4", 65e12), ("NVIDIA L4", 121e12), ("Some Future GPU", None),
])
def test_peaks_by_device_name(name, peak):
    assert peak_flops(name) == peak


def test_a_live_model_counts_as_the_planner_counts_its_config(tiny_model_dir):
    import json

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params, frozen, layers, width = model_shape(model)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert frozen == 0 and layers == config["num_hidden_layers"]
    # the trainer (from weights) and the planner (from config.json) agree on the count
    assert model_flops_per_token(params, layers, width, 96) == pytest.approx(
        planner_flops(from_hf_config(config), 96), rel=1e-6)


def test_lora_counts_the_frozen_base_at_four_flops(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    full = model_shape(base)
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    params, frozen, layers, width = model_shape(lora)
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert frozen == full[0] and params == full[0] + adapters
    assert model_flops_per_token(params, layers, width, 96, frozen) < \
        model_flops_per_token(*full[:1], layers, width, 96)


def test_attention_counts_the_pairs_each_document_attends():
    """Causal attention within each document of a packed row: its k-th token attends to k
    keys (positions restart at 0 where a document starts)."""
    assert attended_pairs([0, 1, 2, 0, 0, 1, 2, 3]) == 6 + 1 + 10
    assert attended_pairs(range(4096)) == 4096 * 4097 // 2  # about half a full row's count
    assert attended_pairs([5, 6, 7]) == 6  # a continued document counts from its own start
    assert full_row_pairs(4096) == 4096**2
    assert attended_pairs([]) == 0


def test_a_packed_rows_flops_by_hand():
    """A LoRA step over one row of two documents (100 and 300 tokens): 6 FLOPs per trained
    parameter and 4 per frozen one for each token, 12·L·W per attended pair; DPO's
    reference forward adds 2 per base parameter and 4·L·W per pair."""
    params, frozen, layers, width = 1.25e9, 1.24e9, 16, 2048
    tokens, pairs = 400, 100 * 101 // 2 + 300 * 301 // 2
    dense = 6 * (params - frozen) + 4 * frozen
    work = ModelWork.of(params, frozen, layers, width)
    assert work.flops(tokens, pairs) == pytest.approx(
        dense * tokens + 12 * layers * width * pairs)
    dpo = ModelWork.of(params, frozen, layers, width, reference_params=frozen)
    assert dpo.flops(tokens, pairs) == pytest.approx(
        (dense + 2 * frozen) * tokens + 16 * layers * width * pairs)
    # the row counted as PaLM and torchtitan count it: 400 tokens each attending to 400
    full = work.flops(tokens, full_row_pairs(tokens))
    assert full / work.flops(tokens, pairs) == pytest.approx(
        (dense * 400 + 12 * layers * width * 160_000) / (dense * 400 + 12 * layers * width * pairs))


def test_a_steps_work_is_counted_from_its_sequences():
    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.data import IGNORE, GlobalBatches
    from finetune_trainer.objectives import spec_of
    from finetune_trainer.step_batch import StepCounts

    sequences = [{"input_ids": [1] * 5, "labels": [IGNORE, IGNORE, 3, 4, 5],
                  "position_ids": [0, 1, 0, 1, 2]},
                 {"input_ids": [1] * 3, "labels": [IGNORE, 2, 3], "position_ids": [0, 1, 2]}]
    batches = GlobalBatches(num_sequences=2, micro_batch=2, accumulation=1, world_size=1,
                            seed=0)
    config = TrainerConfig.model_validate({
        "job": {"name": "counts"}, "model": {"uri": "/models/m"}, "dataset": {"uri": "/data"},
        "method": {"type": "lora"}, "strategy": {"type": "ddp"},
        "hyperparameters": {"maxSteps": 1}, "output": {"uri": "/out"}})
    counts = StepCounts(sequences, batches, spec_of("sft").objective(config).units)
    work = counts.of_step(0, 0)
    assert counts.units_of_step(0, 0) == work.labels  # SFT's loss: a mean over them
    assert (work.labels, work.inputs, work.sequences) == (5, 8, 2)
    assert work.attended == (3 + 6) + 6 and work.full_rows == 25 + 9
