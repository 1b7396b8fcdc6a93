"""Each speed-up of the trainer on and off, side by side: does it pay?

One configuration per change; our trainer runs with the change and without it,
alternating, on the same model and data (benchmarks/throughput.py builds them). Prints
tokens/s and peak memory of both sides and their ratios (median of back-to-back pairs)
and writes benchmarks/changes.json.

    .venv/bin/python benchmarks/changes.py                  # every CPU change (~15 min)
    .venv/bin/python benchmarks/changes.py --only fused-loss,prefetch
    .venv/bin/python benchmarks/changes.py --only dpo-precomputed-reference \
        --out benchmarks/changes-dpo.json
    .venv/bin/python benchmarks/changes.py --suite gpu      # 1B full on one GPU (~8 min)
    .venv/bin/python benchmarks/changes.py --suite gpu --only gpu-micro-batch
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # a sibling script, not a package
from throughput import LLAMA_1B, SUITES, TINY, Bench


@dataclass(frozen=True)
class Change:
    name: str
    bench: Bench
    on: dict
    off: dict
    why: str
    env_on: dict | None = None
    env_off: dict | None = None
    """Environment of each side (FINETUNE_QLORA_UPCAST: a switch read where no config
    reaches)."""


CPU_BASE = Bench("change", TINY, "full", "variable", seq_len=512, batch=4, steps=21,
                 processes=2)
CHANGES = [
    Change("fused-loss", replace(CPU_BASE, shape=replace(TINY, vocab=32000)),
           on={"strategy": {"fusedLoss": True}}, off={"strategy": {"fusedLoss": False}},
           why="output layer + cross-entropy in chunks over trained tokens (32k vocabulary)"),
    Change("selective-checkpointing", replace(CPU_BASE, checkpointing=True),
           on={"strategy": {"gradientCheckpointingPolicy": "selective"}},
           off={"strategy": {"gradientCheckpointingPolicy": "full"}},
           why="keep matmul outputs, recompute element-wise ops (vs whole layers)"),
    Change("packing", CPU_BASE, on={"dataset": {"packing": True}},
           off={"dataset": {"packing": False}},
           why="several samples per sequence on variable-length data (vs padding)"),
    Change("best-fit-packing", CPU_BASE, on={"benchmark": {"packer": "best-fit"}},
           off={"benchmark": {"packer": "next-fit"}},
           why="samples packed best-fit decreasing (vs consecutive samples, next-fit)"),
    Change("compile", replace(CPU_BASE, steps=30), on={"strategy": {"compile": True}},
           off={"strategy": {"compile": False}},
           why="torch.compile per decoder layer (after a warm-up that compiles)"),
    Change("prefetch", CPU_BASE, on={"benchmark": {"prefetch": True}},
           off={"benchmark": {"prefetch": False}},
           why="next steps' batches collated on a thread during this step (vs in the loop)"),
    # the pass before step 1 is outside the timed steps: `reference log-probabilities of N
    # preference pairs taken in S s` in the run's log says what it cost
    Change("dpo-precomputed-reference",
           replace(SUITES["cpu-dpo"].benches[0], name="change", steps=21),
           on={"objective": {"dpo": {"precomputeRefLogProbs": True}}},
           off={"objective": {"dpo": {"precomputeRefLogProbs": False}}},
           why="LoRA DPO: the base's log-probabilities taken once, before step 1 (vs a "
           "forward of the base beside the policy at every batch)"),
]

GPU_BASE = replace(next(b for b in SUITES["gpu"].benches if b.name == "gpu-1b-full"),
                   name="change", checkpointing=False)
GPU_CHANGES = [
    Change("gpu-no-checkpointing", GPU_BASE, on={"strategy": {"gradientCheckpointing": False}},
           off={"strategy": {"gradientCheckpointing": True}},
           why="1B full: activations kept (vs whole decoder layers recomputed)"),
    Change("gpu-selective-checkpointing", GPU_BASE,
           on={"strategy": {"gradientCheckpointing": True,
                            "gradientCheckpointingPolicy": "selective"}},
           off={"strategy": {"gradientCheckpointing": True,
                             "gradientCheckpointingPolicy": "full"}},
           why="1B full: matmul outputs kept, element-wise ops recomputed (vs whole layers)"),
    Change("gpu-compile", replace(GPU_BASE, steps=40, warmup=10),
           on={"strategy": {"compile": True}}, off={"strategy": {"compile": False}},
           why="1B full, no checkpointing: torch.compile per decoder layer"),
    Change("gpu-fsdp-one-gpu", GPU_BASE, on={"strategy": {"type": "fsdp"}},
           off={"strategy": {"type": "ddp"}},
           why="1B full on one GPU: FSDP2's bf16 parameters (vs fp32 weights under autocast)"),
]
GPU_QLORA = replace(next(b for b in SUITES["gpu"].benches if b.name == "gpu-1b-qlora"),
                    name="change-qlora", checkpointing=False, compile=False)
GPU_CHANGES += [
    Change("gpu-packed-attention", GPU_BASE, on={"strategy": {"packedAttention": True}},
           off={"strategy": {"packedAttention": False}},
           why="1B full: flash varlen over each packed sample (vs SDPA with a block mask)"),
    Change("gpu-qlora-compile", replace(GPU_QLORA, steps=40, warmup=10),
           on={"strategy": {"compile": True}}, off={"strategy": {"compile": False}},
           why="1B QLoRA: torch.compile per decoder layer around the 4-bit matmuls"),
    Change("gpu-micro-batch", replace(GPU_BASE, batch=8),
           on={"strategy": {"gradientCheckpointing": False},
               "hyperparameters": {"microBatchSize": 4}},
           off={"strategy": {"gradientCheckpointing": True},
                "hyperparameters": {"microBatchSize": 8}},
           why="1B full, 8 x 4096 tokens a step: 2 passes of 4 kept whole (the planner's "
               "choice) vs 1 pass of 8 with whole layers recomputed"),
    Change("gpu-compiled-fsdp-vs-zero2", replace(GPU_BASE, steps=40, warmup=10),
           on={"strategy": {"type": "fsdp", "compile": True}},
           off={"strategy": {"type": "zero2", "compile": False}},
           why="1B full: compiled FSDP2 vs DeepSpeed ZeRO-2's engine (not compiled), the "
               "choice strategy auto makes by counting compile as 1.2x (one GPU: the "
               "engines and compile, not the sharding)"),
    Change("gpu-qlora-bf16-norms", GPU_QLORA, on={}, off={},
           env_on={"FINETUNE_QLORA_UPCAST": "0"}, env_off={"FINETUNE_QLORA_UPCAST": "1"},
           why="1B QLoRA: norms and embeddings kept in bf16 (vs peft's upcast to fp32)"),
]
assert LLAMA_1B is GPU_BASE.shape


def merged(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def measure(change: Change, work: Path, repeats: int) -> dict:
    bench = change.bench
    data = work / f"{change.name}.jsonl"
    throughput.write_data(data, bench)
    model = work / throughput.model_name(bench.shape)
    if not model.exists():
        throughput.build_model(model, bench.shape, data)
    output = work / f"out-{change.name}"
    base = throughput.trainer_config(bench, model, data, output)
    configs = {}
    for side in ("on", "off"):
        configs[side] = work / f"{change.name}-{side}.yaml"
        configs[side].write_text(yaml.safe_dump(merged(base, getattr(change, side))))
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for repeat in range(repeats):
        for side in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
            shutil.rmtree(output, ignore_errors=True)
            env = (change.env_off if side == "off" else change.env_on) or {}
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)
            try:
                runs[side].append(throughput.run_ours(bench, configs[side], output))
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
    pairs = sorted(on["tokens_per_second"] / off["tokens_per_second"]
                   for on, off in zip(runs["on"], runs["off"], strict=True))
    memory = sorted(on["peak_memory_bytes"] / off["peak_memory_bytes"]
                    for on, off in zip(runs["on"], runs["off"], strict=True))
    return {"change": change.name, "why": change.why, "config": asdict(bench),
            "on": throughput.median_run(runs["on"]), "off": throughput.median_run(runs["off"]),
            "tokens_per_second_ratio": pairs[len(pairs) // 2],
            "tokens_per_second_pair_ratios": [round(r, 3) for r in pairs],
            "peak_memory_ratio": memory[len(memory) // 2]}


def table(rows: list[dict]) -> str:
    lines = [f"{'change':<24} {'tokens/s on':>12} {'off':>10} {'ratio':>7} "
             f"{'peak MiB on':>12} {'off':>8} {'ratio':>7}"]
    for row in rows:
        on, off = row["on"], row["off"]
        lines.append(f"{row['change']:<24} {on['tokens_per_second']:>12,.0f} "
                     f"{off['tokens_per_second']:>10,.0f} {row['tokens_per_second_ratio']:>6.2f}x "
                     f"{on['peak_memory_bytes'] / 2**20:>12,.0f} "
                     f"{off['peak_memory_bytes'] / 2**20:>8,.0f} {row['peak_memory_ratio']:>6.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--only", default=None, help="changes by name, comma-separated")
    parser.add_argument("--repeats", type=int, default=None,
                        help="pairs of runs (default: 3 on CPU, 1 on a GPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/changes.json, or changes-gpu.json")
    args = parser.parse_args()
    every = CHANGES + GPU_CHANGES
    suite = GPU_CHANGES if args.suite == "gpu" else CHANGES
    wanted = set(args.only.split(",")) if args.only else {c.name for c in suite}
    changes = [c for c in every if c.name in wanted]
    if not changes:
        parser.error(f"--only {args.only}: one of {', '.join(c.name for c in every)}")
    gpu = any(c.bench.gpu for c in changes)
    repeats = args.repeats or (1 if gpu else 3)
    out = args.out or throughput.REPO / f"benchmarks/changes{'-gpu' if gpu else ''}.json"
    rows = []
    with tempfile.TemporaryDirectory(prefix="finetune-changes-") as tmp:
        for change in changes:
            print(f"running {change.name} on/off ...", flush=True)
            rows.append(measure(change, Path(tmp), repeats))
            print(table(rows[-1:]), flush=True)
            throughput.write_results(out, rows)  # after each: a run cut short keeps them
    print(f"\n{throughput.machine()}\n{table(rows)}")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
