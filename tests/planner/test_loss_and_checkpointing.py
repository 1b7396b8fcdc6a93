"""The planner's view of the fused loss and of selective checkpointing, on Llama 3.1 8B."""

from __future__ import annotations

from finetune_operator.planner.architecture import from_hf_config
from finetune_operator.planner.compute import hardware_flops_per_token
from finetune_operator.planner.known_models import KNOWN_MODELS
from finetune_operator.planner.memory import TrainingSetup, estimate_memory

SHAPE = from_hf_config(KNOWN_MODELS["meta-llama/Llama-3.1-8B"])
BASE = {"method": "lora", "strategy": "ddp", "micro_batch": 4, "seq_len": 4096}


def _memory(**options) -> dict:
    estimate = estimate_memory(SHAPE, TrainingSetup(**{**BASE, **options}))
    return {"total": estimate.total, "loss": estimate.temporary_buffers.get("lossBuffers", 0),
            "activations": estimate.breakdown["activations"]}


def test_fused_loss_holds_one_logits_chunk_not_every_tokens_logits():
    whole, fused = _memory(fused_loss=False), _memory()
    # 16k tokens x 128k vocabulary x 12 bytes is ~24 GiB; one 256 MiB chunk (+ its bf16
    # source) and the hidden-state gradient are well under 1 GiB
    assert whole["loss"] > 20 * 2**30
    assert fused["loss"] < 2**30
    assert whole["total"] - fused["total"] > 15 * 2**30


def test_selective_checkpointing_sits_between_full_and_none():
    full = _memory(gradient_checkpointing=True)
    selective = _memory(gradient_checkpointing=True, checkpoint_policy="selective")
    none = _memory(gradient_checkpointing=False)
    assert full["activations"] < selective["activations"] < none["activations"]


def test_selective_checkpointing_recomputes_no_matmul_flops():
    def flops(**options) -> float:
        return hardware_flops_per_token(SHAPE, TrainingSetup(**{**BASE, **options}))

    assert flops(gradient_checkpointing=True, checkpoint_policy="selective") == flops(
        gradient_checkpointing=False) < flops(gradient_checkpointing=True)
