"""One copy of the model per node under FSDP: rank 0 reads, every rank keeps its shard (#17).

Every rank used to read the whole model into host memory before sharding it: a 70B full
fine-tune with 8 ranks per node asked each node for 8 x 280 GB. Now every rank builds the
model empty, on the meta device (`Loading` "meta": same dtypes, same LoRA adapters), and
shards it; rank 0 then reads one weight at a time and scatters it, each rank receiving
only its own rows. The node holds its shards and one weight in flight, not one model per
rank.

Rank 0 reads from the checkpoint's safetensors files, each weight through its own short
mapping of the file, so that the weight's pages are let go as soon as it has been sent.
(transformers' `from_pretrained` maps each file once for the whole load: every page read
stays resident until the last weight is freed, and a bf16 checkpoint read as fp32 holds
both. Read that way, rank 0 alone held one and a half copies.) Where the files do not hold
the model's weights under its own names and shapes (checkpoints transformers converts as
it reads them: fused MoE experts, renamed keys, `.bin` files, modules kept in fp32), rank 0
reads a whole copy with `from_pretrained` instead and sends from it, freeing each weight as
it goes: still one copy per node.

torch's `set_model_state_dict(..., broadcast_from_rank0=True)` was the other way: it
broadcasts each weight whole to every rank and keeps rank 0's whole state dict until it
returns, rank 0's copy and every shard at once.
The new parameters are assigned to their modules, which FSDP2 supports as it does
`load_state_dict(assign=True)`: its lazy initialisation adopts (and pads) them.

ZeRO-3 builds the model empty too; rank 0 reads one weight at a time, largest first, every
rank receives it whole and partitions it at once (`partition_from_rank0`): the node holds
the partitions so far and one weight per rank, never a whole model. (transformers' own
ZeRO-3 loading maps every file of the checkpoint on rank 0 for the whole load, and every
rank gathers each module whole to draw initial values first: 2x one copy on CPU.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

from finetune_trainer.config import CheckpointPolicy, MethodConfig, ModelSource, Precision
from finetune_trainer.loss import base_causal_lm
from finetune_trainer.model import _hub_kwargs, load_model, model_location, read_base_model

Layout = list[tuple[str, tuple[int, ...], Any]]
"""(name, shape, dtype) of every tensor rank 0 sends, in the order it sends them."""


def load_for(strategy, source: ModelSource, method: MethodConfig, precision: Precision,
             gradient_checkpointing: bool, base_dir: Path | None = None,
             checkpoint_policy: CheckpointPolicy = "full", device=None):
    """The model as `strategy` has it read (`load_model` with the strategy's `loading`),
    and the weights rank 0 sends in `strategy.setup` when every rank built it empty
    (None elsewhere): what each caller of `setup` needs, together."""
    how = strategy.loading(method.type)
    model = load_model(source, method, precision, gradient_checkpointing, base_dir,
                       loading=how, checkpoint_policy=checkpoint_policy, device=device)
    weights = (open_weights(source, model, method, precision, base_dir)
               if how in ("meta", "zero3") and dist.get_rank() == 0 else None)
    if how == "zero3":  # the partitions are the model: in place once it is loaded
        partition_from_rank0(model, weights, strategy.partition, device)
        return model, None
    return model, weights


class CheckpointWeights:
    """The model's weights read from its safetensors files, one at a time on request."""

    def __init__(self, files: dict[str, str], keys: dict[str, str], layout: Layout):
        self.files, self.keys, self.layout = files, keys, layout

    def take(self, name: str):
        key = self.keys[name]
        with safe_open(self.files[key], framework="pt") as checkpoint:
            return checkpoint.get_tensor(key)  # maps the file until the tensor is freed


class CopiedWeights:
    """The model's weights from a whole copy read by from_pretrained, each let go when
    taken."""

    def __init__(self, tensors: dict[str, Any], layout: Layout):
        self.tensors, self.layout = tensors, layout

    def take(self, name: str):
        return self.tensors.pop(name)


def open_weights(source: ModelSource, model, method: MethodConfig, precision: Precision,
                 base_dir: Path | None = None) -> CheckpointWeights | CopiedWeights:
    """Rank 0: the weights of `model` (built empty by load_model's "meta" or "zero3"), to
    be sent: every parameter on the meta device and every buffer the checkpoint holds,
    under `model`'s names."""
    location = model_location(source, base_dir)
    names = checkpoint_names(model)
    files = _safetensors_files(location, source)
    if files is not None and _streamable(model, names, files):
        layout = _layout(model, names, files)
        return CheckpointWeights(files, {name: names[name] for name, _, _ in layout}, layout)
    return _copied_weights(source, model, method, precision, base_dir, names)


def checkpoint_names(model) -> dict[str, str]:
    """Each parameter's and buffer's name in the checkpoint, by its name in `model`: the
    transformers model's own names (under a peft wrapper, without its prefix and without
    `base_layer`, the module LoRA wraps)."""
    base = base_causal_lm(model)
    by_id = {id(t): n.replace(".base_layer.", ".") for n, t in base.named_parameters()}
    names = {name: by_id[id(p)] for name, p in model.named_parameters() if id(p) in by_id}
    buffers = {id(t): n.replace(".base_layer.", ".") for n, t in base.named_buffers()}
    names.update((name, buffers[id(b)]) for name, b in model.named_buffers() if id(b) in buffers)
    return names


def _safetensors_files(location: str, source: ModelSource) -> dict[str, str] | None:
    """Each checkpoint key's safetensors file (downloaded for a hub model), or None when
    the checkpoint has none."""
    def find(filename: str) -> str | None:
        return cached_file(location, filename, revision=source.revision,
                           token=_hub_kwargs(source)["token"],
                           _raise_exceptions_for_missing_entries=False)

    if (index := find(SAFE_WEIGHTS_INDEX_NAME)) is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        paths = {file: find(file) for file in set(weight_map.values())}
        return {key: paths[file] for key, file in weight_map.items()}
    if (single := find(SAFE_WEIGHTS_NAME)) is None:
        return None
    with safe_open(single, framework="pt") as checkpoint:
        return dict.fromkeys(checkpoint.keys(), single)


def _streamable(model, names: dict[str, str], files: dict[str, str]) -> bool:
    """Whether the files hold every empty parameter under its checkpoint name, in its
    shape, and the model keeps no module in fp32 apart (from_pretrained would cast
    those, the config alone does not)."""
    base = base_causal_lm(model)
    if getattr(base, "_keep_in_fp32_modules", None) or getattr(
            base, "_keep_in_fp32_modules_strict", None):
        return False
    shapes = _checkpoint_shapes(files)
    return all(names.get(name) in shapes and shapes[names[name]] == tuple(p.shape)
               for name, p in model.named_parameters() if p.is_meta)


def _checkpoint_shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for path in set(files.values()):
        with safe_open(path, framework="pt") as checkpoint:
            for key in checkpoint.keys():  # noqa: SIM118 (a safetensors handle, no dict)
                shapes[key] = tuple(checkpoint.get_slice(key).get_shape())
    return shapes


def _layout(model, names: dict[str, str], files: dict[str, str]) -> Layout:
    """The empty parameters, then the buffers the checkpoint holds, in `model`'s dtypes
    (rank 0 casts each weight as from_pretrained would)."""
    layout = [(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()
              if p.is_meta]
    layout += [(name, tuple(b.shape), b.dtype) for name, b in model.named_buffers()
               if names.get(name) in files]
    return layout


def _copied_weights(source: ModelSource, model, method: MethodConfig, precision: Precision,
                    base_dir: Path | None, names: dict[str, str]) -> CopiedWeights:
    """A whole copy read by from_pretrained (its random draws, if any, undone: the other
    ranks drew none), its tensors under `model`'s names in their own dtypes."""
    state = torch.get_rng_state()
    copy = read_base_model(source, method, precision, base_dir)
    torch.set_rng_state(state)
    tensors = dict(copy.named_parameters())
    tensors.update(copy.named_buffers())
    del copy
    parameters = dict(model.named_parameters())
    sent = {name: tensors[key] for name, key in names.items() if key in tensors and (
        name not in parameters or parameters[name].is_meta)}  # LoRA's adapters are not
    layout = [(name, tuple(t.shape), t.dtype) for name, t in sent.items()]
    return CopiedWeights(sent, layout)


# --- the collective part: every rank ------------------------------------------------------

def agree_on_layout(model, weights: CheckpointWeights | CopiedWeights | None) -> Layout:
    """Collective, before sharding: rank 0's layout, which every rank's empty model takes
    on (the dtypes of a from_pretrained copy; FSDP2 groups parameters by dtype). Raises
    where a rank built the model differently."""
    layout = _agreed(weights)
    _take_on(model, layout)
    return layout


def _agreed(weights: CheckpointWeights | CopiedWeights | None) -> Layout:
    """Collective: rank 0's layout, on every rank."""
    shared = [weights.layout if weights is not None else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _take_on(model, layout: Layout) -> None:
    mine = _built_alike(model, layout)
    for name, shape, dtype in layout:
        tensor = mine[name]
        if tensor.dtype != dtype:
            tensor.data = (torch.empty(shape, dtype=dtype, device="meta") if tensor.is_meta
                           else tensor.data.to(dtype))


def _built_alike(model, layout: Layout) -> dict[str, Any]:
    """This rank's tensors by name, having checked it built every one rank 0 sends."""
    mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    differ = [name for name, shape, _ in layout
              if name not in mine or tuple(mine[name].shape) != shape]
    if differ:
        raise RuntimeError(
            f"this rank built the model from its config differently from rank 0 "
            f"({', '.join(differ[:5])}{'...' if len(differ) > 5 else ''}): custom model "
            "code (trust_remote_code) that builds other weights than it saves?")
    return mine


def partition_from_rank0(model, weights: CheckpointWeights | CopiedWeights | None,
                         partition: Callable[[Any], None], device) -> None:
    """Collective, ZeRO-3: rank 0's weights (None on the other ranks) into the empty
    model, module by module, the largest first (while little else is held): each of a
    module's weights is broadcast whole, then `partition(module)` keeps this rank's part
    and frees the rest. Buffers the checkpoint holds are broadcast whole (ZeRO-3 does not
    partition them)."""
    layout = _agreed(weights)
    _built_alike(model, layout)
    sent = {name: (shape, dtype) for name, shape, dtype in layout}
    names = {id(p): name for name, p in model.named_parameters()}
    owners = _parameter_owners(model)
    unsent = [name for name, p in model.named_parameters() if p.is_meta and name not in sent]
    if unsent:
        raise RuntimeError(f"rank 0 has no weights for {', '.join(unsent[:5])}")
    for name, (shape, dtype) in sent.items():
        if name not in owners:
            _assign_buffer(model, name, _broadcast(_taken(weights, name, device, dtype), shape,
                                                   dtype, device))
    for module in sorted((m for m in model.modules() if _empty_here(m)), key=_empty_bytes,
                         reverse=True):
        for parameter in [p for p in module.parameters() if p.is_meta]:
            name = names[id(parameter)]
            shape, dtype = sent[name]
            value = _broadcast(_taken(weights, name, device, dtype), shape, dtype, device)
            _assign(owners[name], torch.nn.Parameter(value,
                                                     requires_grad=parameter.requires_grad))
        partition(module)


def _empty_here(module) -> bool:
    return any(p is not None and p.is_meta for p in module._parameters.values())


def _empty_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.is_meta)


def _taken(weights: CheckpointWeights | CopiedWeights | None, name: str, device, dtype):
    """Rank 0: the weight read, cast as from_pretrained casts (the read then goes);
    None elsewhere."""
    return None if weights is None else weights.take(name).to(device=device, dtype=dtype)


def receive_weights(model, layout: Layout, weights: CheckpointWeights | CopiedWeights | None,
                    device, shard_device) -> None:
    """Collective, after sharding: each tensor of `layout` sent by rank 0 over the default
    group (on `device`, the group's): a parameter scattered, each rank receiving only its
    shard (kept on `shard_device`: the host under CPU offload), a buffer broadcast whole."""
    owners = _parameter_owners(model)
    for name, shape, dtype in layout:
        full = None
        if weights is not None:  # rank 0; cast as from_pretrained casts, then the read goes
            full = weights.take(name).to(device=device, dtype=dtype)
        if name in owners:
            old = getattr(*owners[name][0])
            value = _scatter(full, old, device).to(shard_device)
            _assign(owners[name], torch.nn.Parameter(
                _as_sharded(value, old), requires_grad=old.requires_grad))
        else:
            _assign_buffer(model, name, _broadcast(full, shape, dtype, device))
        del full


def _scatter(full, old, device):
    """This rank's rows of the weight (dim 0 split as torch.chunk and FSDP2 split it),
    received from rank 0 alone: no rank but 0 ever holds the whole weight."""
    if not isinstance(old, DTensor):  # not sharded: every rank takes it whole
        return _broadcast(full, tuple(old.shape), old.dtype, device)
    if old.device_mesh.ndim != 1 or tuple(old.placements) != (Shard(0),):
        raise NotImplementedError(f"{old.placements} on a {old.device_mesh.ndim}-D mesh: "
                                  "FSDPStrategy shards dim 0 over one mesh dimension")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = -(-old.shape[0] // world)
    shard = torch.empty((rows, *old.shape[1:]), dtype=old.dtype, device=device)
    chunks = None if full is None else [_padded(full, i * rows, rows) for i in range(world)]
    dist.scatter(shard, chunks, src=0)
    return shard[:max(0, min(rows, old.shape[0] - rank * rows))]


def _padded(full, start: int, rows: int):
    """Rows start..start+rows of `full` (a view), zero-padded where it ends before."""
    piece = full[start:start + rows]
    if piece.shape[0] == rows:
        return piece
    padded = torch.zeros((rows, *full.shape[1:]), dtype=full.dtype, device=full.device)
    padded[:piece.shape[0]] = piece
    return padded


def _as_sharded(local, old):
    if not isinstance(old, DTensor):
        return local
    return DTensor.from_local(local, old.device_mesh, old.placements, run_check=False,
                              shape=old.shape, stride=old.stride())


def _broadcast(tensor, shape, dtype, device):
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(tensor, src=0)
    return tensor


def _parameter_owners(model) -> dict[str, list[tuple[Any, str]]]:
    """Each parameter's (module, attribute) pairs under its first name (what
    `named_parameters` calls it): a tied weight has several, all given the new one."""
    first: dict[int, str] = {}
    owners: dict[str, list[tuple[Any, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in module._parameters.items():
            if parameter is None:
                continue
            name = first.setdefault(id(parameter), f"{prefix}.{attribute}" if prefix
                                    else attribute)
            owners.setdefault(name, []).append((module, attribute))
    return owners


def _assign(owners: list[tuple[Any, str]], parameter) -> None:
    for module, attribute in owners:
        setattr(module, attribute, parameter)


def _assign_buffer(model, name: str, value) -> None:
    prefix, _, attribute = name.rpartition(".")
    model.get_submodule(prefix)._buffers[attribute] = value
