"""How long `finetune run` takes to reach its first step and its end, beside torchrun
running the same trainer config alone (the floor: no command of ours around it), and
beside `finetune run` after the preflight process it ran before torchrun until 11-29 (a
process that imported the training stack and read the data once more than the workers
do). The sides alternate, round after round, so a busy machine slows all alike; each
figure is the median of the rounds, each ratio is to `finetune run`'s.

    .venv/bin/python benchmarks/startup.py [--rounds 3] [--out benchmarks/startup.json]
        [--sides "finetune run,torchrun alone"]

The job is the tiny model of the tests on 2 CPU processes, 6 steps: what a user meets
first, and where the start is most of the time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples/data/tiny-chat.jsonl"
SIDES = ("finetune run", "torchrun alone", "with the old preflight")
FIRST_STEP = "step 1/"


def manifest(model: Path, output: Path) -> dict:
    return {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": "startup"},
            "spec": {"model": {"uri": str(model)},
                     "dataset": {"uri": str(DATA), "format": "chat", "maxSeqLength": 96},
                     "method": {"type": "lora", "lora": {"r": 4, "alpha": 8}},
                     "hyperparameters": {"maxSteps": 6, "batchSizePerDevice": 2,
                                         "logEverySteps": 1},
                     "resources": {"gpusPerNode": 0, "processesPerNode": 2},
                     "output": {"uri": str(output)}}}


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Seconds to the first step's line, and to the end; the command must succeed."""
    started = time.perf_counter()
    first = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env) as child:
        lines = []
        for line in child.stdout:
            lines.append(line)
            if first is None and line.startswith(FIRST_STEP):
                first = time.perf_counter() - started
    ended = time.perf_counter() - started
    if child.returncode != 0 or first is None:
        raise SystemExit(f"{' '.join(command)} failed:\n{''.join(lines[-30:])}")
    return first, ended


def one_round(model: Path, work: Path, k: int, env: dict[str, str],
              sides: tuple[str, ...] = SIDES) -> dict[str, tuple]:
    finetune = [sys.executable, "-m", "finetune_operator.cli", "run"]
    figures = {}
    for side in sides:
        where = work / f"{k}-{side.replace(' ', '-')}"
        where.mkdir()
        job = where / "job.yaml"
        job.write_text(yaml.safe_dump(manifest(model, where / "out")))
        written = work / f"{k}-finetune-run/out/.finetune/trainer.yaml"
        if side == "torchrun alone":  # the trainer config `finetune run` wrote, run again
            # into a fresh output folder, as on the other sides
            text = written.read_text().replace(str(written.parents[1]), str(where / "out"))
            (where / "trainer.yaml").write_text(text)
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node=2", "-m", "finetune_trainer",
                       f"--config={where / 'trainer.yaml'}"]
            figures[side] = timed(command, {**env, "CUDA_VISIBLE_DEVICES": "",
                                            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        elif side == "with the old preflight":  # that step, then the run as it is now
            started = time.perf_counter()
            preflight = subprocess.run(
                [sys.executable, "-m", "finetune_trainer", "--config", str(written),
                 "--preflight"], capture_output=True, text=True,
                env={**env, "CUDA_VISIBLE_DEVICES": ""}, check=False)
            if preflight.returncode != 0:
                raise SystemExit(f"the preflight failed:\n{preflight.stdout}{preflight.stderr}")
            before = time.perf_counter() - started
            first, ended = timed([*finetune, str(job)], env)
            figures[side] = (before + first, before + ended)
        else:
            figures[side] = timed([*finetune, str(job)], env)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help="the sides to time, comma-separated; `finetune run` always "
                             "(the others run the trainer config it wrote)")
    args = parser.parse_args()
    asked = [side.strip() for side in args.sides.split(",") if side.strip()]
    if unknown := [side for side in asked if side not in SIDES]:
        parser.error(f"--sides: {', '.join(unknown)} is not one of: {', '.join(SIDES)}")
    sides = tuple(side for side in SIDES if side in asked or side == SIDES[0])
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="startup-") as scratch:
        work = Path(scratch)
        model = work / "model"
        subprocess.run([sys.executable, "-m", "finetune_trainer.tiny", str(model), "--corpus",
                        str(DATA)], check=True, env=env, stdout=subprocess.DEVNULL)
        rounds = [one_round(model, work, k, env, sides) for k in range(args.rounds)]
    result = {"rounds": args.rounds, "machine": f"{os.cpu_count()} cores", "sides": {}}
    ours = None
    print(f"{'side':<24} {'first step s':>13} {'done s':>8} {'ratio (done)':>13}")
    for side in sides:
        first = statistics.median(r[side][0] for r in rounds)
        done = statistics.median(r[side][1] for r in rounds)
        ours = ours or done
        result["sides"][side] = {"seconds_to_first_step": round(first, 2),
                                 "seconds_to_done": round(done, 2),
                                 "ratio_to_finetune_run": round(done / ours, 2)}
        print(f"{side:<24} {first:>13.2f} {done:>8.2f} {done / ours:>12.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
