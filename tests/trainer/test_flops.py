"""MFU's numerator: the PaLM / torchtitan FLOP count, LoRA-aware, from a live model."""

from __future__ import annotations

import pytest

from finetune_operator.planner.architecture import from_hf_config
from finetune_operator.planner.compute import model_flops_per_token as planner_flops
from finetune_trainer.flops import model_flops_per_token, model_shape, peak_flops


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
