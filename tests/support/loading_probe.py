"""The weights a sharded strategy ends up with, against a plain from_pretrained (#17).

Run under torchrun, one process per rank:
    python -m torch.distributed.run --standalone --nproc-per-node=2 \
        -m tests.support.loading_probe MODEL_DIR OUT.json --strategy fsdp --method lora

Loads and sets up the strategy as `train.run` does (FSDP and ZeRO-3: every rank builds the
model empty and rank 0 reads the weights one at a time, each rank keeping its shard or
partition), gathers every weight on rank 0 (`Strategy.full_state_dict`), and compares it
with what `load_model` reads in one process with the same seed: the same names, dtypes
and values, LoRA's adapters included; and the random generator of every rank where that
read left it. `--copied` makes rank 0 send from a from_pretrained copy, the path taken for
checkpoints transformers converts as it reads them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--method", default="full")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--copied", action="store_true")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import transformers

    from finetune_trainer import loading
    from finetune_trainer.config import (
        Hyperparameters,
        LoraConfig,
        MethodConfig,
        ModelSource,
        StrategyConfig,
    )
    from finetune_trainer.model import inspect_architecture, load_model
    from finetune_trainer.optim import build_optimizer
    from finetune_trainer.parallel import build_strategy, init_distributed

    if args.copied:
        loading._streamable = lambda *_: False
    opened = []  # what rank 0 sent from
    open_weights = loading.open_weights
    loading.open_weights = lambda *a, **k: opened.append(open_weights(*a, **k)) or opened[-1]
    source = ModelSource(uri=str(args.model_dir))
    method = MethodConfig(type=args.method, lora=None if args.method == "full" else LoraConfig(
        r=4, dropout=0.1))
    hp = Hyperparameters(max_steps=1)
    wrap = inspect_architecture(source, method)
    device = init_distributed()
    strategy = build_strategy(StrategyConfig(type=args.strategy, precision=args.precision), hp,
                              device, wrap)
    transformers.set_seed(0)
    model, weights = loading.load_for(strategy, source, method, args.precision, True,
                                      device=device)
    built = ("empty" if any(p.is_meta for p in model.parameters()) else "partitioned"
             if any(hasattr(p, "ds_id") for p in model.parameters()) else "whole")
    strategy.setup(model, lambda m: build_optimizer(m, hp, 1e-4,
                                                    fused=strategy.fused_optimizer), weights)
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, torch.get_rng_state())
    gathered = strategy.full_state_dict()
    if dist.get_rank() == 0:
        transformers.set_seed(0)
        plain = load_model(source, method, args.precision, True).state_dict()
        expected = torch.get_rng_state()
        args.out.write_text(json.dumps({
            "built": built, "sent_from": type(opened[0]).__name__ if opened else None,
            "missing": sorted(set(plain) - set(gathered)),
            "unexpected": sorted(set(gathered) - set(plain)),
            "different": sorted(k for k in set(plain) & set(gathered)
                                if plain[k].dtype != gathered[k].dtype
                                or not torch.equal(plain[k], gathered[k])),
            "weights": len(plain),
            "generators_as_read": [torch.equal(g, expected) for g in generators]}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown of deepspeed/gloo threads


if __name__ == "__main__":
    main()
