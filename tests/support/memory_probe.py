"""Measure the peak memory of training steps on CPU workers, through the trainer's own
code (model loading, strategies, loss), for comparing with the planner's estimate.

Run under torchrun, one process per rank:
    python -m torch.distributed.run --standalone --nproc-per-node=2 \
        -m tests.support.memory_probe MODEL_DIR OUT.json --method full --strategy ddp

How it measures: torch's CPU allocator keeps no statistics, so the probe reads the
kernel's peak resident set size (VmHWM in /proc/self/status). The caller sets
MALLOC_MMAP_THRESHOLD_=65536 so glibc serves every tensor from its own mmap and returns
it on free, making resident memory track live tensors. VmHWM is reset (write 5 to
/proc/self/clear_refs) after the first step, so one-time allocations (kernel caches,
gloo buffers) are left out; the resident memory before the model was loaded is
subtracted. What remains is weights, gradients, optimizer states, activations and
temporaries of steps 2-3, which is what the planner predicts (without a CUDA context).
The weights the rank holds once the strategy is set up (its shards: bytes and elements)
are reported too, beside the planner's `weights` line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _local_weights(model) -> tuple[int, int]:
    """Bytes and elements of the weights this rank holds, as the planner's `weights` line
    counts them: its shard under FSDP (a DTensor's local part) and ZeRO-3 (`ds_tensor`),
    the whole parameter otherwise (the ZeRO-1/2 module; their fp32 master copy is an
    optimizer state)."""
    size = elements = 0
    for parameter in model.parameters():
        local = getattr(parameter, "ds_tensor", None)
        if local is None:
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        size += local.numel() * local.element_size()
        elements += local.numel()
    return size, elements


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--method", default="full")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--checkpointing", choices=["off", "full", "selective"], default="off")
    parser.add_argument("--fused-loss", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from finetune_trainer import loss as fused
    from finetune_trainer.config import (
        Hyperparameters,
        LoraConfig,
        MethodConfig,
        ModelSource,
        StrategyConfig,
    )
    from finetune_trainer.loading import load_for
    from finetune_trainer.model import inspect_architecture
    from finetune_trainer.optim import build_optimizer
    from finetune_trainer.parallel import build_strategy, init_distributed

    torch.manual_seed(0)
    source = ModelSource(uri=str(args.model_dir))
    method = MethodConfig(type=args.method, lora=None if args.method == "full" else LoraConfig())
    strategy_config = StrategyConfig(type=args.strategy, precision=args.precision,
                                     gradient_checkpointing=args.checkpointing != "off")
    hp = Hyperparameters(max_steps=args.steps, batch_size_per_device=args.micro_batch)
    wrap = inspect_architecture(source, method)
    device = init_distributed()
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len))
    batch = {"input_ids": ids, "labels": ids.clone(),
             "position_ids": torch.arange(args.seq_len).expand(args.micro_batch, -1)}
    strategy = build_strategy(strategy_config, hp, device, wrap)
    if strategy.name != "ddp":
        import deepspeed  # noqa: F401  (imported before the baseline: its import is large)
    dist.barrier()
    baseline = _status("VmRSS")
    model, sent = load_for(strategy, source, method, args.precision,
                           args.checkpointing != "off",
                           checkpoint_policy="selective" if args.checkpointing == "selective"
                           else "full")
    head = fused.install(model) if args.fused_loss else None
    if head is not None:
        batch.update(fused.loss_targets(batch["labels"]))
    strategy.setup(model, lambda m: build_optimizer(m, hp, 1e-4), sent)
    strategy.model.train()
    weights, weight_elements = _local_weights(strategy.model)
    peaks = []
    for step in range(args.steps):
        if step == 1:
            _reset_peak()
        with strategy.autocast():
            loss = fused.summed_loss(strategy.model, batch, head)
        strategy.backward(loss / (args.micro_batch * args.seq_len), boundary=True)
        strategy.step()
        if step >= 1:
            peaks.append(_status("VmHWM") - baseline)
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(),
              "peak_bytes": max(peaks), "baseline_bytes": baseline, "weight_bytes": weights,
              "weight_elements": weight_elements,
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown of deepspeed/gloo threads


if __name__ == "__main__":
    main()
