"""What the trainer's instrumentation costs: the same 2-process CPU run with metrics on
(Prometheus endpoint, step-phase marks, collective timing hooks) and off, alternated in
one script so machine noise hits both alike. Prints tokens/s of each and the ratio.

    .venv/bin/python benchmarks/metrics_overhead.py [--steps 120] [--repeats 3]

Writes benchmarks/metrics_overhead.json (ratio under `on_off_ratio`). The target is a
ratio of at least 0.98 (instrumentation within 2%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples/data/tiny-chat.jsonl"


def trainer_config(model: Path, output: Path, steps: int, metrics: bool, strategy: str,
                   port: int) -> dict:
    return {
        "job": {"name": f"overhead-{'on' if metrics else 'off'}", "namespace": "bench"},
        "model": {"uri": str(model)},
        "dataset": {"uri": str(DATA), "format": "chat", "maxSeqLength": 256, "packing": True},
        "method": {"type": "full"},
        "strategy": {"type": strategy, "precision": "fp32", "gradientCheckpointing": False},
        "hyperparameters": {"maxSteps": steps, "batchSizePerDevice": 4, "learningRate": 1e-4,
                            "logEverySteps": 10, "warmupRatio": 0.0},
        "output": {"uri": str(output), "checkpointEverySteps": 100000},
        "metrics": {"enabled": metrics, "port": port},
        "preflight": {"enabled": False},  # before step 0 either way; not what is compared
    }


def run_once(model: Path, work: Path, steps: int, metrics: bool, strategy: str) -> float:
    """Label tokens per second over the log windows after the first (warm-up)."""
    output = work / f"out-{'on' if metrics else 'off'}"
    config = work / f"config-{'on' if metrics else 'off'}.yaml"
    config.write_text(yaml.safe_dump(trainer_config(model, output, steps, metrics, strategy,
                                                    port=19108)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", "-m", "finetune_trainer", f"--config={config}"],
                   check=True, env=env, capture_output=True, text=True)
    records = [json.loads(line) for line in (output / "progress.jsonl").read_text().splitlines()]
    rates = [r["tokensPerSecond"] for r in records[1:]]
    for leftover in output.glob("**/*"):
        if leftover.is_file():
            leftover.unlink()
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp", "zero2"])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/metrics_overhead.json")
    args = parser.parse_args()

    from finetune_trainer.tiny import build_tiny_llama, corpus_from_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "model", corpus_from_jsonl(DATA), hidden_size=128,
                                 layers=4)
        on, off = [], []
        for repeat in range(args.repeats):
            # alternate the order so a slow spell of the machine does not favour one side
            for metrics in ((True, False) if repeat % 2 == 0 else (False, True)):
                rate = run_once(model, work, args.steps, metrics, args.strategy)
                (on if metrics else off).append(rate)
                print(f"repeat {repeat + 1}: metrics {'on ' if metrics else 'off'} "
                      f"{rate:,.0f} tokens/s", flush=True)
    ratio = statistics.median(on) / statistics.median(off)
    print(f"\n{args.strategy}, 2 CPU processes, {args.steps} steps x {args.repeats} repeats")
    print(f"  metrics on : {statistics.median(on):,.0f} tokens/s (median)")
    print(f"  metrics off: {statistics.median(off):,.0f} tokens/s (median)")
    print(f"  on/off ratio: {ratio:.3f}  (target >= 0.98)")
    args.out.write_text(json.dumps({
        "strategy": args.strategy, "steps": args.steps, "repeats": args.repeats,
        "tokens_per_second_on": on, "tokens_per_second_off": off,
        "on_off_ratio": round(ratio, 4)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
