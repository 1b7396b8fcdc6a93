"""The training loop. Components live in sibling modules; this file puts them in order.

Loss normalisation: a step's loss is the sum of token cross-entropies over every label
token of the global batch, divided by that token count (known before the forward pass,
summed over ranks on a CPU group, no device sync). Each micro-batch's summed loss is
scaled by world / tokens, because every strategy averages gradients over ranks and sums
them over a step's micro-batches. So 2 ranks equal 1 rank with doubled accumulation, a
step's micro-batch size (`microBatchSize`) changes nothing but memory and speed, and
padding or uneven packing never reweights tokens.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune_trainer import (
    attention,
    checkpoint,
    fingerprints,
    flops,
    loss,
    model_card,
    network_preflight,
    tracking,
    trained_with,
)
from finetune_trainer.attention import sequence_bounds
from finetune_trainer.collectives import CollectiveLog, merge
from finetune_trainer.config import Hyperparameters, TrainerConfig
from finetune_trainer.data import (
    DataError,
    GlobalBatches,
    Prefetched,
    batch_larger_than_data,
    collate,
    read_split,
    resolve_format,
)
from finetune_trainer.export import export_trained
from finetune_trainer.fetch import name_hub_model
from finetune_trainer.gpu_memory import check_room
from finetune_trainer.layout import (
    FINAL_DIR,
    MERGED_DIR,
    STATE_FILE,
    checkpoint_root,
    resolve_output,
)
from finetune_trainer.loading import load_for
from finetune_trainer.metrics import TrainerMetrics, peak_memory_bytes
from finetune_trainer.model import (
    ModelError,
    compile_layers,
    inspect_architecture,
    load_tokenizer,
    model_location,
)
from finetune_trainer.objectives import spec_of
from finetune_trainer.objectives.base import Objective, RunContext
from finetune_trainer.optim import build_optimizer, build_scheduler
from finetune_trainer.parallel import build_strategy, init_distributed
from finetune_trainer.profiling import StepProfiler
from finetune_trainer.progress import ProgressServer, Reporter
from finetune_trainer.step_batch import StepBatch, StepWork
from finetune_trainer.tensorboard_log import tensorboard_tracker
from finetune_trainer.timing import StepPhases

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what Kubernetes and torchrun expect after SIGTERM
EXPORT_SHARD_SIZE = "1GB"


@dataclass
class Prepared:
    """Everything checked and built before a process group exists."""

    tokenizer: object
    train: list[dict[str, list[int]]]
    eval: list[dict[str, list[int]]]
    wrap_classes: list[str]
    objective: Objective
    """What the run trains towards (`spec.objective`): it prepared `train` and `eval`."""
    sources: str = ""
    """Where the training and eval splits come from (`data.read_split`), for the log."""
    notes: tuple[str, ...] = ()
    """What the log says of the data beyond that (preference pairs truncated)."""
    records: tuple[int, int] = (0, 0)
    """The training and eval records read, before `train` and `eval` made sequences of them
    (packed several to a sequence, or pairs and prompts laid out)."""


def counted(count: int, noun: str) -> str:
    """`1 sequence`, `2 sequences`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def preflight(config: TrainerConfig, base_dir: Path) -> Prepared:
    """Read and check the model and the data; bad input fails here, before any rank joins."""
    wrap_classes = inspect_architecture(config.model, config.method, base_dir)
    tokenizer = load_tokenizer(config.model, base_dir)
    data = config.dataset
    records, sources = read_split(data, base_dir)
    sources = f"training on {sources}"
    fmt = resolve_format(data.format, records.column_names)
    objective = spec_of(config.objective.type).objective(config)
    objective.base_dir = base_dir
    objective.check_format(fmt)
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ModelError(config.model.uri, "its tokenizer has no chat template, which turns "
                         "the data's conversations (format chat) into tokens",
                         "use a chat or instruct model, whose tokenizer has one, add a "
                         "chat_template.jinja to the model's folder, or lay the data out as "
                         "text or instruction records (spec.dataset.format)")
    eval_records = []
    if data.eval_split is not None:
        eval_records, eval_source = read_split(data, base_dir, evaluation=True)
        sources += f", evaluating on {eval_source}"
        eval_fmt = resolve_format(data.format, eval_records.column_names)
        if eval_fmt != fmt:
            raise DataError(data.uri, f"its {data.eval_split} split is laid out as "
                            f"{eval_fmt}, its {data.split} split as {fmt}",
                            "lay both splits out in one format (the same columns)")
    elif data.eval_fraction > 0:
        if len(records) < 2:
            raise DataError(data.uri, "has too few samples for an eval split",
                            "add data or set spec.dataset.evalFraction to 0")
        split = records.train_test_split(test_size=data.eval_fraction,
                                         seed=config.hyperparameters.seed)
        records, eval_records = split["train"], split["test"]
        sources += f", evaluating on {data.eval_fraction:g} of it held out (evalFraction)"
    prepared = objective.prepare(tokenizer, records, eval_records, fmt)
    return Prepared(tokenizer, prepared.train, prepared.eval, wrap_classes, objective, sources,
                    prepared.notes, (len(records), len(eval_records)))


class StopRequest:
    """SIGTERM (preemption, node drain, `kubectl delete`): finish the step, checkpoint, exit."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agree(self, group, writing: bool = False) -> _Agreement:
        """Start agreeing (all ranks, asynchronously) on whether any rank was told to
        stop, so every rank stops after the same step; and on whether every rank's
        background checkpoint write has ended (`writing`: this rank's has not)."""
        return _Agreement(self.requested, writing, group)


class _Agreement:
    def __init__(self, requested: bool, writing: bool, group) -> None:
        self.flags = torch.tensor([float(requested), float(writing)])
        self.work = dist.all_reduce(self.flags, group=group, async_op=True)
        self.written = False
        """After `wait`: no rank is still writing its part of a checkpoint."""

    def wait(self) -> bool:
        """Whether any rank was told to stop."""
        self.work.wait()
        stop, writing = self.flags.tolist()
        self.written = writing == 0
        return stop > 0


def _all_ranks_sum(values: list[float], group) -> list[float]:
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
        self.attended = 0.0
        self.full_rows = 0.0

    def add(self, work: StepWork) -> None:
        self.steps += 1
        self.inputs += work.inputs
        self.sequences += work.sequences
        self.attended += work.attended
        self.full_rows += work.full_rows

    def seconds(self) -> float:
        return time.perf_counter() - self.started


def model_work(model, reference_each_batch: bool) -> flops.ModelWork:
    """The model's FLOPs per token and per attended pair (`reference_each_batch`: a
    reference runs forward on every batch too, DPO's base with its adapters off)."""
    params, frozen, layers, width = flops.model_shape(model)
    return flops.ModelWork.of(params, frozen, layers, width,
                              reference_params=frozen if reference_each_batch else 0.0)


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
    if not torch.cuda.is_available():
        return None
    for name, value in network_preflight.flight_recorder_env(output_dir).items():
        os.environ.setdefault(name, value)
    (output_dir / network_preflight.FLIGHT_RECORDER_DIR).mkdir(parents=True, exist_ok=True)
    if not (config.preflight.enabled and config.preflight.require_infiniband):
        return None

    scratch = Path(tempfile.mkdtemp(prefix="nccl-log-"))
    os.environ.update(network_preflight.nccl_debug_env(scratch))
    return scratch


def export(strategy, tokenizer, config: TrainerConfig, output_dir: Path, base_dir: Path) -> Path:
    """The model a user hands to vLLM next: a peft adapter or full safetensors weights,
    and, with mergeAdapter, the base model with the adapter merged in."""
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


def describe_export(output_dir: Path, config: TrainerConfig) -> None:
    """final/ made to stand on its own, before a push (`output.export`) takes it along: the
    model card in place of peft's template (from the record `Reporter.conclude` wrote) and,
    for a model fetched from the hub, the hub's name in place of the local copy's path."""
    model_card.write(output_dir, config)
    name_hub_model(output_dir / FINAL_DIR, config)


def merge_adapter(config: TrainerConfig, adapter_dir: Path, out: Path, base_dir: Path) -> None:
    from peft import PeftModel  # an adapter's merge only: full jobs never import peft

    base = AutoModelForCausalLM.from_pretrained(model_location(config.model, base_dir),
                                                dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out)


def judged(state: checkpoint.TrainerState, loss: float, threshold: float
           ) -> checkpoint.TrainerState:
    """`state` with one more evaluation counted for early stopping: a new best where `loss`
    is more than `threshold` below the best so far (the first always is), else one more
    evaluation since the best."""
    if state.best_eval_loss is None or loss < state.best_eval_loss - threshold:
        return dataclasses.replace(state, best_eval_loss=loss, best_eval_step=state.step,
                                   evals_since_best=0)
    return dataclasses.replace(state, evals_since_best=state.evals_since_best + 1)


def stopped_early(state: checkpoint.TrainerState, hp: Hyperparameters) -> str | None:
    """Why training stops at `state` (`hyperparameters.earlyStoppingPatience` used up), or
    None."""
    patience = hp.early_stopping_patience
    if not patience or state.evals_since_best < patience:
        return None
    by = (f" by more than {hp.early_stopping_threshold:g}" if hp.early_stopping_threshold
          else "")
    count = state.evals_since_best
    evaluations = "1 evaluation" if count == 1 else f"{count} evaluations in a row"
    return (f"stopped early at step {state.step} of {state.total_steps}: {evaluations} did "
            f"not improve on the best eval loss, {state.best_eval_loss:.4f} at step "
            f"{state.best_eval_step}{by} (hyperparameters.earlyStoppingPatience: {patience}); "
            f"the export is of step {state.best_eval_step}, the best evaluation's")


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
    paired: bool = False
    """Preference pairs: each trained position's answer goes with the batch."""
    rows: int | None = None
    """With `width`: pad every micro-batch to this many rows. An epoch's last step holds
    fewer rows where the data does not divide into steps, and a compiled layer met with
    another batch size recompiled every layer for it and each grad mode, inside the timed
    steps (16 s of a 1B DPO run's 30 steps on an H100, 11-27); a padding row costs its
    width in compute once an epoch."""

    def tensors(self, sequences) -> dict:
        batch = collate(sequences, self.pad_id, self.width, paired=self.paired,
                        rows=self.rows)
        if self.paired:
            batch.update(loss.answer_targets(batch["labels"], batch["answers"]))
        elif self.head is not None:
            batch.update(loss.loss_targets(batch["labels"]))
        if self.bounds:
            batch["cu_seq_lens"] = sequence_bounds(batch["position_ids"])
        return batch


def _to(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def run(config: TrainerConfig, base_dir: Path) -> int:
    """Train to the last step (or to a SIGTERM); returns the process exit code."""
    return Trainer(config, base_dir).train()


class StepLogger:
    """The window since the last log step and what a log step reports of it: the loss over
    its label tokens, tokens/s and samples/s, MFU, the step-time split (data / compute /
    optimizer) and the collectives' exposed time. Every rank logs; rank 0's reporter
    writes the progress record."""

    def __init__(self, trainer: Trainer, work: flops.ModelWork, peak: float | None) -> None:
        device, world = trainer.device, trainer.world
        self.trainer, self.work, self.peak = trainer, work, peak
        instrumented = trainer.config.metrics.enabled
        self.phases = StepPhases(device) if instrumented else None
        self.collectives = CollectiveLog(device, world) if instrumented else None
        self.sampler = (trainer.strategy.time_collectives(self.collectives)
                        if instrumented and world > 1 else None)
        self.sampled: list = []  # ZeRO's timed steps since the last log step
        self.loss = torch.zeros((), device=device, dtype=torch.float64)
        self.units = 0
        """What the objective's loss is a mean over, since the last log step."""
        self.names = trainer.objective.metric_names
        self.sums = torch.zeros(len(self.names), device=device, dtype=torch.float64)
        """The objective's metric sums (`Objective.metric_names`) since the last log step."""
        self.window = LogWindow()

    def mark(self, begin: bool = False) -> None:
        if self.phases is not None:
            (self.phases.begin if begin else self.phases.mark)()

    def sampling(self, step: int) -> bool:
        """Whether this step's collectives are timed (ZeRO's engine: a sampled step)."""
        if self.sampler is not None and self.sampler.wants(step):
            self.sampler.begin()
            return True
        return False

    def step_done(self, sampled: bool, step: StepBatch) -> None:
        if sampled:
            self.sampled.append(self.sampler.end())
        if self.collectives is not None:
            self.collectives.step_boundary()
        self.units += step.units
        self.window.add(step.work)
        self.trainer.reporter.step_done(step.work.labels, step.work.inputs)
        self.trainer.metrics.tokens.inc(step.local_labels)
        self.trainer.metrics.samples.inc(step.local_samples)

    def log(self, grad_norm: Any) -> None:
        t = self.trainer
        state, metrics = t.state, t.metrics
        window_loss, *sums = _all_ranks_sum([float(self.loss), *self.sums.tolist()],
                                            t.control)
        per = max(self.units, 1)
        figures = t.objective.logged(sums, self.units)
        seconds, window = self.window.seconds(), self.window
        mfu = full_rows_mfu = None
        if self.peak and seconds > 0:
            per_second = seconds * self.peak * t.world
            mfu = self.work.flops(window.inputs, window.attended) / per_second
            full_rows_mfu = self.work.flops(window.inputs, window.full_rows) / per_second
        with t.checkpoints.writing_beside():  # a full volume: the checkpoint's doing
            record = t.reporter.report(state.step, state.step / t.batches.steps_per_epoch,
                                       window_loss / per,
                                       t.scheduler.get_last_lr()[0], mfu=mfu,
                                       mfu_full_rows=full_rows_mfu,
                                       peak_memory=peak_memory_bytes(t.device),
                                       grad_norm=_as_float(grad_norm),
                                       objective_metrics=figures)
        split = self.phases.drain() if self.phases is not None else {}
        if self.collectives is not None:
            timed = merge([self.collectives.drain(), *self.sampled])
            self.sampled.clear()
            metrics.collectives(timed, t.world)
            if timed.totals:
                split["collective_wait"] = timed.exposed_seconds / max(self.window.steps, 1)
        metrics.logged(record.step, t.steps, record.epoch, record.loss, record.learning_rate,
                       record.tokens_per_second, t.device, grad_norm=record.grad_norm,
                       samples_per_second=self.window.sequences / seconds if seconds else None,
                       mfu=mfu, phases=split, objective_metrics=figures)
        self.loss.zero_()
        self.sums.zero_()
        self.units = 0
        self.window = LogWindow()


class Trainer:
    """One training run, in torchtitan's shape: the constructor builds the components (the
    checked data, the process group, the model under its strategy, the optimizer and its
    schedule, the checkpointer, the metrics and progress reporting), `train_step` trains one
    global batch, `train` is the loop, `finish` evaluates and exports."""

    def __init__(self, config: TrainerConfig, base_dir: Path) -> None:
        self.config, self.base_dir, self.hp = config, base_dir, config.hyperparameters
        self.prepared = preflight(config, base_dir)
        self.objective = self.prepared.objective
        self.stop = StopRequest()
        self.checkpoint_written = False  # at the last step's end, on every rank
        self.output_dir = resolve_output(config.output.uri, base_dir)
        nccl_log = _network_env(config, self.output_dir)
        self.device = init_distributed()
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        if self.rank != 0:
            transformers.logging.set_verbosity_error()
        self.control = dist.new_group(backend="gloo")  # CPU-side agreement, no device sync
        check_room(self.device, self.rank, config.preflight.planned_peak_bytes)
        self.metrics = TrainerMetrics(config.job.name, config.job.namespace or "", self.rank,
                                      device=self.device)
        self.network = None
        if config.preflight.enabled and self.world > 1:
            self.network = check_network(config, self.device, self.output_dir, nccl_log,
                                         self.metrics)
        transformers.set_seed(self.hp.seed)
        self._build_model()
        self._build_schedule()
        self._resume()
        self.objective.attach(RunContext(
            self.strategy, self.head, self.collation, self.control, self.batches.micro_batch,
            self.output_dir, self.state.step, self.prepared.train + self.prepared.eval, _say,
            batches=self.batches, train=self.prepared.train, pin=self.device.type == "cuda"))
        if self.resumed_from is not None:
            self.objective.load_state_dict(checkpoint.objective_state(self.resumed_from))
        self.steps_ahead = self._data(self.batches.schedule(self.state.step))
        self.grad_norm: Any = None
        self.profiler = StepProfiler.from_environment(self.rank, self.device.type)

    def _build_model(self) -> None:
        """The model as its strategy reads it, what runs inside it (packed attention, the
        fused loss, compiled layers), wrapped and given its optimizer."""
        config, device, hp = self.config, self.device, self.hp
        strategy = build_strategy(config.strategy, hp, device, self.prepared.wrap_classes)
        # unset (the operator resolves both before a worker starts): checkpointing on
        checkpointing = config.strategy.gradient_checkpointing is not False
        # built empty under fsdp: rank 0 reads `weights` one at a time in setup (loading.py)
        model, weights = load_for(strategy, config.model, config.method,
                                  config.strategy.precision, checkpointing, self.base_dir,
                                  device=device,
                                  checkpoint_policy=config.strategy.gradient_checkpointing_policy)
        bounds = False  # packed attention: the samples' bounds go with every batch
        if config.strategy.packed_attention:
            why_not = attention.why_not(loss.base_causal_lm(model), device,
                                        config.strategy.precision)
            if why_not is None:
                attention.install(loss.base_causal_lm(model))
                bounds = True
            elif device.type == "cuda":
                _say(f"packed attention off: {why_not}; SDPA with a block-diagonal mask")
        if config.strategy.compile is True:
            layers = compile_layers(model, self.prepared.wrap_classes)
            _say(f"compiling {layers} decoder layers with torch.compile (the first steps are "
                 "slow)")
        self.head = None
        if config.strategy.fused_loss:
            if (why_not := loss.fusable(model)) is None:
                self.head = loss.install(model)
            else:
                _say(f"fused loss off: {why_not}; the logits are computed whole")
        fixed = config.strategy.compile is True and config.dataset.packing
        objective = self.objective
        self.collation = Collation(self.prepared.tokenizer.pad_token_id, self.head, bounds,
                                   width=objective.width if fixed else None,
                                   paired=objective.paired)
        peak = (flops.peak_flops(torch.cuda.get_device_name(device))
                if device.type == "cuda" else None)
        learning_rate = hp.resolved_learning_rate(config.method.type)
        strategy.setup(model, lambda m: build_optimizer(m, hp, learning_rate,
                                                        fused=strategy.fused_optimizer),
                       weights)
        self.strategy = strategy
        self.log = StepLogger(self, model_work(model, objective.reference_each_batch), peak)

    def _build_schedule(self) -> None:
        hp = self.hp
        micro_batch, passes = hp.micro_steps()
        if micro_batch * passes != hp.batch_size_per_device * hp.gradient_accumulation_steps:
            raise ValueError(
                f"hyperparameters.microBatchSize {micro_batch} does not divide "
                f"batchSizePerDevice x gradientAccumulationSteps "
                f"({hp.batch_size_per_device} x {hp.gradient_accumulation_steps})")
        self.batches = self.objective.batches(len(self.prepared.train), micro_batch, passes,
                                              self.world, hp.seed)
        if self.collation.width is not None:  # compiled on packed rows: one shape
            self.collation = dataclasses.replace(self.collation, rows=micro_batch)
        self.steps = total_steps(self.config, self.batches)
        self.scheduler = build_scheduler(self.strategy.base_optimizer, hp, self.steps)

    def _resume(self) -> None:
        """The checkpointer, the newest complete checkpoint loaded if there is one, and the
        progress reporting from there."""
        config, output_dir = self.config, self.output_dir
        self.state = checkpoint.TrainerState(step=0, epoch=0, step_in_epoch=0, tokens_seen=0,
                                             total_steps=self.steps)
        # the dataset's digest on rank 0 only, which alone writes the record
        content = (fingerprints.dataset(config.dataset, self.base_dir, output_dir)
                   if self.rank == 0 else None)
        self.checkpoints = checkpoint.Checkpointer(
            self.strategy, self.scheduler, output_dir, config.output.keep_last,
            trained_with.record(config, content), say=_say,
            observe=self.metrics.checkpoint_save.observe,
            behind=config.output.async_checkpoints, every=config.output.checkpoint_every_steps,
            objective_state=self.objective.state_dict)
        self.metrics.total_steps.set(self.steps)
        self.resumed_from = checkpoint.latest_checkpoint(output_dir)
        if (latest := self.resumed_from) is not None:
            started = time.perf_counter()
            self.state = checkpoint.load(self.strategy, self.scheduler, latest)
            self.metrics.resumed(time.perf_counter() - started)
            _say(f"resuming from {latest} (step {self.state.step}/{self.steps})")
            if self.rank == 0 and (changed := trained_with.changed_data(output_dir, config,
                                                                        content)):
                _say(f"the data changed since that checkpoint ({'; '.join(changed)}): "
                     "training on with the new data, as spec.output.resumeWithChangedData "
                     "allows")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # one port per process on a node
        server = (ProgressServer(config.metrics.port + local_rank, host=config.metrics.host,
                                 registry=self.metrics.registry,
                                 reuse_port=config.metrics.reuse_port)
                  if config.metrics.enabled else None)
        self.reporter = Reporter(output_dir, self.steps, self.state.step,
                                 enabled=self.rank == 0, server=server,
                                 trackers=self._trackers(output_dir) if self.rank == 0 else ())
        self.reporter.preflight = self.network.record() if self.network is not None else None

    def _trackers(self, output_dir: Path) -> tuple:
        """Where rank 0's records go beside progress.json: Azure ML's MLflow run when
        running there (Studio charts), TensorBoard event files unless turned off."""
        trackers = [tracking.from_environment()]
        if self.config.output.tensorboard:
            trackers.append(tensorboard_tracker(output_dir, self.state.step))
        return tuple(t for t in trackers if t is not None)

    def _data(self, schedule):
        """This rank's micro-batches of each step as the objective loads them (host tensors,
        pinned on a GPU host), a step ahead on a thread where the device computes
        asynchronously (`benchmark.prefetch`)."""
        prefetch = self.config.benchmark.prefetch
        train = self.prepared.train

        def load_step(key: tuple[int, int]):
            mine = self.batches.micro_batches(*key, self.rank)
            return mine, self.objective.load([[train[i] for i in indices] for indices in mine])

        if prefetch or (prefetch is None and self.device.type == "cuda"):
            return Prefetched(schedule, load_step)
        return ((key, load_step(key)) for key in schedule)

    def train_step(self) -> bool:
        """One global batch: this rank's micro-batches forward and backward, the optimizer
        and schedule step. True when any rank was told to stop (SIGTERM)."""
        log, strategy = self.log, self.strategy
        log.mark(begin=True)
        key, (mine, loaded) = next(self.steps_ahead)
        # overlaps the step; waited for at its end
        agreement = self.stop.agree(self.control, writing=self.checkpoints.writing())
        # every rank knows the whole global batch's units (label tokens, preference pairs,
        # completions), which the loss is a mean over
        work = self.objective.step_batch(key, mine, loaded)
        micro_batches = work.micro_batches
        scale = self.world / max(work.units, 1)
        log.mark()
        sampled = log.sampling(self.state.step + 1)
        for index, batch in enumerate(micro_batches):
            batch = _to(batch, self.device)
            with strategy.autocast():
                summed, sums = self.objective.summed(batch)
            if sums is not None:
                log.sums += sums
            strategy.backward(summed * scale, boundary=index == len(micro_batches) - 1)
            log.loss += summed.detach()
        log.mark()
        self.grad_norm = strategy.step()
        self.scheduler.step()
        log.mark()
        if self.profiler is not None:
            self.profiler.step()
        stopping = agreement.wait()
        self.checkpoint_written = agreement.written
        self.state = self._advanced(*key, work.work.labels)
        log.step_done(sampled, work)
        return stopping

    def _advanced(self, epoch: int, step_in_epoch: int, tokens: int) -> checkpoint.TrainerState:
        per_epoch = self.batches.steps_per_epoch
        return dataclasses.replace(
            self.state, step=self.state.step + 1,
            epoch=epoch + (step_in_epoch + 1) // per_epoch,
            step_in_epoch=(step_in_epoch + 1) % per_epoch,
            tokens_seen=self.state.tokens_seen + int(tokens), total_steps=self.steps)

    def train(self) -> int:
        """Train to the last step, or to a SIGTERM after a checkpoint; the exit code."""
        hp = self.hp
        _say(f"data: {self.prepared.sources}")
        for note in self.prepared.notes:
            _say(note)
        if (summary := self.objective.summary(self.prepared.train)) is not None:
            _say(summary)
        sequences, records = len(self.prepared.train), self.prepared.records[0]
        packed = f" (packed from {counted(records, 'record')})" if (
            self.config.dataset.packing and records and records != sequences) else ""
        _say(f"training {counted(sequences, 'sequence')}{packed} on {self.world} "
             f"{'process' if self.world == 1 else 'processes'} ({self.strategy.name}, "
             f"{self.config.strategy.precision}): {self.steps} "
             f"step{'s' if self.steps != 1 else ''} of "
             f"{self.batches.global_batch} sequences, each process's in "
             f"{self.batches.accumulation} pass{'es' if self.batches.accumulation > 1 else ''}"
             f" of {self.batches.micro_batch}")
        if self.prepared.eval:
            every = f"every {hp.eval_every_steps} steps and " if hp.eval_every_steps else ""
            # not `eval...`: the evaluations' own lines open so (`eval at step N: ...`)
            _say(f"held out: {counted(len(self.prepared.eval), 'sequence')}, evaluated "
                 f"{every}at the end")
        if short := batch_larger_than_data(self.batches, hp.batch_size_per_device,
                                           hp.gradient_accumulation_steps,
                                           self.config.dataset.packing):
            _say(short)
        self.strategy.model.train()
        if self.stop.agree(self.control).wait():  # told to stop while loading: nothing new
            step = self.state.step
            return self._stopped("stopped by SIGTERM before the first step; a restart resumes "
                                 f"from {'step ' + str(step) if step else 'the start'}")
        if (why := stopped_early(self.state, hp)) is not None:  # a rerun of such a run
            _say(f"{why}; not training further")
            return self.finish(stopped_early=why)
        while self.state.step < self.steps:
            stopping = self.train_step()
            step, last = self.state.step, self.state.step == self.steps
            logged = step % hp.log_every_steps == 0 or last or stopping
            if logged:
                self.log.log(self.grad_norm)
            early = None
            if hp.eval_every_steps and step % hp.eval_every_steps == 0 and not last:
                self.evaluate(f"eval at step {step}")
                early = stopped_early(self.state, hp)
            if early is not None and not stopping:  # this step ends the run, as the last
                _say(early)
                if not logged:
                    self.log.log(self.grad_norm)
                last = True
            if self.checkpoint_written:  # the one written behind: complete it, everywhere
                self.checkpoints.finish()
            best = self.state.best_eval_step == step  # the export may load it back
            self.checkpoints.maybe_save(self.state, last, stopping, best=best)
            if stopping:
                return self._stopped(f"stopped by SIGTERM after step {step}; a restart "
                                     "resumes from the checkpoint above")
            if early is not None:
                return self.finish(evaluated=True, stopped_early=early)
        return self.finish()

    def _load_best(self) -> float | None:
        """Under early stopping the export is of the best evaluation's weights, as
        transformers' load_best_model_at_end (which its EarlyStoppingCallback requires):
        loaded back from that step's checkpoint, which keepLast's pruning keeps. Their eval
        loss, where loaded. Collective; every rank sees the same checkpoints."""
        best, step = self.state.best_eval_step, self.state.step
        if not self.hp.early_stopping_patience or best is None or best == step:
            return None
        path = checkpoint_root(self.output_dir) / f"step-{best:08d}"
        if not (path / STATE_FILE).is_file():
            _say(f"the best evaluation's checkpoint {path} is gone: the export is of step "
                 f"{step}")
            return None
        self.strategy.load(path / checkpoint.MODEL_DIR)
        _say(f"the export is of step {best}, the best evaluation's (eval loss "
             f"{self.state.best_eval_loss:.4f}), loaded from {path}")
        return self.state.best_eval_loss

    def _stopped(self, why: str) -> int:
        _say(why)
        self.reporter.finish("Stopped")
        return EXIT_PREEMPTED

    def evaluate(self, said: str) -> float | None:
        """The objective's evaluation of the held-out data (where there is some): said,
        published, its loss counted for early stopping (`judged`, which every evaluation
        is, the last one's included) and returned (the same on every rank)."""
        evaluation = self.objective.evaluate(self.prepared.eval)
        if evaluation is None:
            return None
        _say(f"{said}: {evaluation.said()}")
        self.reporter.evaluated(self.state.step, evaluation.loss, evaluation.figures)
        self.metrics.evaluated(evaluation.figures)
        if evaluation.loss is not None and self.hp.early_stopping_patience:
            self.state = judged(self.state, evaluation.loss, self.hp.early_stopping_threshold)
        return evaluation.loss

    def finish(self, evaluated: bool = False, stopped_early: str | None = None) -> int:
        """After the last step (or the one that `stopped_early`, saying why): its checkpoint
        complete, the eval loss (unless `evaluated` at that step already), the export (of
        the best evaluation's weights under early stopping), then rank 0's pushes to
        `output.export`, their outcomes in the final record."""
        self.checkpoints.finish()  # the last checkpoint complete before anything can fail
        if self.profiler is not None:
            self.profiler.stop()
            if self.profiler.written is not None:
                _say(f"profile of steps written to {self.profiler.written.parent}")
        if not evaluated:
            self.evaluate("eval")
        exported_loss = self._load_best()
        final = export(self.strategy, self.prepared.tokenizer, self.config, self.output_dir,
                       self.base_dir)
        _say(f"exported {final}")
        dist.destroy_process_group()  # no rank waits on rank 0's pushes
        pushed = None
        if self.rank == 0:
            targets = self.config.output.export
            self.reporter.conclude(stopped_early, exported_loss, exporting=bool(targets))
            describe_export(self.output_dir, self.config)  # before a push takes final/
            if targets:

                pushed = export_trained(self.output_dir, targets,
                                        say=lambda text: print(text, flush=True))
        self.reporter.finish("Succeeded", stopped_early, eval_loss=exported_loss,
                             exports=pushed)
        return 0
