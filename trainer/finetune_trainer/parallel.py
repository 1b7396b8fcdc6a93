"""Strategies: ddp, fsdp (FSDP2) and DeepSpeed ZeRO-1/2/3 behind one small interface.

Each strategy wraps the model, owns the optimizer step and the checkpoint format, and
nothing else; the training loop never branches on the distributed type. All of them
average gradients over ranks, and the loop scales each micro-batch's summed loss by
world / tokens-in-the-global-batch so the result is the mean over every label token.

Built on torch and deepspeed directly rather than through accelerate: accelerate only
selects FSDP and DeepSpeed on GPU device types, and these paths must run (and be tested)
on CPU workers over gloo as well.
"""

from __future__ import annotations

import contextlib
import os
import socket
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from finetune_trainer import loading
from finetune_trainer.collectives import DeepSpeedSampler, ddp_hook, time_fsdp
from finetune_trainer.config import Hyperparameters, MethodType, StrategyConfig
from finetune_trainer.model import Loading

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# --- process group ---------------------------------------------------------------------

def init_distributed(timeout_minutes: int = 30):
    """Join the process group from the torchrun / Azure ML environment (nccl on GPUs,
    gloo on CPU); a bare `finetune-train` runs as a world of one. Returns the device."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes),
                                device_id=device if backend == "nccl" else None)
    return device


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- strategies ------------------------------------------------------------------------

class Strategy:
    """The interface the loop uses. `model` is what forward is called on."""

    name = ""
    fused_optimizer = True
    """torch's fused AdamW where every trainable weight is on a GPU (optim.build_optimizer)."""
    shards_weights = False
    """Each rank holds part of the weights, gathered layer by layer inside a forward pass
    (FSDP, ZeRO-3): every rank must run as many forward passes as the others (GRPO's
    generation keeps going, `synced_gpus`, until every rank's completions have ended)."""

    def __init__(self, config: StrategyConfig, hp: Hyperparameters, device) -> None:
        self.config, self.hp, self.device = config, hp, device
        self.compute_dtype = getattr(torch, DTYPES[config.precision])
        self.model: Any = None
        self.optimizer: Any = None
        self.base_optimizer: Any = None
        """The torch optimizer the learning-rate schedule drives (DeepSpeed wraps it)."""
        # fp16 needs loss scaling; bf16 and fp32 do not (the scaler is then a no-op)
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
        self.background_group: Any = None
        """The process group of `save_async`'s writing thread (gloo), once one ran."""

    # set up
    def loading(self, method: MethodType) -> Loading:
        """How this rank reads the model (model.Loading), asked once before `load_model`:
        a replica is read straight onto its GPU, or whole into host memory on CPU."""
        return "device" if self.device.type == "cuda" else "host"

    def setup(self, model, make_optimizer, weights=None) -> None:
        """Wrap the model, make the optimizer; `weights`: what rank 0 reads for a model
        built empty (FSDP's `loading`), None elsewhere."""
        raise NotImplementedError

    # one micro-step
    def autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def backward(self, loss, boundary: bool) -> None:
        raise NotImplementedError

    def generating(self):
        """Around sampling with the unwrapped model (GRPO): what its weights need when it is
        run other than through the wrapper's forward."""
        return contextlib.nullcontext()

    def step(self) -> Any:
        """At the accumulation boundary: clip, update, zero; returns the gradient norm."""
        self.scaler.unscale_(self.optimizer)
        norm = self._clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # state
    def save(self, path: Path) -> None:
        """Collective: model (trainable weights) and optimizer state into `path`."""
        dcp.save(self._checkpoint_state(), storage_writer=_writer(path))

    def save_async(self, path: Path) -> Future | None:
        """Collective: what `save` writes, staged into host memory before it returns and
        written into `path` by a thread while training goes on (#17: synchronous saves
        stalled the loop). Returns the write's future; its failure is raised by `result()`.

        The thread's collectives (DCP's plan and commit) run on a gloo group of their own:
        on the default group they would interleave with the training step's, in an order
        that differs between ranks. Staging copies every tensor, so the next optimizer
        step cannot change what is written."""
        return dcp.async_save(self._checkpoint_state(), storage_writer=_writer(path),
                              process_group=self.save_group(),
                              async_checkpointer_type=AsyncCheckpointerType.THREAD)

    def checkpoint_bytes(self) -> int:
        """Host memory a background save stages: this rank's part of the checkpointed model
        and optimizer state (its shard under fsdp), copied whole before the write."""
        total = 0
        for value in tree_leaves(self._checkpoint_state()):
            tensor = value.to_local() if hasattr(value, "to_local") else value  # DTensor
            if hasattr(tensor, "element_size"):
                total += tensor.numel() * tensor.element_size()
        return total

    def _checkpoint_state(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(
            self.model, self.optimizer, options=StateDictOptions(ignore_frozen_params=True))
        return {"model": model_state, "optimizer": optim_state}

    def save_group(self):
        """The background writes' gloo group, made at the first one (collective: every
        rank reaches its first checkpoint at the same step)."""
        if self.background_group is None:
            self.background_group = dist.new_group(backend="gloo")
        return self.background_group

    def load(self, path: Path) -> None:
        # frozen base weights are not in the checkpoint: they come from the model itself
        options = StateDictOptions(ignore_frozen_params=True, strict=False)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)

    def full_state_dict(self) -> dict[str, Any]:
        """Collective: every weight, gathered on rank 0 (on CPU); empty elsewhere."""
        return get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))

    def time_collectives(self, log) -> Any:
        """Time this strategy's gradient collectives into `log` (a CollectiveLog); returns
        a sampler where timing every step would cost a sync (ZeRO), else None."""
        return None

    def unwrapped(self):
        """The Hugging Face (or peft) model inside the wrappers."""
        return getattr(self.model, "module", self.model)

    def _clip(self) -> Any:
        if self.hp.max_grad_norm <= 0:
            return None
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, self.hp.max_grad_norm)


def _writer(path: Path):
    # One file per tensor: DCP's writer keeps the host copy of every tensor of a file
    # until that file is written, so one file per rank (the default) held a GPU rank's
    # weights and both Adam moments on the host at once: 17 GB for a 1.5B full fine-tune.
    # (A background save stages all of them anyway: checkpoint.Checkpointer weighs that.)
    return dcp.FileSystemWriter(str(path), single_file_per_rank=False)


class DDPStrategy(Strategy):
    name = "ddp"

    def full_state_dict(self) -> None:
        """None: every rank holds the whole model, so `save_pretrained` takes it where it
        lives, one shard at a time (a gathered CPU copy would hold all of it on the host)."""
        return None

    def setup(self, model, make_optimizer, weights=None) -> None:
        model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        # gradients live in the all-reduce buckets: no copy in and out of them each step
        self.model = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
        self.optimizer = self.base_optimizer = make_optimizer(self.model)

    def time_collectives(self, log) -> Any:
        self.model.register_comm_hook(state=None, hook=ddp_hook(log))
        return None

    def backward(self, loss, boundary: bool) -> None:
        context = contextlib.nullcontext() if boundary else self.model.no_sync()
        with context:
            self.scaler.scale(loss).backward()


class FSDPStrategy(Strategy):
    """FSDP2: each decoder layer is its own shard group, then the root.

    A LoRA layer's group holds its 16-bit frozen base and its fp32 adapters together:
    FSDP2 asks one dtype only of a group's trainable parameters (torch >= 2.8), the
    mixed-precision policy gathers both in the compute dtype, and gradients reach only
    the adapters, reduced in fp32."""

    name = "fsdp"
    shards_weights = True

    def __init__(self, config, hp, device, wrap_classes: list[str]) -> None:
        super().__init__(config, hp, device)
        self.wrap_classes = set(wrap_classes)
        self.from_rank0 = False
        """Set by `loading`: every rank's model is empty, filled from rank 0's reads."""

    def loading(self, method: MethodType) -> Loading:
        """Every rank builds the model empty and, once it is sharded, keeps its slice of
        each weight rank 0 reads (`setup`, loading.py): the node holds its shards, not one
        model per rank (#17). QLoRA stays as transformers places it (bitsandbytes
        quantizes each rank's weights on its own GPU as they are read)."""
        self.from_rank0 = method != "qlora" and dist.get_world_size() > 1
        return "meta" if self.from_rank0 else "host"

    def setup(self, model, make_optimizer, weights=None) -> None:
        """`weights`: rank 0's (loading.load_for) when the model was built empty."""
        self._shard(model, weights)
        self.model = model
        self.optimizer = self.base_optimizer = make_optimizer(model)

    def frozen(self, model, weights=None):
        """`model` (from loading.load_for, as the trained one) sharded as the trained one
        is, for forward passes without gradients (GRPO's reference): no optimizer."""
        model.requires_grad_(False)
        self._shard(model, weights)
        return model.eval()

    def _shard(self, model, weights) -> None:
        options = self._shard_options()
        if self.from_rank0 and dist.get_rank() == 0 and weights is None:
            raise ValueError("every rank built the model empty: rank 0 sends the weights "
                             "(loading.load_for gives them)")
        layout = loading.agree_on_layout(model, weights) if self.from_rank0 else None
        # the model comes from the host whole (or empty); fully_shard moves each group's
        # parameters and buffers to the device as it shards them, so only one layer is
        # ever whole on a GPU (a model.to() first would put all of it there: 131 GiB for
        # a 70B base)
        for module in model.modules():
            if type(module).__name__ in self.wrap_classes:
                fully_shard(module, **options)
        fully_shard(model, **options)
        if self.from_rank0:
            offloaded = "offload_policy" in options
            loading.receive_weights(model, layout, weights, self.device,
                                    shard_device="cpu" if offloaded else self.device)

    def _shard_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.compute_dtype != torch.float32:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype,
                                                        reduce_dtype=torch.float32)
        if self.config.offload == "cpu" and self.device.type != "cpu":
            options["offload_policy"] = CPUOffloadPolicy()
        return options

    def autocast(self):
        return contextlib.nullcontext()  # the mixed-precision policy casts per layer

    def time_collectives(self, log) -> Any:
        time_fsdp(self.model, log)
        return None

    def backward(self, loss, boundary: bool) -> None:
        self.model.set_requires_gradient_sync(boundary)
        self.scaler.scale(loss).backward()

    @contextlib.contextmanager
    def generating(self):
        """The root group's weights (embeddings, the output layer) gathered: `generate` of a
        peft model reaches the decoder through inner modules, never the root's forward,
        whose hook would gather them; each layer's group still gathers in its own forward
        (every rank decoding in step, `synced_gpus`). Before the first forward pass FSDP has
        not yet found its root, which only a forward through the root does: done here (the
        layers would otherwise each take themselves for one)."""
        self.model._get_fsdp_state()._lazy_init()  # no public call; a no-op once done
        self.model.unshard()
        try:
            yield
        finally:
            self.model.reshard()


class DeepSpeedStrategy(Strategy):
    """ZeRO stages 1-3 through deepspeed.initialize; the engine owns precision and clipping.

    The engine holds the module in the compute dtype (LoRA's frozen base arrives in it;
    the adapters are cast) and keeps fp32 master copies of the trainable weights alone,
    partitioned with their gradients and Adam moments."""

    fused_optimizer = False
    """The engine steps its own flat fp32 partitions (on the host under offload) with the
    torch optimizer it is given: the foreach AdamW, as it always was."""

    def __init__(self, config, hp, device) -> None:
        super().__init__(config, hp, device)
        self.name = config.type
        self.shards_weights = config.type == "zero3"
        self.background_engine: Any = None
        """The checkpoint engine `save_async` lends the DeepSpeed engine, once made."""

    def ds_config(self) -> dict[str, Any]:
        return deepspeed_config(self.config, self.hp)

    def loading(self, method: MethodType) -> Loading:
        """ZeRO-3 builds the model empty and partitions each weight as rank 0 reads and
        sends it (`partition`), so no rank holds more than its partitions and one weight.
        ZeRO-1/2 hold a replica per GPU."""
        if self.config.type != "zero3" or method == "qlora":
            return super().loading(method)
        self._init_deepspeed()
        return "zero3"

    def frozen(self, model, weights=None):
        """ZeRO-3: `model` (from loading.load_for, partitioned as it was read) made an
        engine without an optimizer, for forward passes without gradients (GRPO's
        reference): its parameters stay partitioned and are gathered in each layer's
        forward, as the trained model's are (TRL's `prepare_deepspeed` does the same)."""
        import deepspeed  # ZeRO's engine: only ZeRO jobs import deepspeed (seconds, its ops)

        if self.config.type != "zero3":
            raise ValueError(f"{self.name} keeps whole weights: a frozen copy needs no engine")
        model.requires_grad_(False)
        config = {key: value for key, value in self.ds_config().items()
                  if key not in ("optimizer", "scheduler")}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # the engine's returns None
        return engine

    def partition(self, module) -> None:
        """ZeRO-3: partition `module`'s own weights, just received whole (`loading`)."""
        zero3_partition(module, self.ds_config(), self.compute_dtype, self.device)

    def _init_deepspeed(self) -> None:
        import deepspeed  # ZeRO's engine: only ZeRO jobs import deepspeed (seconds, its ops)

        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")

    def setup(self, model, make_optimizer, weights=None) -> None:
        import deepspeed  # ZeRO's engine: only ZeRO jobs import deepspeed (seconds, its ops)

        self._init_deepspeed()
        config = self.ds_config()
        # before partitioning the rest (adapters; the whole model when not built partitioned)
        self.base_optimizer = make_optimizer(model)
        if self.config.type == "zero3":
            zero3_partition(model, config, self.compute_dtype, self.device)
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=self.base_optimizer, config=config)

    def autocast(self):
        return contextlib.nullcontext()  # the engine runs the module in bf16/fp16 itself

    def backward(self, loss, boundary: bool) -> None:
        self.model.set_gradient_accumulation_boundary(boundary)
        self.model.backward(loss, scale_wrt_gas=False)
        self.model.step()  # applies the update only at the boundary

    def step(self) -> Any:
        return self.model.get_global_grad_norm()

    def time_collectives(self, log) -> Any:
        return DeepSpeedSampler()

    def save(self, path: Path) -> None:
        self.model.save_checkpoint(str(path), tag="deepspeed", save_latest=False,
                                   exclude_frozen_parameters=True)

    def save_async(self, path: Path) -> Future:
        """What `save` writes, through the engine's own `save_checkpoint` with a checkpoint
        engine of ours lent for the call: it stages each file in host memory and a thread
        writes it (deepspeed_saves.py). Returns the write's future."""
        # deepspeed's own classes: only ZeRO jobs import deepspeed (seconds, and its ops)
        from finetune_trainer.deepspeed_saves import BackgroundCheckpointEngine

        if self.background_engine is None:
            self.background_engine = BackgroundCheckpointEngine(self.model._config)
        own, self.model.checkpoint_engine = self.model.checkpoint_engine, self.background_engine
        try:
            self.save(path)
        finally:
            self.model.checkpoint_engine = own
        return self.background_engine.written()

    def checkpoint_bytes(self) -> int:
        """Host memory a background save stages: the fp32 partition this rank steps and
        its two Adam moments, and the trainable weights in the compute dtype (the module
        states, which only one rank writes, counted on every rank)."""
        stepped = sum(p.numel() for group in self.base_optimizer.param_groups
                      for p in group["params"])
        trainable = sum(getattr(p, "ds_numel", p.numel())
                        for p in self.model.module.parameters() if p.requires_grad)
        return stepped * 12 + trainable * self.compute_dtype.itemsize

    def load(self, path: Path) -> None:
        self.model.load_checkpoint(str(path), tag="deepspeed", load_module_strict=False)

    def full_state_dict(self) -> dict[str, Any]:
        if self.config.type == "zero3":
            state = self.model._zero3_consolidated_16bit_state_dict()
        else:
            state = self.model.module.state_dict() if dist.get_rank() == 0 else {}
        return {k: v.detach().cpu() for k, v in (state or {}).items()}


def zero3_partition(model, config: dict[str, Any], dtype, device) -> None:
    """ZeRO-3: each parameter not yet partitioned (a module's weights as they arrive while
    loading; LoRA's adapters, left for `setup`; every one of a model read whole) cast to
    the compute dtype and partitioned on its way to the device, which
    `deepspeed.initialize` does only after moving the whole module there (more than one
    GPU holds for a 70B base); the engine then finds it partitioned."""
    import deepspeed  # ZeRO's engine: only ZeRO jobs import deepspeed (seconds, its ops)

    for parameter in model.parameters():  # what the engine's own cast does: buffers stay
        if hasattr(parameter, "ds_id"):
            continue  # partitioned already, in the compute dtype
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    for buffer in model.buffers():  # never partitioned; the engine no longer moves them
        buffer.data = buffer.data.to(device)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)


def deepspeed_config(strategy: StrategyConfig, hp: Hyperparameters) -> dict[str, Any]:
    """The DeepSpeed config for zero1/zero2/zero3 (+ offload), matching our loop."""
    stage = int(strategy.type.removeprefix("zero"))
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if strategy.offload != "none":
        target: dict[str, Any] = {"device": strategy.offload, "pin_memory": False}
        if strategy.offload == "nvme":
            target["nvme_path"] = strategy.nvme_path
        zero["offload_optimizer"] = dict(target)
        if stage == 3:
            zero["offload_param"] = dict(target)
    micro_batch, passes = hp.micro_steps()
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": passes,
        "gradient_clipping": hp.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": strategy.precision == "bf16"},
        "fp16": {"enabled": strategy.precision == "fp16"},
        # our AdamW is used even with offload; DeepSpeedCPUAdam is faster where it builds
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def build_strategy(config: StrategyConfig, hp: Hyperparameters, device,
                   wrap_classes: list[str]) -> Strategy:
    if config.type == "ddp":
        return DDPStrategy(config, hp, device)
    if config.type == "fsdp":
        return FSDPStrategy(config, hp, device, wrap_classes)
    return DeepSpeedStrategy(config, hp, device)
