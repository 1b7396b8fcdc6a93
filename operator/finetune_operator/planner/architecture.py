"""The shape of a decoder-only transformer, read from its Hugging Face `config.json`.

Parameter counts are exact for the architectures named in `SUPPORTED` (tested against
transformers instantiating each one on the meta device); any other `model_type` with
the usual fields is counted as a Llama-style decoder and marked approximate.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# model_type → (q/k/v biases, norms per layer, per-head q/k norms). All of these use
# gated MLPs (SwiGLU / GeGLU), RMSNorm without bias and no bias on o_proj.
SUPPORTED: dict[str, tuple[bool, int, bool]] = {
    "llama": (False, 2, False),
    "mistral": (False, 2, False),
    "mixtral": (False, 2, False),
    "qwen2": (True, 2, False),
    "qwen2_moe": (True, 2, False),
    "qwen3": (False, 2, True),
    "phi3": (False, 2, False),
    "gemma": (False, 2, False),
    "gemma2": (False, 4, False),
}
ALWAYS_TIED = frozenset({"gemma", "gemma2"})


class ConfigError(ValueError):
    """A config.json the planner cannot read: what is missing."""


class Linear(BaseModel):
    """One linear layer of a decoder block (what LoRA can adapt)."""

    model_config = ConfigDict(frozen=True)
    name: str
    fan_in: int
    fan_out: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)


class ModelShape(BaseModel):
    """What the planner needs to know about a model; built by `from_hf_config`."""

    model_config = ConfigDict(frozen=True)
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    """Llama-family `attention_bias` also puts a bias on o_proj; Qwen2's q/k/v biases do not."""
    norms_per_layer: int = 2
    qk_norm: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    approximate: bool = False
    """True when `model_type` is not one the counts were checked against."""
    context_length: int | None = None
    """The longest sequence the model was made for (`max_position_embeddings`); None where
    its config does not say."""

    # --- the pieces ---------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_linears(self) -> list[Linear]:
        """The nn.Linear layers of one decoder block, as transformers builds them (fused
        projections of Phi-3 included; MoE experts are fused 3-D weights, not Linear)."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        if self.model_type == "phi3":
            attention = [Linear(name="qkv_proj", fan_in=h, fan_out=q + 2 * kv),
                         Linear(name="o_proj", fan_in=q, fan_out=h)]
        else:
            b = self.qkv_bias
            attention = [Linear(name="q_proj", fan_in=h, fan_out=q, bias=b),
                         Linear(name="k_proj", fan_in=h, fan_out=kv, bias=b),
                         Linear(name="v_proj", fan_in=h, fan_out=kv, bias=b),
                         Linear(name="o_proj", fan_in=q, fan_out=h, bias=self.o_bias)]
        if self.is_moe:
            shared = self.shared_expert_intermediate_size
            router = [Linear(name="gate", fan_in=h, fan_out=self.num_experts)]
            mlp = router if not shared else [*router,
                Linear(name="gate_proj", fan_in=h, fan_out=shared),
                Linear(name="up_proj", fan_in=h, fan_out=shared),
                Linear(name="down_proj", fan_in=shared, fan_out=h),
                Linear(name="shared_expert_gate", fan_in=h, fan_out=1)]
        elif self.model_type == "phi3":
            mlp = [Linear(name="gate_up_proj", fan_in=h, fan_out=2 * i),
                   Linear(name="down_proj", fan_in=i, fan_out=h)]
        else:
            mlp = [Linear(name="gate_proj", fan_in=h, fan_out=i),
                   Linear(name="up_proj", fan_in=h, fan_out=i),
                   Linear(name="down_proj", fan_in=i, fan_out=h)]
        return attention + mlp

    def expert_params(self) -> int:
        """Routed experts of one layer: gate+up and down per expert (fused 3-D weights)."""
        if not self.is_moe:
            return 0
        return self.num_experts * 3 * self.hidden_size * self.expert_intermediate_size

    def layer_params(self) -> int:
        norms = self.norms_per_layer * self.hidden_size
        qk = 2 * self.head_dim if self.qk_norm else 0
        return sum(x.params for x in self.layer_linears()) + self.expert_params() + norms + qk

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The output projection: 0 when it shares the embedding matrix."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return (self.embedding_params + self.head_params + self.num_layers * self.layer_params()
                + self.hidden_size)

    @property
    def non_embedding_params(self) -> int:
        """Decoder blocks and the final norm (the N of 6·N FLOPs per token)."""
        return self.num_layers * self.layer_params() + self.hidden_size

    @property
    def active_non_embedding_params(self) -> int:
        """Per token: MoE layers only run `experts_per_token` of their experts."""
        if not self.is_moe:
            return self.non_embedding_params
        idle = (self.num_experts - self.experts_per_token) * 3 * self.hidden_size * (
            self.expert_intermediate_size)
        return self.non_embedding_params - self.num_layers * idle

    def largest_layer_params(self) -> int:
        """The biggest module gathered at once under ZeRO-3 / FSDP: a block or the vocab."""
        return max(self.layer_params(), self.embedding_params)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Trainable adapter parameters: rank·(in + out) per adapted linear layer."""
        linears = self.layer_linears()
        every = targets == ["all-linear"]
        if not every:
            linears = [x for x in linears if x.name in targets]
        per_layer = sum(rank * (x.fan_in + x.fan_out) for x in linears)
        if self.is_moe and (every or "experts" in targets):
            # peft adapts the fused expert weights with rank·experts, gate+up twice that
            h, i, re = self.hidden_size, self.expert_intermediate_size, rank * self.num_experts
            per_layer += 2 * re * (h + 2 * i) + re * (i + h)
        return self.num_layers * per_layer

    def lora_target_names(self) -> list[str]:
        return [x.name for x in self.layer_linears()]


def _get(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def from_hf_config(config: dict[str, Any]) -> ModelShape:
    """A `ModelShape` from a config.json dict (multimodal configs: their `text_config`)."""
    if "text_config" in config and "hidden_size" not in config:
        config = {**config["text_config"], "tie_word_embeddings": config.get(
            "tie_word_embeddings", config["text_config"].get("tie_word_embeddings"))}
    missing = [n for n in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads") if config.get(n) is None]
    if missing:
        raise ConfigError(f"config.json has no {', '.join(missing)}: not a decoder-only "
                          "transformer the planner can size")
    model_type = str(config.get("model_type", "unknown"))
    known = model_type in SUPPORTED
    qkv_bias, norms, qk_norm = SUPPORTED.get(model_type, (False, 2, False))
    o_bias = bool(config.get("attention_bias"))
    qkv_bias = qkv_bias or o_bias
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    experts = int(_get(config, "num_local_experts", "num_experts", default=0) or 0)
    tied = config.get("tie_word_embeddings")
    if tied is None:
        tied = model_type in ALWAYS_TIED
    intermediate = _get(config, "intermediate_size", "ffn_dim", "n_inner")
    if intermediate is None:
        intermediate = 4 * hidden
        known = False
    if experts and (config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
        known = False  # some layers dense: counted as if all were sparse
    return ModelShape(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(_get(config, "num_key_value_heads", default=heads)),
        head_dim=int(_get(config, "head_dim", default=hidden // heads)),
        intermediate_size=int(intermediate),
        tied_embeddings=bool(tied),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        norms_per_layer=norms,
        qk_norm=qk_norm,
        num_experts=experts,
        experts_per_token=int(_get(config, "num_experts_per_tok", default=0) or 0),
        expert_intermediate_size=int(_get(config, "moe_intermediate_size",
                                          default=intermediate)) if experts else 0,
        shared_expert_intermediate_size=int(
            config.get("shared_expert_intermediate_size") or 0) if experts else 0,
        approximate=not known,
        context_length=_context_length(config),
    )


def _context_length(config: dict[str, Any]) -> int | None:
    value = _get(config, "max_position_embeddings", "n_positions", "max_sequence_length")
    return value if isinstance(value, int) and value > 0 else None
