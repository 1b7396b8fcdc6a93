"""Architectures of well-known models, as their config.json files state them.

Used when a model's own config cannot be read (gated hub repos without a token, no
network, `azureml://` registry models). Only the fields the planner reads are kept; the
values are copied from each repository's config.json. A plan made from this table says
so (`source`), so a stale entry never passes silently for the real file.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

_LLAMA3 = {"model_type": "llama", "vocab_size": 128256, "max_position_embeddings": 131072}
_LLAMA_3_2_1B = {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192,
                 "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 64, "tie_word_embeddings": True}
_LLAMA_3_2_3B = {**_LLAMA3, "hidden_size": 3072, "intermediate_size": 8192,
                 "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
                 "head_dim": 128, "tie_word_embeddings": True}
_LLAMA_3_8B = {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "tie_word_embeddings": False}
_LLAMA_3_70B = {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672,
                "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                "tie_word_embeddings": False}
_LLAMA_2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
               "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 32, "tie_word_embeddings": False}
_MISTRAL_7B = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "tie_word_embeddings": False}
_MIXTRAL_8X7B = {**_MISTRAL_7B, "model_type": "mixtral", "num_local_experts": 8,
                 "num_experts_per_tok": 2}
_QWEN25 = {"model_type": "qwen2"}
_QWEN25_05B = {**_QWEN25, "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
               "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
               "tie_word_embeddings": True}
_QWEN25_15B = {**_QWEN25, "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
               "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
               "tie_word_embeddings": True}
_QWEN25_7B = {**_QWEN25, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
              "tie_word_embeddings": False}
_QWEN25_14B = {**_QWEN25, "vocab_size": 152064, "hidden_size": 5120,
               "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
               "num_key_value_heads": 8, "tie_word_embeddings": False}
_PHI3_MINI = {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
              "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "tie_word_embeddings": False}
_PHI4 = {"model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120,
         "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40,
         "num_key_value_heads": 10, "tie_word_embeddings": False}

KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.2-1B": _LLAMA_3_2_1B,
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA_3_2_1B,
    "meta-llama/Llama-3.2-3B": _LLAMA_3_2_3B,
    "meta-llama/Llama-3.2-3B-Instruct": _LLAMA_3_2_3B,
    "meta-llama/Meta-Llama-3-8B": _LLAMA_3_8B,
    "meta-llama/Meta-Llama-3-8B-Instruct": _LLAMA_3_8B,
    "meta-llama/Llama-3.1-8B": _LLAMA_3_8B,
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA_3_8B,
    "meta-llama/Meta-Llama-3.1-8B": _LLAMA_3_8B,
    "meta-llama/Meta-Llama-3.1-8B-Instruct": _LLAMA_3_8B,
    "meta-llama/Meta-Llama-3-70B": _LLAMA_3_70B,
    "meta-llama/Meta-Llama-3-70B-Instruct": _LLAMA_3_70B,
    "meta-llama/Llama-3.1-70B": _LLAMA_3_70B,
    "meta-llama/Llama-3.1-70B-Instruct": _LLAMA_3_70B,
    "meta-llama/Llama-3.3-70B-Instruct": _LLAMA_3_70B,
    "meta-llama/Llama-2-7b-hf": _LLAMA_2_7B,
    "meta-llama/Llama-2-7b-chat-hf": _LLAMA_2_7B,
    "mistralai/Mistral-7B-v0.1": _MISTRAL_7B,
    "mistralai/Mistral-7B-Instruct-v0.1": _MISTRAL_7B,
    "mistralai/Mistral-7B-Instruct-v0.2": _MISTRAL_7B,
    "mistralai/Mistral-7B-v0.3": {**_MISTRAL_7B, "vocab_size": 32768},
    "mistralai/Mistral-7B-Instruct-v0.3": {**_MISTRAL_7B, "vocab_size": 32768},
    "mistralai/Mixtral-8x7B-v0.1": _MIXTRAL_8X7B,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": _MIXTRAL_8X7B,
    "Qwen/Qwen2.5-0.5B": _QWEN25_05B,
    "Qwen/Qwen2.5-0.5B-Instruct": _QWEN25_05B,
    "Qwen/Qwen2.5-1.5B": _QWEN25_15B,
    "Qwen/Qwen2.5-1.5B-Instruct": _QWEN25_15B,
    "Qwen/Qwen2.5-7B": _QWEN25_7B,
    "Qwen/Qwen2.5-7B-Instruct": _QWEN25_7B,
    "Qwen/Qwen2.5-14B": _QWEN25_14B,
    "Qwen/Qwen2.5-14B-Instruct": _QWEN25_14B,
    "microsoft/Phi-3-mini-4k-instruct": _PHI3_MINI,
    "microsoft/Phi-3-mini-128k-instruct": _PHI3_MINI,
    "microsoft/phi-4": _PHI4,
}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_KEY = {_key(name): name for name in KNOWN_MODELS}


def lookup(name: str) -> tuple[str, dict[str, Any]] | None:
    """The table entry for a repo id (`org/name`) or a registry name spelling it with other
    punctuation (`mistralai-Mistral-7B-v01` in Azure ML's registry); None when absent."""
    found = _BY_KEY.get(_key(name))
    return (found, dict(KNOWN_MODELS[found])) if found else None


def close_names(name: str, n: int = 3) -> list[str]:
    """The table's names nearest to `name` (a typo, another case, no `org/`), best first."""
    wanted = name.lower().removeprefix("hf://").strip("/")
    lowered = {known.lower(): known for known in KNOWN_MODELS}
    bare = {known.lower().split("/", 1)[1]: known for known in KNOWN_MODELS}
    close = difflib.get_close_matches(wanted, [*lowered, *bare], n=n * 2, cutoff=0.6)
    names = [lowered.get(match) or bare[match] for match in close]
    return list(dict.fromkeys(names))[:n]
