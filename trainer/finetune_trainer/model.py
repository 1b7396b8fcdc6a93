"""The model: a Hugging Face causal LM through `from_pretrained`, with LoRA/QLoRA adapters.

Precision is set up once here so every strategy trains the same numbers: trainable
weights stay in fp32 (the optimizer's master copy) and the forward pass runs in bf16/fp16
(autocast under ddp, the strategy's own cast under fsdp and ZeRO); the frozen base weights
of LoRA are stored in the compute dtype under every strategy, and QLoRA stores them in
4-bit.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Literal

import torch
from accelerate import init_empty_weights
from torch.utils.checkpoint import CheckpointPolicy as Policy
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    GenerationConfig,
)

from finetune_trainer import layout
from finetune_trainer.config import (
    CheckpointPolicy,
    LoraConfig,
    MethodConfig,
    ModelSource,
    Precision,
)

COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

Loading = Literal["host", "device", "meta", "zero3"]
"""Where a rank's weights come from, as its strategy places them (`Strategy.loading`), so
that a node holds one copy of the model in host memory at most, not one per rank (#17):
- `host`: read whole into host memory (CPU replicas, an FSDP world of one, QLoRA);
- `device`: read straight onto the rank's GPU (replicas on GPUs: ddp, zero1, zero2);
- `meta`: nothing read, the model built on the meta device with its LoRA adapters (FSDP:
  once sharded, rank 0 reads the weights one at a time and every rank keeps its slice,
  loading.py);
- `zero3`: built empty as for `meta`; then each weight, largest first, read by rank 0,
  sent to every rank and partitioned at once (ZeRO-3: loading.partition_from_rank0)."""


class ModelError(ValueError):
    """A model that cannot be loaded or adapted: `where`, what, and the fix."""

    def __init__(self, where: str, what: str, fix: str):
        super().__init__(f"{where}: {what} — {fix}")
        self.where, self.what, self.fix = where, what, fix


def model_location(source: ModelSource, base_dir: Path | None = None) -> str:
    """What `from_pretrained` is given: a hub repo id or a local folder with a config."""
    if source.uri.startswith("hf://"):
        return source.uri.removeprefix("hf://")
    path = Path(source.uri)
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    if not path.is_dir():
        raise ModelError(str(path), "does not exist", "check spec.model.uri (relative paths "
                         "start at the manifest's folder; pvc:// claims are mounted at /mnt/pvc)")
    if not (path / "config.json").is_file():
        nested = _saved_model_below(path)
        if nested is None and (path / "adapter_config.json").is_file():
            raise ModelError(str(path), *layout.LORA_ADAPTER)
        if nested is None:
            raise ModelError(str(path), "has no config.json, so it is not a saved model",
                             "point spec.model.uri at a folder written by save_pretrained")
        path = nested
    return str(path)


def _saved_model_below(path: Path, depth: int = 3) -> Path | None:
    """The one saved model in a subfolder: MLflow-packaged models (Azure ML registry
    models) keep the save_pretrained folder a few levels down (e.g. `data/model`)."""
    found = [c.parent for level in range(1, depth + 1)
             for c in path.glob("/".join(["*"] * level) + "/config.json")]
    return found[0] if len(found) == 1 else None


def _hub_kwargs(source: ModelSource) -> dict[str, Any]:
    return {"revision": source.revision, "token": os.environ.get("HF_TOKEN") or None,
            "trust_remote_code": source.trust_remote_code}


def _load_error(location: str, source: ModelSource, error: Exception) -> ModelError:
    if source.uri.startswith("hf://"):
        hint = ("set spec.model.tokenSecretRef for gated or private models" if
                "401" in str(error) or "403" in str(error) or "gated" in str(error).lower()
                else "check the name and revision, and that workers can reach the hub "
                     "(or download the model once and point spec.model.uri at that folder: "
                     "a path with `finetune run`, pvc://claim/path on a cluster)")
        return ModelError(source.uri, f"cannot be loaded from the hub ({type(error).__name__}: "
                          f"{str(error).splitlines()[0]})", hint)
    return ModelError(location, f"cannot be loaded ({type(error).__name__}: {error})",
                      "check the folder holds a complete save_pretrained output")


def load_tokenizer(source: ModelSource, base_dir: Path | None = None):
    location = model_location(source, base_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **_hub_kwargs(source))
    except Exception as error:
        folder = Path(location)
        if (not source.uri.startswith("hf://") and folder.is_dir()
                and not layout.holds_any(folder, layout.TOKENIZER_FILES)):
            raise ModelError(location, layout.NO_TOKENIZER, "save the model's tokenizer into "
                             "the folder as well: tokenizer.save_pretrained(<the folder>)"
                             ) from error
        raise _load_error(location, source, error) from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding carries no loss either way
    return tokenizer


def load_model(source: ModelSource, method: MethodConfig, precision: Precision,
               gradient_checkpointing: bool, base_dir: Path | None = None,
               loading: Loading = "host", checkpoint_policy: CheckpointPolicy = "full",
               device=None):
    """The model ready for training: adapters applied, cache off, checkpointing set.

    LoRA's frozen base is read in the compute dtype whatever the strategy: FSDP2 asks one
    dtype only of a group's trainable parameters, so each decoder layer shards its 16-bit
    base and fp32 adapters together; DeepSpeed casts the whole module to 16 bits itself and
    keeps fp32 master copies of the adapters alone. A full fine-tune reads fp32 (every
    weight is a master weight).
    `loading` (see `Loading`): `device` reads a replica straight onto `device`, never whole
    in host memory (a bf16 checkpoint read as fp32 on the host took 2x its size there);
    `meta` and `zero3` read nothing and build the same model (same dtypes, same adapters)
    without storage.
    """
    location = model_location(source, base_dir)
    compute = getattr(torch, COMPUTE_DTYPES[precision])
    kwargs = _load_kwargs(source, method, compute)
    if loading == "device" and device is not None and device.type == "cuda":
        kwargs["device_map"] = {"": device}
    empty = loading in ("meta", "zero3")
    try:
        if empty:
            model = _empty_model(location, source, kwargs["dtype"])
        else:
            model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except ModelError:
        raise
    except Exception as error:
        raise _load_error(location, source, error) from error
    # A KV cache disables transformers' packed-sequence masking (see data.py).
    model.config.use_cache = False
    if gradient_checkpointing:
        enable_activation_checkpointing(model, checkpoint_policy)
    if method.type == "qlora":
        _prepare_four_bit(model, compute)
    if method.type in ("lora", "qlora"):
        adapt = _apply_lora_to_empty if empty else apply_lora
        model = adapt(model, method.lora or LoraConfig())
    return model


def read_base_model(source: ModelSource, method: MethodConfig, precision: Precision,
                    base_dir: Path | None = None):
    """The transformers model as `load_model` reads it, weights in host memory, nothing
    applied (what rank 0 sends from where a checkpoint cannot be streamed: loading.py)."""
    location = model_location(source, base_dir)
    compute = getattr(torch, COMPUTE_DTYPES[precision])
    try:
        return AutoModelForCausalLM.from_pretrained(
            location, **_load_kwargs(source, method, compute))
    except Exception as error:
        raise _load_error(location, source, error) from error


def _load_kwargs(source: ModelSource, method: MethodConfig, compute) -> dict[str, Any]:
    """from_pretrained's arguments: the base in the compute dtype for LoRA (4-bit for
    QLoRA), fp32 for a full fine-tune."""
    kwargs: dict[str, Any] = _hub_kwargs(source)
    if method.type == "qlora":
        kwargs["quantization_config"] = _four_bit(compute)
        kwargs["dtype"] = compute
    else:
        kwargs["dtype"] = compute if method.type == "lora" else torch.float32
    return kwargs


def _empty_model(location: str, source: ModelSource, dtype):
    """The model from its config alone, parameters on the meta device: no weight is read
    and no memory taken. Buffers stay real (rotary frequencies are computed, not stored),
    as does every attribute tensor computed at construction."""
    config = AutoConfig.from_pretrained(location, **_hub_kwargs(source))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=source.trust_remote_code)
    _finish_as_read(model, location, source)
    return model


def _finish_as_read(model, location: str, source: ModelSource) -> None:
    """What from_pretrained does after reading, done to a model built from its config:
    weights tied (on meta, transformers leaves them apart), eval mode, and the checkpoint's
    generation config (the export carries it on)."""
    model.tie_weights()
    model.eval()
    if model.can_generate():
        hub = _hub_kwargs(source)
        with contextlib.suppress(OSError):  # none saved: the one made from the config stays
            model.generation_config = GenerationConfig.from_pretrained(
                location, revision=hub["revision"], token=hub["token"])


def _apply_lora_to_empty(model, lora: LoraConfig):
    """LoRA on an empty (meta) base, with the adapters peft makes on a read one: peft
    initialises each adapter on the host, then moves it to its base layer's device, where
    on meta its values would be lost. So the base first becomes host tensors of its shapes
    and dtypes that hold nothing (one element broadcast to the shape: peft only asks their
    device and dtype, and a write would fail), peft draws the adapters as it does on a
    loaded model (the same random numbers, in the same dtype: every rank the same adapters,
    as when each read the model), and the base goes back to the meta device."""
    empty = swap_parameters(model, lambda p: torch.empty((), dtype=p.dtype).expand(p.shape),
                            lambda p: p.is_meta)
    model = apply_lora(model, lora)
    swap_parameters(model, lambda p: torch.empty_like(p, device="meta"),
                    lambda p: id(p) in empty)
    return model


def swap_parameters(model, make, which) -> set[int]:
    """Each parameter `which` selects replaced by a new one holding `make(parameter)`, its
    trainable flag kept and tied parameters still shared (a tensor's `.data` cannot move
    between the meta device and the host); returns the ids of the new parameters."""
    swapped: dict[int, tuple[Any, Any]] = {}  # old id -> (old, kept alive: ids stay unique; new)
    for module in model.modules():
        for attribute, parameter in module._parameters.items():
            if parameter is None or not (id(parameter) in swapped or which(parameter)):
                continue
            if id(parameter) not in swapped:
                swapped[id(parameter)] = (parameter, torch.nn.Parameter(
                    make(parameter.data), requires_grad=parameter.requires_grad))
            module._parameters[attribute] = swapped[id(parameter)][1]
    return {id(new) for _, new in swapped.values()}


def _prepare_four_bit(model, compute) -> None:
    model.requires_grad_(False)
    if compute == torch.float16 or os.environ.get("FINETUNE_QLORA_UPCAST") == "1":
        # fp16's narrow range wants the norms and embeddings in fp32 (peft's recipe);
        # bf16 has fp32's range, and keeping them in bf16 saves a cast of every one of
        # them (and of the 4-bit layers' inputs) in every forward and backward
        for parameter in model.parameters():
            if parameter.dtype in (torch.float16, torch.bfloat16) and \
                    type(parameter).__name__ != "Params4bit":
                parameter.data = parameter.data.float()


def enable_activation_checkpointing(model, policy: CheckpointPolicy = "full") -> None:
    """Recompute each decoder layer (or its cheap ops) in backward."""
    options = checkpointing_options(policy)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def checkpointing_options(policy: CheckpointPolicy) -> dict[str, Any]:
    """torch.utils.checkpoint arguments (non-reentrant: works with frozen inputs)."""
    options: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        options["context_fn"] = _keep_matmul_outputs
    return options


def _saved_ops() -> set:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward")
    saved = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    with contextlib.suppress(ImportError, AttributeError):  # packed attention (attention.py)
        from torch.nn.attention import varlen  # noqa: F401  registers the op, where torch has it

        saved.add(torch.ops.torch_attn._varlen_attn.default)
    return saved


def _keep_matmul_outputs():
    """Selective checkpointing (torchtitan's op-level policy): save what is expensive to
    recompute (matmuls, attention), recompute the element-wise rest."""
    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return Policy.MUST_SAVE if op in saved else Policy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def compile_layers(model, layer_classes: list[str]) -> int:
    """torch.compile each decoder layer in place (before FSDP wraps them, after
    checkpointing is set); returns how many were compiled."""
    compiled = 0
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            module.compile(dynamic=None)  # static first; dynamic after a length changes
            compiled += 1
    return compiled


def _four_bit(compute):
    if not torch.cuda.is_available():
        raise ModelError("spec.method.type", "qlora needs a CUDA GPU (bitsandbytes 4-bit "
                         "kernels) and none is visible", "use `method.type: lora` on CPU, or run "
                         "on GPU nodes")

    # quant_storage in the compute dtype lets FSDP shard the 4-bit weights like the rest
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute,
                              bnb_4bit_quant_storage=compute)


def inspect_architecture(source: ModelSource, method: MethodConfig,
                         base_dir: Path | None = None) -> list[str]:
    """Check the adapter targets on an empty (meta-device) copy of the model, before any
    weights are read or processes are joined; returns its decoder-layer class names
    (what FSDP wraps)."""
    location = model_location(source, base_dir)
    try:
        config = AutoConfig.from_pretrained(location, **_hub_kwargs(source))
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(
                config, trust_remote_code=source.trust_remote_code)
    except Exception as error:
        raise _load_error(location, source, error) from error
    if method.type != "full":
        _check_targets(model, method.lora or LoraConfig())
    return list(getattr(model, "_no_split_modules", None) or [])


def _check_targets(model, lora: LoraConfig) -> None:
    if lora.target_modules == ["all-linear"]:
        return
    available = linear_module_names(model)
    missing = [m for m in lora.target_modules if m not in available]
    if missing:
        raise ModelError("spec.method.lora.targetModules",
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                         f"a linear layer of {type(model).__name__}",
                         f"use some of {', '.join(sorted(available))}, or all-linear")


def linear_module_names(model) -> set[str]:
    """Short names of the linear layers LoRA can adapt (the output head excluded)."""
    names = set()
    for full_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit",
                                                                          "Linear8bitLt"):
            names.add(full_name.rsplit(".", 1)[-1])
    output = model.get_output_embeddings()
    for full_name, module in model.named_modules():
        if module is output:
            names.discard(full_name.rsplit(".", 1)[-1])
    return names


def apply_lora(model, lora: LoraConfig):
    # peft: only adapter jobs import it (as __main__._import_training_stack), not full ones
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    _check_targets(model, lora)
    targets = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    config = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=targets, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    for parameter in model.parameters():  # adapters train in fp32 whatever the base dtype
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    return model
