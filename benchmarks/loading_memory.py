"""Host memory while the model loads (#17): the peak summed over one node's ranks, beside
one copy of the weights.

A Llama of 123M parameters, built from a config and saved with save_pretrained in bf16
(as the hub ships models), is loaded by 2 CPU ranks over gloo exactly as `train.run` loads
it (`load_model`, rank 0's `open_weights` for a model built empty, the strategy's
`setup`); the full fine-tune and LoRA run in fp32, so one copy of the weights is 494 MB.
Each rank samples its resident set every millisecond from just before loading until the
strategy is set up; a figure is the largest sum over the ranks at one moment, less what
they held before (libraries, the process group): what the node's memory holds for the
model on top of the processes themselves. Two moments: until `load_model` returned (ZeRO-3
has its weights in place then), and until the strategy was set up (FSDP fills its shards
there; DeepSpeed's engine adds its fp32 master partition and gradient buffers, training
state the planner counts as such). The kernel's own peaks (VmHWM) are summed beside them:
an upper bound, since the ranks need not peak at the same moment.

glibc serves every tensor from its own mmap and returns it on free
(MALLOC_MMAP_THRESHOLD_=65536, as tests/support/memory_probe.py does): a large model's
tensors are past glibc's largest threshold anyway, and the small ones here would otherwise
stay in its heap after they are freed, counting what is no longer held.

    .venv/bin/python benchmarks/loading_memory.py                  # this tree's trainer
    .venv/bin/python benchmarks/loading_memory.py --rev 40a3546    # a commit's (before #17)
    .venv/bin/python benchmarks/loading_memory.py --only fsdp-full,zero3-full
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORLD = 2
MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Case:
    name: str
    strategy: str
    method: str


CASES = (Case("fsdp-full", "fsdp", "full"), Case("fsdp-lora", "fsdp", "lora"),
         Case("zero3-full", "zero3", "full"), Case("zero3-lora", "zero3", "lora"),
         Case("ddp-full", "ddp", "full"))
"""DDP last, for reference: CPU replicas hold a copy per rank by nature."""


# --- the worker (one per rank, under torchrun) ---------------------------------------------

def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def _kernel_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


class Sampler:
    """This process's resident set every `every` seconds, on a thread (torch's kernels
    release the GIL, so it keeps sampling while the main thread copies tensors)."""

    def __init__(self, every: float = 0.001) -> None:
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> int:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from now on
        baseline = _resident()
        self._thread.start()
        return baseline

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), _resident()))
            time.sleep(self.every)


def summed_peak(timelines: list[list[tuple[float, int]]], baselines: list[int]) -> int:
    """The largest sum over ranks of (resident set - baseline) at one moment; a rank counts
    its latest sample (CLOCK_MONOTONIC is one clock for every process of the machine)."""
    events = sorted((t, rank, value) for rank, line in enumerate(timelines) for t, value in line)
    current, peak = list(baselines), 0
    for _, rank, value in events:
        current[rank] = value
        peak = max(peak, sum(current) - sum(baselines))
    return peak


def figures(ranks: list[dict]) -> dict:
    """What rank 0 writes: the summed peaks until `load_model` returned on the last rank
    and until the strategy was set up, the kernel's peaks, one copy of the weights."""
    baselines = [r["baseline"] for r in ranks]
    loaded = max(r["loaded"] for r in ranks)
    return {"loaded_peak_bytes": summed_peak(
                [[s for s in r["samples"] if s[0] <= loaded] for r in ranks], baselines),
            "summed_peak_bytes": summed_peak([r["samples"] for r in ranks], baselines),
            "kernel_peaks_bytes": [r["kernel_peak"] for r in ranks],
            "weight_bytes": ranks[0]["weights"]}


def weight_bytes(model) -> int:
    """One copy of the model's weights as the strategy holds them: every parameter counted
    once, whole (a DTensor's global size, a ZeRO-3 partition's `ds_numel`)."""
    total = 0
    for parameter in model.parameters():
        elements = getattr(parameter, "ds_numel", None) or parameter.numel()
        total += elements * parameter.element_size()
    return total


def _load(strategy, source, method, device):
    """The model as `train.run` loads it (and rank 0's weights for a model built empty), at
    this tree's revision or an older one."""
    try:
        from finetune_trainer.loading import load_for
    except ImportError:  # before #17's change every rank read the whole model
        from finetune_trainer.model import load_model

        return load_model(source, method, "fp32", False, sharded=strategy.name != "ddp",
                          device=device), None
    return load_for(strategy, source, method, "fp32", False, device=device)


def worker(model_dir: Path, case: Case, out: Path) -> None:
    import gc

    import torch.distributed as dist

    from finetune_trainer.config import (
        Hyperparameters,
        LoraConfig,
        MethodConfig,
        ModelSource,
        StrategyConfig,
    )
    from finetune_trainer.model import inspect_architecture
    from finetune_trainer.optim import build_optimizer
    from finetune_trainer.parallel import build_strategy, init_distributed

    source = ModelSource(uri=str(model_dir))
    method = MethodConfig(type=case.method, lora=None if case.method == "full" else LoraConfig())
    hp = Hyperparameters(max_steps=1)
    wrap = inspect_architecture(source, method)
    device = init_distributed()
    strategy = build_strategy(StrategyConfig(type=case.strategy, precision="fp32"), hp, device,
                              wrap)
    if case.strategy.startswith("zero"):
        import deepspeed  # noqa: F401  (its import is large: before the baseline)
    gc.collect()
    dist.barrier()
    sampler = Sampler()
    baseline = sampler.start()
    model, weights = _load(strategy, source, method, device)
    loaded = time.monotonic()
    make_optimizer = lambda m: build_optimizer(m, hp, 1e-4)  # noqa: E731
    if weights is None:
        strategy.setup(model, make_optimizer)
    else:
        strategy.setup(model, make_optimizer, weights)
    dist.barrier()
    samples = sampler.stop()
    mine = {"baseline": baseline, "samples": samples, "loaded": loaded,
            "kernel_peak": _kernel_peak() - baseline, "weights": weight_bytes(strategy.unwrapped())}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(figures(gathered)))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown of deepspeed/gloo threads


# --- the driver ----------------------------------------------------------------------------

SHAPE = dict(hidden=1024, layers=6, heads=16, kv_heads=4, intermediate=4096, vocab=16000,
             bf16=True)
"""123M parameters: 494 MB in fp32, stored in bf16 as the hub ships models."""


def build_model(where: Path) -> Path:
    """The checkpoint every case loads (seeded), built once per work folder."""
    if (where / "config.json").is_file():
        return where
    sys.path.insert(0, str(REPO / "benchmarks"))
    import throughput  # a sibling script, not a package

    return throughput.build_model(where, throughput.Shape(**SHAPE),
                                  REPO / "examples/data/tiny-chat.jsonl")


def trainer_at(rev: str, where: Path) -> Path:
    """The trainer package of commit `rev`, unpacked under `where` (for --rev)."""
    archive = where / "trainer.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), rev,
                    "trainer/finetune_trainer"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(where, filter="data")
    return where / "trainer"


def worker_env(trainer_root: Path | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    if trainer_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(trainer_root), str(REPO),
                                             env.get("PYTHONPATH", "")])
    return env


def measure(model_dir: Path, case: Case, where: Path, trainer_root: Path | None = None) -> dict:
    """One case under torchrun: the figures rank 0 wrote."""
    out = where / f"{case.name}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={WORLD}", str(Path(__file__).resolve()), "--worker",
               f"--model={model_dir}", f"--case={case.name}", f"--out={out}"]
    result = subprocess.run(command, env=worker_env(trainer_root), capture_output=True,
                            text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{case.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


def line(case: Case, measured: dict) -> str:
    weights = measured["weight_bytes"]
    cells = [measured["loaded_peak_bytes"], measured["summed_peak_bytes"],
             sum(measured["kernel_peaks_bytes"])]
    return f"{case.name:<11} {weights / MIB:>8,.0f}" + "".join(
        f" {value / MIB:>8,.0f} {value / weights:>5.2f}x" for value in cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="measure the trainer of this commit instead of the tree")
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--work", type=Path, help="keep the model here (built once)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    by_name = {case.name: case for case in CASES}
    if args.worker:
        worker(args.model, by_name[args.case], args.out)
        return
    cases = [by_name[name] for name in args.only.split(",")] if args.only else list(CASES)
    with tempfile.TemporaryDirectory() as scratch:
        scratch_dir = Path(scratch)
        model_dir = build_model(args.work or scratch_dir / "model")
        root = trainer_at(args.rev, scratch_dir) if args.rev else None
        print(f"trainer: {args.rev or 'working tree'}; {WORLD} CPU ranks over gloo; MiB")
        print(f"{'':<11} {'one copy':>8} {'summed peak, loaded':>21} {'... set up':>15} "
              f"{'kernel peaks':>15}")
        for case in cases:
            print(line(case, measure(model_dir, case, scratch_dir, root)), flush=True)


if __name__ == "__main__":
    main()
