"""Parameter counts from config.json agree with transformers building the model on the
meta device (no memory, no download), for every built-in architecture and one small
config per supported model_type; LoRA counts agree with peft on the same empty model."""

from __future__ import annotations

import pytest

from finetune_operator.planner.architecture import ConfigError, from_hf_config
from finetune_operator.planner.known_models import KNOWN_MODELS, lookup

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def meta_model(config: dict):
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def counted(model) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors count once


TINY = {
    "llama": {"hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 8,
              "num_key_value_heads": 2, "tie_word_embeddings": False},
    "llama-tied-mha": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                       "num_attention_heads": 4, "tie_word_embeddings": True},
    "llama-bias-headdim": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                           "num_attention_heads": 4, "num_key_value_heads": 1,
                           "head_dim": 32, "attention_bias": True},
    "mistral": {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 8,
                "num_key_value_heads": 2},
    "mixtral": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
              "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2_moe": {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 80, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "num_experts": 6, "num_experts_per_tok": 2},
    "qwen3": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32},
    "phi3": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
             "num_key_value_heads": 2, "pad_token_id": 0},
    "gemma": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 32},
    "gemma2": {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32},
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_counts_match_transformers_for_each_supported_type(name):
    config = {"model_type": name, "vocab_size": 1000, "num_hidden_layers": 3,
              "bos_token_id": 1, "eos_token_id": 2, **TINY[name]}
    shape = from_hf_config(config)
    assert not shape.approximate
    assert shape.total_params == counted(meta_model(config))


@pytest.mark.parametrize("repo", sorted({next(r for r, c in KNOWN_MODELS.items() if c is v)
                                         for v in KNOWN_MODELS.values()}))
def test_counts_match_transformers_for_the_built_in_table(repo):
    config = KNOWN_MODELS[repo]
    model = meta_model(config)
    shape = from_hf_config(config)
    assert shape.total_params == counted(model)
    embedding = model.get_input_embeddings().weight.numel()
    assert shape.embedding_params == embedding


def test_published_sizes_of_well_known_models():
    """The figures on the model cards, to the stated precision."""
    sizes = {"meta-llama/Llama-3.1-8B": 8.03e9, "meta-llama/Llama-3.1-70B": 70.55e9,
             "meta-llama/Llama-3.2-1B": 1.24e9, "meta-llama/Llama-3.2-3B": 3.21e9,
             "mistralai/Mistral-7B-v0.1": 7.24e9, "mistralai/Mixtral-8x7B-v0.1": 46.7e9,
             "Qwen/Qwen2.5-7B": 7.62e9, "Qwen/Qwen2.5-0.5B": 0.494e9,
             "microsoft/Phi-3-mini-4k-instruct": 3.82e9, "microsoft/phi-4": 14.66e9}
    for repo, published in sizes.items():
        assert from_hf_config(KNOWN_MODELS[repo]).total_params == pytest.approx(
            published, rel=0.006), repo
    mixtral = from_hf_config(KNOWN_MODELS["mistralai/Mixtral-8x7B-v0.1"])
    active = mixtral.active_non_embedding_params + 2 * mixtral.embedding_params
    assert active == pytest.approx(12.9e9, rel=0.01)  # "12.9B active parameters per token"


@pytest.mark.parametrize(("repo", "targets"), [
    ("meta-llama/Llama-3.2-1B", ["all-linear"]),
    ("meta-llama/Llama-3.2-1B", ["q_proj", "v_proj"]),
    ("microsoft/Phi-3-mini-4k-instruct", ["all-linear"]),
    ("Qwen/Qwen2.5-0.5B", ["all-linear"]),
    ("mistralai/Mixtral-8x7B-v0.1", ["all-linear"]),
])
def test_lora_counts_match_peft(repo, targets):
    peft = pytest.importorskip("peft")
    model = meta_model(KNOWN_MODELS[repo])
    target = "all-linear" if targets == ["all-linear"] else targets
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=target))
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert from_hf_config(KNOWN_MODELS[repo]).lora_params(16, targets) == trainable


def test_an_unknown_type_is_counted_as_llama_and_marked_approximate():
    shape = from_hf_config({"model_type": "somethingnew", "vocab_size": 100, "hidden_size": 64,
                            "num_hidden_layers": 2, "num_attention_heads": 4,
                            "intermediate_size": 128})
    assert shape.approximate and shape.total_params > 0


def test_a_config_without_the_basics_is_refused_by_name():
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        from_hf_config({"model_type": "bert", "vocab_size": 10, "hidden_size": 8,
                        "num_attention_heads": 2})


def test_table_lookup_accepts_registry_spellings():
    assert lookup("mistralai-Mistral-7B-v01")[0] == "mistralai/Mistral-7B-v0.1"
    assert lookup("META-LLAMA/llama-3.1-8b-instruct")[0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert lookup("someone/unknown-7b") is None


def test_the_context_length_is_read_where_each_family_writes_it():
    base = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    assert from_hf_config({**base, "max_position_embeddings": 8192}).context_length == 8192
    assert from_hf_config({**base, "model_type": "gpt2", "n_positions": 1024}
                          ).context_length == 1024
    assert from_hf_config(base).context_length is None  # unknown: no warning is made of it
    multimodal = {"model_type": "gemma3", "text_config": {**base, "model_type": "gemma3_text",
                                                          "max_position_embeddings": 131072}}
    assert from_hf_config(multimodal).context_length == 131072
