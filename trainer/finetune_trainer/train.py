"""The training loop. Components live in sibling modules; this file puts them in order.

Loss normalisation: a step's loss is the sum of token cross-entropies over every label
token of the global batch, divided by that token count (known before the forward pass,
summed over ranks on a CPU group, no device sync). Each micro-batch's summed loss is
scaled by world x accumulation / tokens, because every strategy averages gradients over
ranks and divides by the accumulation steps. So 2 ranks equal 1 rank with doubled
accumulation, and padding or uneven packing never reweights tokens.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_trainer import checkpoint, flops, network_preflight, tracking, trained_with
from finetune_trainer.collectives import CollectiveLog, merge
from finetune_trainer.config import TrainerConfig
from finetune_trainer.data import (
    IGNORE,
    DataError,
    GlobalBatches,
    Prefetched,
    collate,
    one_per_sequence,
    pack,
    pack_in_order,
    read_records,
    resolve_format,
    tokenize_records,
)
from finetune_trainer.loading import load_for
from finetune_trainer.metrics import TrainerMetrics, peak_memory_bytes
from finetune_trainer.model import (
    compile_layers,
    inspect_architecture,
    load_tokenizer,
)
from finetune_trainer.profiling import StepProfiler
from finetune_trainer.progress import ProgressServer, Reporter
from finetune_trainer.timing import StepPhases

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what Kubernetes and torchrun expect after SIGTERM
FINAL_DIR = "final"
EXPORT_SHARD_SIZE = "1GB"
MERGED_DIR = "merged"


@dataclass
class Prepared:
    """Everything checked and built before a process group exists."""

    tokenizer: object
    train: list[dict[str, list[int]]]
    eval: list[dict[str, list[int]]]
    wrap_classes: list[str]


def resolve_path(uri: str, base_dir: Path) -> Path:
    path = Path(uri)
    return path if path.is_absolute() else (base_dir / path).resolve()


def packer():
    """Best-fit-decreasing `pack`; FINETUNE_PACKING=next-fit joins consecutive samples
    instead (the other side of benchmarks/changes.py)."""
    chosen = os.environ.get("FINETUNE_PACKING", "best-fit")
    packers = {"best-fit": pack, "next-fit": pack_in_order}
    if chosen not in packers:
        raise ValueError(f"FINETUNE_PACKING={chosen!r}: use one of {', '.join(packers)}")
    return packers[chosen]


def preflight(config: TrainerConfig, base_dir: Path) -> Prepared:
    """Read and check the model and the data; bad input fails here, before any rank joins."""
    wrap_classes = inspect_architecture(config.model, config.method, base_dir)
    tokenizer = load_tokenizer(config.model, base_dir)
    data = config.dataset
    records = read_records(data, base_dir)
    fmt = resolve_format(data.format, records.column_names)
    eval_records = []
    if data.eval_fraction > 0:
        if len(records) < 2:
            raise DataError(data.uri, "has too few samples for an eval split",
                            "add data or set spec.dataset.evalFraction to 0")
        split = records.train_test_split(test_size=data.eval_fraction,
                                         seed=config.hyperparameters.seed)
        records, eval_records = split["train"], split["test"]
    train = tokenize_records(records, fmt, tokenizer, data.max_seq_length)
    if not train:
        raise DataError(data.uri, "has no sample with a trained token after truncation",
                        "raise spec.dataset.maxSeqLength or check the response columns")
    evaluation = tokenize_records(eval_records, fmt, tokenizer, data.max_seq_length)
    arrange = (functools.partial(packer(), max_length=data.max_seq_length) if data.packing
               else one_per_sequence)
    return Prepared(tokenizer, arrange(train), arrange(evaluation), wrap_classes)


class StopRequest:
    """SIGTERM (preemption, node drain, `kubectl delete`): finish the step, checkpoint, exit."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agree(self, group) -> _Agreement:
        """Start agreeing (all ranks, asynchronously) on whether any rank was told to
        stop; every rank stops after the same step."""
        return _Agreement(self.requested, group)


class _Agreement:
    def __init__(self, requested: bool, group) -> None:
        import torch
        import torch.distributed as dist

        self.flag = torch.tensor([1.0 if requested else 0.0])
        self.work = dist.all_reduce(self.flag, group=group, async_op=True)

    def wait(self) -> bool:
        self.work.wait()
        return bool(self.flag.item() > 0)


class StepCounts:
    """Label tokens, input tokens and sequences of any step's global batch, from per-
    sequence counts taken once: identical on every rank without communicating."""

    def __init__(self, sequences, batches: GlobalBatches) -> None:
        self.batches = batches
        # as the loss counts them: the label of each row's first token is never predicted
        self.labels = [sum(label != IGNORE for label in s["labels"][1:]) for s in sequences]
        self.inputs = [len(s["input_ids"]) for s in sequences]

    def of_indices(self, micro_batches: list[list[int]]) -> int:
        return sum(self.labels[i] for indices in micro_batches for i in indices)

    def of_step(self, epoch: int, step: int) -> tuple[int, int, int]:
        window = self.batches.step_indices(epoch, step)
        return (sum(self.labels[i] for i in window), sum(self.inputs[i] for i in window),
                len(window))


def _label_tokens(batch) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def _all_ranks_sum(values: list[float], group) -> list[float]:
    import torch
    import torch.distributed as dist

    if group is None:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


class LogWindow:
    """Work done since the last log step (every rank sees the all-ranks sums)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.steps = 0
        self.inputs = 0.0  # tokens through the model (prompts included), for MFU
        self.sequences = 0.0

    def add(self, inputs: float, sequences: float) -> None:
        self.steps += 1
        self.inputs += inputs
        self.sequences += sequences

    def seconds(self) -> float:
        return time.perf_counter() - self.started


def _model_flops_per_token(model, sequences) -> float:
    """Model FLOPs per token at this data's mean sequence length (packed sequences count
    whole: attention within a packed sequence is slightly over-counted)."""
    params, frozen, layers, width = flops.model_shape(model)
    mean_length = sum(len(s["input_ids"]) for s in sequences) / max(len(sequences), 1)
    return flops.model_flops_per_token(params, layers, width, mean_length, frozen_params=frozen)


def _as_float(value) -> float | None:
    """A gradient norm as the strategies return it (tensor, DTensor, float or None)."""
    if value is None:
        return None
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


def check_network(config: TrainerConfig, device, output_dir: Path, scratch: Path | None,
                  metrics: TrainerMetrics):
    """The collective preflight; rank 0 logs the table. Raises PreflightError below the
    floor or when InfiniBand was asked for and not used."""
    import torch.distributed as dist

    result = network_preflight.measure(device)
    if scratch is not None:
        result.transport = network_preflight.read_transport(scratch)
    if device.type == "cuda":
        result.flight_recorder = str(output_dir / network_preflight.FLIGHT_RECORDER_DIR)
    if dist.get_rank() == 0:
        print(result.table(), flush=True)
        metrics.preflight(result)
    nodes = len(result.node_bandwidth()) or 1
    network_preflight.check_floor(result, config.preflight.min_bus_bandwidth_gbps)
    network_preflight.check_transport(result, config.preflight.require_infiniband, nodes)
    return result


def _network_env(config: TrainerConfig, output_dir: Path) -> Path | None:
    """Before the process group exists: the NCCL flight recorder, and NCCL's transport log
    where InfiniBand must be checked. Returns the folder of that log."""
    import torch

    if not torch.cuda.is_available():
        return None
    for name, value in network_preflight.flight_recorder_env(output_dir).items():
        os.environ.setdefault(name, value)
    (output_dir / network_preflight.FLIGHT_RECORDER_DIR).mkdir(parents=True, exist_ok=True)
    if not (config.preflight.enabled and config.preflight.require_infiniband):
        return None
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="nccl-log-"))
    os.environ.update(network_preflight.nccl_debug_env(scratch))
    return scratch


def evaluate(strategy, sequences, micro_batch: int, collation: Collation, group
             ) -> float | None:
    """Mean token loss over the eval split; every rank runs the same number of batches."""
    import torch
    import torch.distributed as dist

    from finetune_trainer.loss import summed_loss

    if not sequences:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    strategy.model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(sequences), micro_batch * world):
            mine = sequences[start + rank * micro_batch: start + (rank + 1) * micro_batch]
            batch = collation.tensors(mine)
            with strategy.autocast():
                total += float(summed_loss(strategy.model, _to(batch, strategy.device),
                                           collation.head))
            tokens += _label_tokens(batch)
    strategy.model.train()
    total, tokens = _all_ranks_sum([total, tokens], group)
    return total / max(tokens, 1)


def export(strategy, tokenizer, config: TrainerConfig, output_dir: Path, base_dir: Path) -> Path:
    """The model a user hands to vLLM next: a peft adapter or full safetensors weights,
    and, with mergeAdapter, the base model with the adapter merged in."""
    import torch.distributed as dist

    final = output_dir / FINAL_DIR
    state_dict = strategy.full_state_dict()  # collective under fsdp / zero3; None under ddp
    if dist.get_rank() == 0:
        # a shard's weights are on the host together while it is written: bounded, so
        # exporting never holds the whole model there (adapters are small)
        shards = {"max_shard_size": EXPORT_SHARD_SIZE} if config.method.type == "full" else {}
        strategy.unwrapped().save_pretrained(final, state_dict=state_dict,
                                             safe_serialization=True, **shards)
        tokenizer.save_pretrained(final)
        if config.method.type != "full" and config.output.merge_adapter:
            merge_adapter(config, final, output_dir / MERGED_DIR, base_dir)
    dist.barrier()
    return final


def merge_adapter(config: TrainerConfig, adapter_dir: Path, out: Path, base_dir: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune_trainer.model import model_location

    base = AutoModelForCausalLM.from_pretrained(model_location(config.model, base_dir),
                                                dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out)


def total_steps(config: TrainerConfig, batches: GlobalBatches) -> int:
    hp = config.hyperparameters
    if hp.max_steps is not None:
        return hp.max_steps
    return max(1, math.ceil((hp.epochs or 1) * batches.steps_per_epoch))


@dataclass(frozen=True)
class Collation:
    """How a micro-batch's sequences become the CPU tensors its forward takes."""

    pad_id: int
    head: Any = None
    """The fused loss head (loss.install): the trained positions go with the batch."""
    bounds: bool = False
    """Packed attention (attention.install): the samples' bounds go with the batch."""
    width: int | None = None
    """Pad every row to this width (compiled layers on packed rows: one shape, so no
    recompile when a batch comes out a little shorter); else to the longest row."""

    def tensors(self, sequences) -> dict:
        from finetune_trainer import loss
        from finetune_trainer.attention import sequence_bounds

        batch = collate(sequences, self.pad_id, self.width)
        if self.head is not None:
            batch.update(loss.loss_targets(batch["labels"]))
        if self.bounds:
            batch["cu_seq_lens"] = sequence_bounds(batch["position_ids"])
        return batch


def _to(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _say(text: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(text, flush=True)


def run(config: TrainerConfig, base_dir: Path) -> int:
    """Train to the last step (or to a SIGTERM); returns the process exit code."""
    import torch
    import torch.distributed as dist
    import transformers

    from finetune_trainer import attention, loss
    from finetune_trainer.optim import build_optimizer, build_scheduler
    from finetune_trainer.parallel import build_strategy, init_distributed

    hp, method = config.hyperparameters, config.method
    prepared = preflight(config, base_dir)
    stop = StopRequest()
    output_dir = resolve_path(config.output.uri, base_dir)
    nccl_log = _network_env(config, output_dir)
    device = init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank != 0:
        transformers.logging.set_verbosity_error()
    control = dist.new_group(backend="gloo")  # CPU-side agreement, no device sync
    metrics = TrainerMetrics(config.job.name, config.job.namespace or "", rank, device=device)
    network = None
    if config.preflight.enabled and world > 1:
        network = check_network(config, device, output_dir, nccl_log, metrics)
    transformers.set_seed(hp.seed)
    pad_id = prepared.tokenizer.pad_token_id

    strategy = build_strategy(config.strategy, hp, device, prepared.wrap_classes)
    # unset (the operator resolves both before a worker starts): checkpointing on, no compile
    checkpointing = config.strategy.gradient_checkpointing is not False
    # built empty under fsdp: rank 0 reads `weights` one at a time in setup (loading.py)
    model, weights = load_for(strategy, config.model, method, config.strategy.precision,
                              checkpointing, base_dir, device=device,
                              checkpoint_policy=config.strategy.gradient_checkpointing_policy)
    bounds = False  # packed attention: the samples' bounds go with every batch
    if config.strategy.packed_attention:
        if (why_not := attention.why_not(loss.base_causal_lm(model), device)) is None:
            attention.install(loss.base_causal_lm(model))
            bounds = True
        elif device.type == "cuda":
            _say(f"packed attention off: {why_not}; SDPA with a block-diagonal mask")
    if config.strategy.compile is True:
        layers = compile_layers(model, prepared.wrap_classes)
        _say(f"compiling {layers} decoder layers with torch.compile (the first steps are slow)")
    head = None
    if config.strategy.fused_loss:
        if (why_not := loss.fusable(model)) is None:
            head = loss.install(model)
        else:
            _say(f"fused loss off: {why_not}; the logits are computed whole")
    fixed = config.strategy.compile is True and config.dataset.packing
    collation = Collation(pad_id, head, bounds,
                          width=config.dataset.max_seq_length if fixed else None)
    flops_per_token = _model_flops_per_token(model, prepared.train)
    peak = flops.peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    learning_rate = hp.resolved_learning_rate(method.type)
    strategy.setup(model, lambda m: build_optimizer(m, hp, learning_rate,
                                                    fused=strategy.fused_optimizer), weights)
    instrumented = config.metrics.enabled
    collective_log = CollectiveLog(device, world) if instrumented else None
    sampler = strategy.time_collectives(collective_log) if instrumented and world > 1 else None
    phases = StepPhases(device) if instrumented else None
    batches = GlobalBatches(len(prepared.train), hp.batch_size_per_device,
                            hp.gradient_accumulation_steps, world, hp.seed)
    steps = total_steps(config, batches)
    scheduler = build_scheduler(strategy.base_optimizer, hp, steps)

    state = checkpoint.TrainerState(step=0, epoch=0, step_in_epoch=0, tokens_seen=0,
                                    total_steps=steps)
    checkpoints = checkpoint.Checkpointer(
        strategy, scheduler, output_dir, config.output.keep_last, trained_with.record(config),
        say=_say, observe=metrics.checkpoint_save.observe,
        behind=config.output.async_checkpoints)
    metrics.total_steps.set(steps)
    if (latest := checkpoint.latest_checkpoint(output_dir)) is not None:
        started = time.perf_counter()
        state = checkpoint.load(strategy, scheduler, latest)
        metrics.resumed(time.perf_counter() - started)
        _say(f"resuming from {latest} (step {state.step}/{steps})")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # one port per process on a node
    server = (ProgressServer(config.metrics.port + local_rank, registry=metrics.registry)
              if config.metrics.enabled else None)
    tracker = tracking.from_environment() if rank == 0 else None  # Azure ML Studio charts
    reporter = Reporter(output_dir, steps, state.step, enabled=rank == 0, server=server,
                        tracker=tracker)
    reporter.preflight = network.record() if network is not None else None
    _say(f"training {len(prepared.train)} sequences on {world} "
         f"{'process' if world == 1 else 'processes'} ({strategy.name}, "
         f"{config.strategy.precision}): {steps} steps of {batches.global_batch} sequences")

    counts = StepCounts(prepared.train, batches)
    pin = device.type == "cuda"

    def load_step(key: tuple[int, int]):
        """This rank's micro-batches of one step, as CPU tensors (pinned on a GPU host)."""
        mine = batches.micro_batches(*key, rank)
        tensors = [collation.tensors([prepared.train[i] for i in indices])
                   for indices in mine]
        if pin:
            tensors = [{k: v.pin_memory() for k, v in batch.items()} for batch in tensors]
        return mine, tensors

    schedule = batches.schedule(state.step)
    # a collating thread pays where the device computes asynchronously; on CPU workers it
    # only competes for the cores (0.92-0.94x in benchmarks/changes.py). FINETUNE_PREFETCH
    # =1 / =0 forces it on / off (the benchmark's two sides).
    prefetch = os.environ.get("FINETUNE_PREFETCH", "1" if pin else "0") == "1"
    if prefetch:
        steps_ahead = Prefetched(schedule, load_step)
    else:
        steps_ahead = ((key, load_step(key)) for key in schedule)
    loss_window = torch.zeros((), device=device, dtype=torch.float64)
    tokens_window = 0
    window = LogWindow()
    sampled: list = []  # ZeRO's timed steps since the last log step
    grad_norm = None
    profiler = StepProfiler.from_environment(rank, device.type)  # FINETUNE_PROFILE=DIR
    strategy.model.train()
    if stop.agree(control).wait():  # told to stop while loading: nothing new to save
        _say("stopped by SIGTERM before the first step; a restart resumes from "
             f"{'step ' + str(state.step) if state.step else 'the start'}")
        reporter.finish("Stopped")
        return EXIT_PREEMPTED
    while state.step < steps:
        if phases is not None:
            phases.begin()
        (epoch, step_in_epoch), (mine, micro_batches) = next(steps_ahead)
        agreement = stop.agree(control)  # overlaps the step; waited for at its end
        # every rank knows the whole global batch, so the token count the loss is
        # normalised by needs no collective
        step_tokens, step_inputs, step_sequences = counts.of_step(epoch, step_in_epoch)
        local_tokens = counts.of_indices(mine)
        scale = world / max(step_tokens, 1)
        if phases is not None:
            phases.mark()
        sampling = sampler is not None and sampler.wants(state.step + 1)
        if sampling:
            sampler.begin()
        for index, batch in enumerate(micro_batches):
            with strategy.autocast():
                summed = loss.summed_loss(strategy.model, _to(batch, device), head)
            strategy.backward(summed * scale, boundary=index == len(micro_batches) - 1)
            loss_window += summed.detach()
        if phases is not None:
            phases.mark()
        grad_norm = strategy.step()
        scheduler.step()
        if phases is not None:
            phases.mark()
        if sampling:
            sampled.append(sampler.end())
        if profiler is not None:
            profiler.step()
        stopping = agreement.wait()
        if collective_log is not None:
            collective_log.step_boundary()
        state = checkpoint.TrainerState(
            step=state.step + 1, epoch=epoch + (step_in_epoch + 1) // batches.steps_per_epoch,
            step_in_epoch=(step_in_epoch + 1) % batches.steps_per_epoch,
            tokens_seen=state.tokens_seen + int(step_tokens), total_steps=steps)
        tokens_window += int(step_tokens)
        window.add(step_inputs, step_sequences)
        reporter.step_done(int(step_tokens))
        metrics.tokens.inc(local_tokens)
        metrics.samples.inc(sum(len(indices) for indices in mine))

        done = state.step == steps
        if state.step % hp.log_every_steps == 0 or done or stopping:
            window_loss = _all_ranks_sum([float(loss_window)], control)[0]
            seconds = window.seconds()
            mfu = (flops_per_token * window.inputs / seconds / (peak * world)
                   if peak and seconds > 0 else None)
            with checkpoints.writing_beside():  # a full volume: the checkpoint's doing
                record = reporter.report(state.step, state.step / batches.steps_per_epoch,
                                         window_loss / max(tokens_window, 1),
                                         scheduler.get_last_lr()[0], mfu=mfu,
                                         peak_memory=peak_memory_bytes(device))
            split = phases.drain() if phases is not None else {}
            if collective_log is not None:
                timed = merge([collective_log.drain(), *sampled])
                sampled.clear()
                metrics.collectives(timed, world)
                if timed.totals:
                    split["collective_wait"] = timed.exposed_seconds / max(window.steps, 1)
            metrics.logged(record.step, steps, record.epoch, record.loss, record.learningRate,
                           record.tokensPerSecond, device, grad_norm=_as_float(grad_norm),
                           samples_per_second=window.sequences / seconds if seconds else None,
                           mfu=mfu, phases=split)
            loss_window.zero_()
            tokens_window = 0
            window = LogWindow()
        if hp.eval_every_steps and state.step % hp.eval_every_steps == 0 and not done:
            eval_loss = evaluate(strategy, prepared.eval, hp.batch_size_per_device,
                                 collation, control)
            _say(f"eval at step {state.step}: loss {eval_loss:.4f}")
        every = config.output.checkpoint_every_steps
        if done or stopping or (every and state.step % every == 0):
            # in the background, but not on SIGTERM: the pod has seconds left, and the
            # checkpoint of this very step must be complete before it exits
            checkpoints.save(state, background=not stopping)
        if stopping:
            _say(f"stopped by SIGTERM after step {state.step}; a restart resumes from the "
                 "checkpoint above")
            reporter.finish("Stopped")
            return EXIT_PREEMPTED

    checkpoints.finish()  # the last checkpoint complete before anything else can fail
    if profiler is not None:
        profiler.stop()
        if profiler.written is not None:
            _say(f"profile of steps written to {profiler.written.parent}")
    eval_loss = evaluate(strategy, prepared.eval, hp.batch_size_per_device, collation,
                         control)
    if eval_loss is not None:
        _say(f"eval loss {eval_loss:.4f}")
    final = export(strategy, prepared.tokenizer, config, output_dir, base_dir)
    reporter.finish("Succeeded")
    _say(f"exported {final}")
    dist.destroy_process_group()
    return 0
