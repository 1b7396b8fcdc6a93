"""The training loop. Components live in sibling modules; this file puts them in order.

Loss normalisation: a step's loss is the sum of token cross-entropies over every label
token of the global batch, divided by that token count (known before the forward pass,
summed over ranks on a CPU group, no device sync). Each micro-batch's summed loss is
scaled by world x accumulation / tokens, because every strategy averages gradients over
ranks and divides by the accumulation steps. So 2 ranks equal 1 rank with doubled
accumulation, and padding or uneven packing never reweights tokens.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from finetune_trainer import checkpoint, tracking
from finetune_trainer.config import TrainerConfig
from finetune_trainer.data import (
    IGNORE,
    DataError,
    GlobalBatches,
    collate,
    one_per_sequence,
    pack,
    read_records,
    resolve_format,
    tokenize_records,
)
from finetune_trainer.metrics import TrainerMetrics
from finetune_trainer.model import inspect_architecture, load_model, load_tokenizer
from finetune_trainer.progress import ProgressServer, Reporter

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what Kubernetes and torchrun expect after SIGTERM
FINAL_DIR = "final"
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
    arrange = (lambda s: pack(s, data.max_seq_length)) if data.packing else one_per_sequence
    return Prepared(tokenizer, arrange(train), arrange(evaluation), wrap_classes)


class StopRequest:
    """SIGTERM (preemption, node drain, `kubectl delete`): finish the step, checkpoint, exit."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True


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


def _summed_loss(model, batch):
    import torch

    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
        ignore_index=IGNORE, reduction="sum")


def evaluate(strategy, sequences, micro_batch: int, pad_id: int, group) -> float | None:
    """Mean token loss over the eval split; every rank runs the same number of batches."""
    import torch
    import torch.distributed as dist

    if not sequences:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    strategy.model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(sequences), micro_batch * world):
            mine = sequences[start + rank * micro_batch: start + (rank + 1) * micro_batch]
            batch = _to(collate(mine, pad_id), strategy.device)
            with strategy.autocast():
                total += float(_summed_loss(strategy.model, batch))
            tokens += _label_tokens(batch)
    strategy.model.train()
    total, tokens = _all_ranks_sum([total, tokens], group)
    return total / max(tokens, 1)


def export(strategy, tokenizer, config: TrainerConfig, output_dir: Path, base_dir: Path) -> Path:
    """The model a user hands to vLLM next: a peft adapter or full safetensors weights,
    and, with mergeAdapter, the base model with the adapter merged in."""
    import torch.distributed as dist

    final = output_dir / FINAL_DIR
    state_dict = strategy.full_state_dict()  # collective under fsdp / zero3
    if dist.get_rank() == 0:
        strategy.unwrapped().save_pretrained(final, state_dict=state_dict,
                                             safe_serialization=True)
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

    from finetune_trainer.optim import build_optimizer, build_scheduler
    from finetune_trainer.parallel import build_strategy, init_distributed

    hp, method = config.hyperparameters, config.method
    prepared = preflight(config, base_dir)
    stop = StopRequest()
    device = init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank != 0:
        transformers.logging.set_verbosity_error()
    control = dist.new_group(backend="gloo")  # CPU-side agreement, no device sync
    transformers.set_seed(hp.seed)
    output_dir = resolve_path(config.output.uri, base_dir)
    pad_id = prepared.tokenizer.pad_token_id

    strategy = build_strategy(config.strategy, hp, device, prepared.wrap_classes)
    model = load_model(config.model, method, config.strategy.precision,
                       config.strategy.gradient_checkpointing, base_dir,
                       sharded=strategy.name != "ddp")
    learning_rate = hp.resolved_learning_rate(method.type)
    strategy.setup(model, lambda m: build_optimizer(m, hp, learning_rate))
    batches = GlobalBatches(len(prepared.train), hp.batch_size_per_device,
                            hp.gradient_accumulation_steps, world, hp.seed)
    steps = total_steps(config, batches)
    scheduler = build_scheduler(strategy.base_optimizer, hp, steps)

    state = checkpoint.TrainerState(step=0, epoch=0, step_in_epoch=0, tokens_seen=0,
                                    total_steps=steps)
    metrics = TrainerMetrics(config.job.name, config.job.namespace or "", rank)
    metrics.total_steps.set(steps)
    if (latest := checkpoint.latest_checkpoint(output_dir)) is not None:
        started = time.perf_counter()
        state = checkpoint.load(strategy, scheduler, latest)
        metrics.checkpoint_load.set(time.perf_counter() - started)
        _say(f"resuming from {latest} (step {state.step}/{steps})")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # one port per process on a node
    server = (ProgressServer(config.metrics.port + local_rank, registry=metrics.registry)
              if config.metrics.enabled else None)
    tracker = tracking.from_environment() if rank == 0 else None  # Azure ML Studio charts
    reporter = Reporter(output_dir, steps, state.step, enabled=rank == 0, server=server,
                        tracker=tracker)
    _say(f"training {len(prepared.train)} sequences on {world} "
         f"{'process' if world == 1 else 'processes'} ({strategy.name}, "
         f"{config.strategy.precision}): {steps} steps of {batches.global_batch} sequences")

    schedule = batches.schedule(state.step)
    loss_window = torch.zeros((), device=device, dtype=torch.float64)
    tokens_window = 0
    strategy.model.train()
    while state.step < steps:
        epoch, step_in_epoch = next(schedule)
        micro_batches = [collate([prepared.train[i] for i in indices], pad_id)
                         for indices in batches.micro_batches(epoch, step_in_epoch, rank)]
        local_tokens = sum(_label_tokens(b) for b in micro_batches)
        step_tokens, stopping = _all_ranks_sum([local_tokens, float(stop.requested)], control)
        scale = world / max(step_tokens, 1)
        for index, batch in enumerate(micro_batches):
            with strategy.autocast():
                loss = _summed_loss(strategy.model, _to(batch, device))
            strategy.backward(loss * scale, boundary=index == len(micro_batches) - 1)
            loss_window += loss.detach()
        strategy.step()
        scheduler.step()
        state = checkpoint.TrainerState(
            step=state.step + 1, epoch=epoch + (step_in_epoch + 1) // batches.steps_per_epoch,
            step_in_epoch=(step_in_epoch + 1) % batches.steps_per_epoch,
            tokens_seen=state.tokens_seen + int(step_tokens), total_steps=steps)
        tokens_window += int(step_tokens)
        reporter.step_done(int(step_tokens))
        metrics.tokens.inc(local_tokens)

        done = state.step == steps
        if state.step % hp.log_every_steps == 0 or done or stopping:
            window_loss = _all_ranks_sum([float(loss_window)], control)[0]
            record = reporter.report(state.step, state.step / batches.steps_per_epoch,
                                     window_loss / max(tokens_window, 1),
                                     scheduler.get_last_lr()[0])
            metrics.logged(record.step, steps, record.epoch, record.loss, record.learningRate,
                           record.tokensPerSecond, device)
            loss_window.zero_()
            tokens_window = 0
        if hp.eval_every_steps and state.step % hp.eval_every_steps == 0 and not done:
            eval_loss = evaluate(strategy, prepared.eval, hp.batch_size_per_device, pad_id,
                                 control)
            _say(f"eval at step {state.step}: loss {eval_loss:.4f}")
        every = config.output.checkpoint_every_steps
        if done or stopping or (every and state.step % every == 0):
            started = time.perf_counter()
            where = checkpoint.save(strategy, scheduler, state, output_dir,
                                    config.output.keep_last)
            metrics.checkpoint_save.observe(time.perf_counter() - started)
            _say(f"checkpoint {where}")
        if stopping:
            _say(f"stopped by SIGTERM after step {state.step}; a restart resumes from the "
                 "checkpoint above")
            reporter.finish("Stopped")
            return EXIT_PREEMPTED

    eval_loss = evaluate(strategy, prepared.eval, hp.batch_size_per_device, pad_id, control)
    if eval_loss is not None:
        _say(f"eval loss {eval_loss:.4f}")
    final = export(strategy, prepared.tokenizer, config, output_dir, base_dir)
    reporter.finish("Succeeded")
    _say(f"exported {final}")
    dist.destroy_process_group()
    return 0
