"""The exported model's card (#51, item 6): what it is, how it was trained, how to load it."""

from __future__ import annotations

from finetune_trainer.config import TrainerConfig
from finetune_trainer.model_card import render
from finetune_trainer.record import ProgressRecord


def config(**spec) -> TrainerConfig:
    base = {"job": {"name": "support-bot", "namespace": "ml"},
            "model": {"uri": "/models/llama"},
            "dataset": {"uri": "pvc://data/chats.jsonl", "format": "chat", "maxSeqLength": 512},
            "method": {"type": "lora", "lora": {"r": 8, "alpha": 16}},
            "strategy": {"type": "ddp", "precision": "bf16"},
            "hyperparameters": {"maxSteps": 100, "learningRate": 2e-4},
            "output": {"uri": "/out"}, "workers": 4}
    for key, value in spec.items():
        base[key] = value
    return TrainerConfig.model_validate(base)


def test_an_adapters_card_names_its_base_data_settings_results_and_loading():
    record = ProgressRecord(step=100, total_steps=100, loss=1.2345, eval_loss=1.3,
                            update_time="2026-11-27T12:00:00Z")
    card = render(config(), record)
    assert card.startswith("---\nbase_model: /models/llama\nlibrary_name: peft\n")
    assert "# support-bot" in card and "FineTuneJob `ml/support-bot`" in card
    for row in ("| data | `pvc://data/chats.jsonl` (format chat, maxSeqLength 512) |",
                "| LoRA | r 8, alpha 16, dropout 0.05, target modules all-linear |",
                "| strategy | ddp, bf16, 4 workers |", "| learning rate | 0.0002 |",
                "| steps | 100 of 100 |", "| final training loss | 1.2345 |",
                "| evaluation loss | 1.3000 |"):
        assert row in card, card
    assert "AutoPeftModelForCausalLM" in card
    assert "vllm serve /models/llama --enable-lora --lora-modules support-bot=" in card


def test_a_hub_model_is_named_by_its_repo_and_full_weights_load_with_transformers():
    card = render(config(model={"uri": "/out/.model"}, model_fetched_from={
        "uri": "hf://org/model"}, method={"type": "full"}), None)
    assert "base_model: org/model" in card and "library_name: transformers" in card
    assert "AutoModelForCausalLM.from_pretrained" in card and "LoRA" not in card
    assert "| steps |" not in card  # no record: no results claimed


def test_a_dpo_card_says_preference_tuning_with_its_settings_and_rewards():
    record = ProgressRecord(step=40, total_steps=40, loss=0.41,
                            rewards={"margins": 0.7, "accuracies": 1.0})
    card = render(config(dataset={"uri": "pairs.jsonl", "format": "preference"},
                         objective={"type": "dpo", "dpo": {"beta": 0.2}}), record)
    assert "trained with preference tuning (DPO)" in card
    assert "| DPO | beta 0.2, loss sigmoid" in card
    assert "| reward margins | 0.7000 |" in card and "- dpo" in card
