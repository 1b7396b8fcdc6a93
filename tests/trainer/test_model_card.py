"""The exported model's card (#51, item 6): what it is, how it was trained, how to load it."""

from __future__ import annotations

import pytest

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
    assert card.startswith("---\nlibrary_name: peft\n")  # a path is no hub id: see below
    assert "# support-bot" in card and "FineTuneJob `ml/support-bot`" in card
    assert "A LoRA adapter of `/models/llama`" in card
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
                            objective_metrics={"rewards/margins": 0.7,
                                               "rewards/accuracies": 1.0})
    card = render(config(dataset={"uri": "pairs.jsonl", "format": "preference"},
                         objective={"type": "dpo", "dpo": {"beta": 0.2}}), record)
    assert "trained with preference tuning (DPO)" in card
    assert "| DPO | beta 0.2, loss sigmoid" in card
    assert "| margin | 0.7000 |" in card and "| accuracy | 100% |" in card
    assert "- dpo" in card


def front_matter(card: str) -> dict:
    import yaml

    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.mark.parametrize("uri", ["/home/me/proj/tiny-model", "./tiny-model",
                                 "pvc://models/llama", "azureml://registries/r/models/m/versions/1"])
def test_a_base_that_is_no_hub_repo_stays_out_of_the_front_matter_and_is_named_in_the_prose(uri):
    """The Hub reads `base_model` as a repo id (a model tree, a link to the base): a folder's
    path, or its name, would name some other repo or none."""
    card = render(config(model={"uri": uri}), None)
    assert "base_model" not in front_matter(card)
    assert f"A LoRA adapter of `{uri}`" in card


def test_a_hub_base_is_in_the_front_matter_whether_fetched_or_read_from_the_hub():
    assert front_matter(render(config(model={"uri": "hf://org/model"}), None))[
        "base_model"] == "org/model"


@pytest.mark.parametrize(("workers", "said"), [(1, "1 worker |"), (2, "2 workers |")])
def test_the_strategy_row_counts_workers_in_english(workers, said):
    assert f"| strategy | ddp, bf16, {said}" in render(config(workers=workers), None)
