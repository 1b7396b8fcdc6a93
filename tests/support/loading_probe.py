"""The weights a sharded strategy ends up with, against a plain from_pretrained (#17).

Run under torchrun, one process per rank, with one or more cases, each MODEL_DIR,STRATEGY,
METHOD then any of bf16 (the precision; fp32 otherwise) and copied:
    python -m torch.distributed.run --standalone --nproc-per-node=2 \
        -m tests.support.loading_probe OUT.json MODEL_DIR,fsdp,lora MODEL_DIR,zero3,full,copied

Each case loads and sets up the strategy as `train.run` does (FSDP and ZeRO-3: every rank
builds the model empty and rank 0 reads the weights one at a time, each rank keeping its
shard or partition), gathers every weight on rank 0 (`Strategy.full_state_dict`), and
compares it with what `load_model` reads in one process with the same seed: the same names,
dtypes and values, LoRA's adapters included; and the random generator of every rank where
that read left it. `copied` makes rank 0 send from a from_pretrained copy, the path taken for
checkpoints transformers converts as it reads them. OUT.json maps each case to its findings.

The cases run one after another in the same two processes, each from its own seed with its
own model and strategy: starting the processes and importing torch, transformers and
DeepSpeed cost several times what a case does, once for all of them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def probe(case: str, device) -> dict | None:
    """One case's findings (rank 0; None on the others)."""
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
    from finetune_trainer.parallel import build_strategy

    model_dir, strategy_type, method_type, *options = case.split(",")
    unknown = set(options) - {"bf16", "copied"}
    assert not unknown, f"{case}: unknown options {sorted(unknown)}"
    precision = "bf16" if "bf16" in options else "fp32"
    opened = []  # what rank 0 sent from
    open_weights, streamable = loading.open_weights, loading._streamable
    loading.open_weights = lambda *a, **k: opened.append(open_weights(*a, **k)) or opened[-1]
    if "copied" in options:
        loading._streamable = lambda *_: False
    try:
        source = ModelSource(uri=model_dir)
        method = MethodConfig(type=method_type, lora=None if method_type == "full" else
                              LoraConfig(r=4, dropout=0.1))
        hp = Hyperparameters(max_steps=1)
        wrap = inspect_architecture(source, method)
        strategy = build_strategy(StrategyConfig(type=strategy_type, precision=precision), hp,
                                  device, wrap)
        transformers.set_seed(0)
        model, weights = loading.load_for(strategy, source, method, precision, True,
                                          device=device)
        built = ("empty" if any(p.is_meta for p in model.parameters()) else "partitioned"
                 if any(hasattr(p, "ds_id") for p in model.parameters()) else "whole")
        strategy.setup(model, lambda m: build_optimizer(m, hp, 1e-4,
                                                        fused=strategy.fused_optimizer),
                       weights)
        generators = [None] * dist.get_world_size()
        dist.all_gather_object(generators, torch.get_rng_state())
        gathered = strategy.full_state_dict()
        found = None
        if dist.get_rank() == 0:
            transformers.set_seed(0)
            plain = load_model(source, method, precision, True).state_dict()
            expected = torch.get_rng_state()
            found = {
                "built": built, "sent_from": type(opened[0]).__name__ if opened else None,
                "missing": sorted(set(plain) - set(gathered)),
                "unexpected": sorted(set(gathered) - set(plain)),
                "different": sorted(k for k in set(plain) & set(gathered)
                                    if plain[k].dtype != gathered[k].dtype
                                    or not torch.equal(plain[k], gathered[k])),
                "weights": len(plain),
                "generators_as_read": [torch.equal(g, expected) for g in generators]}
        dist.barrier()
        return found
    finally:
        loading.open_weights, loading._streamable = open_weights, streamable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", nargs="+", help="MODEL_DIR,STRATEGY,METHOD[,bf16][,copied]")
    args = parser.parse_args()

    import torch.distributed as dist

    from finetune_trainer.parallel import init_distributed

    device = init_distributed()
    findings = {case: probe(case, device) for case in args.cases}
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(findings))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown of deepspeed/gloo threads


if __name__ == "__main__":
    main()
