"""How long a checkpoint holds the training loop (#17): the same 2-process CPU run writing
its checkpoints in the background (`output.asyncCheckpoints: on`) and synchronously
(`off`), side by side in one script, alternated so machine noise hits both alike.

A full fine-tune of a 46M-parameter Llama (fp32: weights and Adam moments make a
checkpoint of about 550 MB) checkpointing every few steps. The loop's stall per
checkpoint is read from the trainer's own line for each one: synchronous, "written in X s
while training waited"; in the background, "staged in X s, ... training waited Y s more"
(X + Y: staging, plus any wait for the previous write at the next save or at the end).
The periodic checkpoints are the measure; the last one, at the end of training, has no
step left to hide its write behind, so both sides write it synchronously (it is counted in
the second figure). The run's wall time is printed beside it: on 2 cores the
background write competes with training for the CPU, so the end-to-end gain is smaller
than the stall's.

    .venv/bin/python benchmarks/checkpoint_stall.py                 # ddp, fsdp, zero3
    .venv/bin/python benchmarks/checkpoint_stall.py --strategies fsdp --repeats 1

Writes benchmarks/checkpoint_stall.json (per strategy, the sync/background ratio of the
loop's stall per periodic checkpoint under `stall_ratio`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples/data/tiny-chat.jsonl"
SYNC = re.compile(r"^checkpoint \S+: written in ([\d.]+) s while training waited", re.M)
BACKGROUND = re.compile(r"^checkpoint \S+: staged in ([\d.]+) s, written in ([\d.]+) s in the "
                        r"background(?:; training waited ([\d.]+) s more for it)?", re.M)


def trainer_config(model: Path, output: Path, strategy: str, background: bool, steps: int,
                   every: int) -> dict:
    return {
        "job": {"name": f"stall-{strategy}-{'on' if background else 'off'}",
                "namespace": "bench"},
        "model": {"uri": str(model)},
        "dataset": {"uri": str(DATA), "format": "chat", "maxSeqLength": 128, "packing": True},
        "method": {"type": "full"},
        "strategy": {"type": strategy, "precision": "fp32", "gradientCheckpointing": False},
        "hyperparameters": {"maxSteps": steps, "batchSizePerDevice": 2, "learningRate": 1e-4,
                            "logEverySteps": 1, "warmupRatio": 0.0},
        "output": {"uri": str(output), "checkpointEverySteps": every, "keepLast": 1,
                   "asyncCheckpoints": "on" if background else "off"},
        "metrics": {"enabled": False},
        "preflight": {"enabled": False},  # before step 0 either way; not what is compared
    }


def stalls(log: str) -> list[float]:
    """Seconds the loop was held by each checkpoint, in order, from the trainer's lines (the
    last one is synchronous on both sides)."""
    held = [(m.start(), float(m[1])) for m in SYNC.finditer(log)]
    held += [(m.start(), float(m[1]) + float(m[3] or 0)) for m in BACKGROUND.finditer(log)]
    return [seconds for _, seconds in sorted(held)]


def run_once(model: Path, work: Path, strategy: str, background: bool, steps: int,
             every: int) -> dict:
    side = "on" if background else "off"
    output = work / f"out-{strategy}-{side}"
    config = work / f"config-{strategy}-{side}.yaml"
    config.write_text(yaml.safe_dump(trainer_config(model, output, strategy, background, steps,
                                                    every)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", "-m", "finetune_trainer",
                             f"--config={config}"], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{strategy} asyncCheckpoints {side} failed:\n{log[-4000:]}")
    held = stalls(log)
    if len(held) != steps // every:
        raise RuntimeError(f"{strategy} asyncCheckpoints {side}: {len(held)} checkpoint lines, "
                           f"{steps // every} checkpoints expected:\n{log[-4000:]}")
    subprocess.run(["rm", "-rf", str(output)], check=True)
    return {"stalls": held, "stall_seconds": sum(held), "wall_seconds": round(wall, 2)}


def compare(model: Path, work: Path, strategy: str, steps: int, every: int,
            repeats: int) -> dict:
    runs: dict[str, list[dict]] = {"background": [], "sync": []}
    for repeat in range(repeats):
        # alternate the order so a slow spell of the machine does not favour one side
        for background in ((True, False) if repeat % 2 == 0 else (False, True)):
            found = run_once(model, work, strategy, background, steps, every)
            runs["background" if background else "sync"].append(found)
            print(f"{strategy} repeat {repeat + 1}: {'background' if background else 'sync':>10}"
                  f"  loop held {found['stall_seconds']:6.2f} s over {len(found['stalls'])} "
                  f"checkpoints, run {found['wall_seconds']:6.1f} s", flush=True)
    periodic = {side: statistics.median(statistics.mean(r["stalls"][:-1]) for r in found)
                for side, found in runs.items()}
    stall = {side: statistics.median(r["stall_seconds"] for r in found)
             for side, found in runs.items()}
    wall = {side: statistics.median(r["wall_seconds"] for r in found)
            for side, found in runs.items()}
    return {"strategy": strategy, "runs": runs,
            "stall_seconds_per_periodic_checkpoint": {side: round(periodic[side], 3)
                                                      for side in periodic},
            "stall_ratio": round(periodic["sync"] / periodic["background"], 2),
            "stall_seconds_with_last": stall,
            "stall_ratio_with_last": round(stall["sync"] / stall["background"], 2),
            "wall_seconds": wall, "wall_ratio": round(wall["sync"] / wall["background"], 3)}


SHAPE = dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, vocab=16000,
             bf16=False)
"""46M parameters: 185 MB of fp32 weights, about 550 MB a checkpoint with Adam's moments."""


def build_model(where: Path) -> Path:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import throughput  # a sibling script, not a package

    return throughput.build_model(where, throughput.Shape(**SHAPE), DATA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,fsdp,zero3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3, help="checkpointEverySteps")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/checkpoint_stall.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_model(work / "model")
        results = [compare(model, work, strategy, args.steps, args.every, args.repeats)
                   for strategy in args.strategies.split(",")]
    print(f"\n2 CPU processes, full fine-tune of 46M parameters, {args.steps} steps, a "
          f"checkpoint every {args.every}, median of {args.repeats}")
    print(f"{'':<6} {'loop held per checkpoint':>24} {'':>11} {'':>6} "
          f"{'held in all, last included':>27} {'':>7} {'run':>9}")
    print(f"{'':<6} {'sync':>24} {'background':>11} {'ratio':>6} {'sync':>9} "
          f"{'background':>11} {'ratio':>6} {'sync/background':>16}")
    for r in results:
        per, total = r["stall_seconds_per_periodic_checkpoint"], r["stall_seconds_with_last"]
        print(f"{r['strategy']:<6} {per['sync']:>22.2f} s {per['background']:>9.2f} s "
              f"{r['stall_ratio']:>5.1f}x {total['sync']:>7.2f} s {total['background']:>9.2f} s "
              f"{r['stall_ratio_with_last']:>5.1f}x {r['wall_ratio']:>15.2f}x")
    args.out.write_text(json.dumps({
        "machine": f"{os.uname().machine}, {os.cpu_count()} cores, CPU only",
        "steps": args.steps, "every": args.every, "repeats": args.repeats,
        "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
