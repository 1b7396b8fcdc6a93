"""Our trainer against Hugging Face `transformers.Trainer` and TRL's `SFTTrainer`, side by
side; with DPO (preference tuning), against TRL's `DPOTrainer`; with GRPO (online RL),
against TRL's `GRPOTrainer`.

Same model (built from a config, random weights, saved with save_pretrained), same
token sequences (tokenised once by our data module), sequence length, global batch,
precision and strategy; one run after the other in this script. Prints a table and writes
benchmarks/throughput.json (the CPU suite's; another suite's to throughput-<suite>.json;
ratios under `*ratio*` keys: `tokens_per_second_ratio` is ours over Trainer,
`trl_tokens_per_second_ratio` ours over SFTTrainer, `liger_…` ours over SFTTrainer with
Liger kernels, `trl_dpo_…` ours over DPOTrainer, `trl_grpo_…` over GRPOTrainer). The TRL
sides need `trl` (`pip install -e ".[bench]"`, which `make bench` does), the Liger side
`liger-kernel` and a GPU.

    .venv/bin/python benchmarks/throughput.py                 # the CPU configurations
    .venv/bin/python benchmarks/throughput.py --suite gpu     # 1B full, 1B/3B LoRA, QLoRA
    .venv/bin/python benchmarks/throughput.py --only gpu-1b-full --profile /tmp/prof
    .venv/bin/python benchmarks/throughput.py --suite cpu-dpo # DPO, LoRA, vs DPOTrainer
    .venv/bin/python benchmarks/throughput.py --suite gpu-dpo # 1B LoRA DPO on a GPU
    .venv/bin/python benchmarks/throughput.py --suite cpu-grpo # GRPO, LoRA, vs GRPOTrainer
    .venv/bin/python benchmarks/throughput.py --suite gpu-grpo # 1B LoRA GRPO on a GPU

The CPU suite runs against Trainer and SFTTrainer three times each; the GPU suite against
SFTTrainer with and without Liger once each (Trainer pads every sample, which on a GPU
says more about packing than about the trainer). The DPO suites (`cpu-dpo`, `gpu-dpo`:
LoRA, so each side's reference is the base with its adapters switched off, taken at every
step; beta 0.1, the sigmoid loss) train on preference pairs in plain text, a prompt and
two answers of long-tailed lengths, which both sides tokenise themselves the same way;
DPOTrainer runs with its defaults (no padding-free batches, reference log-probabilities
not precomputed). Its batch is `batchSizePerDevice` pairs, ours that many packed rows,
each holding several pairs (tok/step in the table, `tokens_per_step` in the JSON, says
how far apart the steps are); `cpu-dpo-pairs` raises its batch to the pairs of ours' step.
The GRPO suites (`cpu-grpo`, `gpu-grpo`: LoRA, beta 0, one exact-match reward) sample
`numGenerations` completions per prompt with transformers `generate` on both sides (a KV
cache, no vLLM), `batchSizePerDevice` completions per device on both; a step's time holds
its sampling, and its tokens are the completion tokens it trained on.
Tokens/s counts label tokens (what the loss trains on: with DPO, both answers of each
pair), over the steps after a warm-up; `input_tokens_per_second` (the table's model/s)
every token through the model, prompts too. Peak memory: the CUDA allocator's peak on a
GPU, else the largest worker's resident set; the largest resident set is recorded on GPUs
too (`peak_host_bytes`). MFU on GPUs only, two ways: `mfu` attention over the pairs each
document attends (finetune_trainer/flops.py), `mfu_full_rows` over whole rows as PaLM and
torchtitan count it. Each model is built in a child process and each side starts on a GPU
nothing else holds (`gpu_free_bytes_at_start`; a side is refused otherwise); a side that
fails is recorded (`<side>_failed`) and the others kept.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
WORDS = ["the", "model", "learns", "a", "short", "answer", "from", "each", "prompt", "while",
         "gradients", "flow", "through", "every", "layer", "of", "network", "and",
         "optimizer", "updates", "weights", "on", "rank", "in", "step", "with", "its",
         "peers", "tokens", "batches", "sequences", "packing", "padding", "attention"]


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 0
    """0: the tokenizer's size."""
    bf16: bool = False
    """Stored in bf16, as the hub ships large models."""


@dataclass(frozen=True)
class Bench:
    name: str
    shape: Shape
    method: str
    data: str
    """`variable`: lengths from a long-tailed distribution; `fixed`: every sample the
    sequence length."""
    seq_len: int
    batch: int
    steps: int
    processes: int
    precision: str = "fp32"
    strategy: str = "ddp"
    accumulation: int = 1
    checkpointing: bool | None = False
    """None: what an unset `gradientCheckpointing` resolves to (see `as_users_run_it`)."""
    compile: bool | None = False
    """None: what an unset `compile` resolves to."""
    micro_batch: int | None = None
    """Sequences per pass (`microBatchSize`); None: `batch`, or the planner's choice where
    `as_users_run_it` resolves the rest."""
    packing: bool = True
    warmup: int = 3
    samples: int = 600
    gpu: bool = False
    objective: str = "sft"
    """`dpo`: preference pairs (`write_pairs`), trained with DPO (`DPO`, or `extra["dpo"]`);
    `grpo`: prompts with an answer (`write_prompts`), trained with GRPO (`GRPO`, or
    `extra["grpo"]`); each against the peers of that objective."""
    extra: dict = field(default_factory=dict)


TINY = Shape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688)
LLAMA_1B = Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256,
                 bf16=True)
LLAMA_8B = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                 vocab=128256, bf16=True)
LLAMA_3B = Shape(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, vocab=128256,
                 bf16=True)

PAIRS = "pairs"
"""`extra["peerBatch"]`: a DPO peer's per-device batch is the preference pairs in ours'
(`batch` packed rows of them); resolved by `compare` to a number."""


@dataclass(frozen=True)
class Suite:
    benches: list[Bench]
    peers: tuple[str, ...]
    """The sides each configuration runs against, unless --peers says otherwise."""
    repeats: int


SUITES = {
    "cpu": Suite([
        Bench("cpu-variable", TINY, "full", "variable", seq_len=512, batch=4, steps=30,
              processes=2),
        Bench("cpu-fixed", TINY, "full", "fixed", seq_len=256, batch=4, steps=30,
              processes=2, packing=False),
    ], peers=("hf_trainer", "trl_sft"), repeats=3),
    # the defaults (checkpointing and compile unset, as the planner resolves them for a long
    # run on an 80 GB H100); 20 timed steps after 10 of warm-up (the compile): a minute or
    # two a side
    "gpu": Suite([
        Bench(name, shape, method, "variable", seq_len=4096, batch=batch, steps=30,
              processes=1, precision="bf16", gpu=True, checkpointing=None, compile=None,
              samples=2000, warmup=10)
        for name, shape, method, batch in (
            ("gpu-1b-full", LLAMA_1B, "full", 4), ("gpu-1b-lora", LLAMA_1B, "lora", 4),
            ("gpu-3b-lora", LLAMA_3B, "lora", 2), ("gpu-1b-qlora", LLAMA_1B, "qlora", 4),
            ("gpu-8b-lora", LLAMA_8B, "lora", 2))
    ] + [
        # compile off: the planner's peak is checked against both (it must hold for either)
        Bench("gpu-8b-lora-eager", LLAMA_8B, "lora", "variable", seq_len=4096, batch=2,
              steps=30, processes=1, precision="bf16", gpu=True, checkpointing=None,
              compile=False, samples=2000, warmup=10),
    ], peers=("trl_sft", "trl_liger"), repeats=1),
    # DPO on LoRA (the reference: the base, adapters off, at every step on both sides);
    # each pair's prompt + answer within seqLen, so neither side truncates
    "cpu-dpo": Suite([
        Bench("cpu-dpo", TINY, "lora", "variable", seq_len=512, batch=4, steps=30,
              processes=2, objective="dpo"),
        # DPOTrainer's batch raised to the pairs of ours' step (`PAIRS`): the same
        # training per step, the difference left to padding vs packing
        Bench("cpu-dpo-pairs", TINY, "lora", "variable", seq_len=512, batch=4, steps=30,
              processes=2, objective="dpo", extra={"peerBatch": PAIRS}),
    ], peers=("trl_dpo",), repeats=3),
    # as the gpu suite: the defaults users get; prompt + each answer up to 2,048 tokens
    # (our packed rows up to 4,096)
    "gpu-dpo": Suite([
        Bench("gpu-1b-dpo", LLAMA_1B, "lora", "variable", seq_len=2048, batch=4, steps=30,
              processes=1, precision="bf16", gpu=True, checkpointing=None, compile=None,
              samples=2000, warmup=10, objective="dpo"),
        # DPOTrainer given the pairs of ours' step (one packed row: ~22 pairs) and gradient
        # checkpointing to fit them (without it, out of memory at 72 GiB on an H100); at the
        # 88 pairs of ours' default 4 rows it failed with it too (11-27, before --keep kept a
        # peer's log: likely its [pairs x length x vocabulary] logits); ours as users run it
        Bench("gpu-1b-dpo-pairs", LLAMA_1B, "lora", "variable", seq_len=2048, batch=1,
              steps=30, processes=1, precision="bf16", gpu=True, checkpointing=None,
              compile=None, samples=2000, warmup=10, objective="dpo",
              extra={"peerBatch": PAIRS, "peerCheckpointing": True}),
        # both sides take the base's log-probabilities once, before training
        # (precomputeRefLogProbs, TRL's precompute_ref_log_probs): no reference forward
        # in a step
        Bench("gpu-1b-dpo-precomputed", LLAMA_1B, "lora", "variable", seq_len=2048,
              batch=4, steps=30, processes=1, precision="bf16", gpu=True,
              checkpointing=None, compile=None, samples=2000, warmup=10, objective="dpo",
              extra={"dpo": {"precomputeRefLogProbs": True}}),
    ], peers=("trl_dpo",), repeats=1),
    # GRPO on LoRA, beside GRPOTrainer with the same generation engine (transformers
    # `generate`, KV cache on both sides); a random model seldom ends a completion early, so
    # both sides sample about maxCompletionLength tokens per completion
    "cpu-grpo": Suite([
        Bench("cpu-grpo", TINY, "lora", "variable", seq_len=256, batch=8, steps=12,
              processes=2, objective="grpo", warmup=3, samples=256,
              extra={"grpo": {"maxCompletionLength": 48}}),
    ], peers=("trl_grpo",), repeats=3),
    # 2 prompts x 8 completions of up to 256 tokens per step, as users run it
    "gpu-grpo": Suite([
        Bench("gpu-1b-grpo", LLAMA_1B, "lora", "variable", seq_len=1024, batch=16, steps=16,
              processes=1, precision="bf16", gpu=True, checkpointing=None, compile=None,
              samples=512, warmup=4, objective="grpo"),
    ], peers=("trl_grpo",), repeats=1),
}

DPO = {"beta": 0.1, "loss": "sigmoid", "labelSmoothing": 0.0}
"""`objective.dpo` of the DPO configurations (TRL's defaults); `extra["dpo"]` overrides."""
GRPO = {"numGenerations": 8, "maxCompletionLength": 256, "temperature": 1.0, "loss": "dapo",
        "beta": 0.0, "rewards": [{"name": "exact_match", "column": "answer"}]}
"""`objective.grpo` of the GRPO configurations (TRL's defaults but a shorter completion, and
one reward: the benchmark times the trainer, not the scoring); `extra["grpo"]` overrides."""


def objective_section(bench: Bench) -> dict:
    """A configuration's `objective`, as the trainer config and the manifest spell it."""
    settings = {"dpo": DPO, "grpo": GRPO}.get(bench.objective)
    if settings is None:
        return {}
    return {"objective": {"type": bench.objective, bench.objective: {
        **settings, **bench.extra.get(bench.objective, {})}}}


# --- inputs --------------------------------------------------------------------------------

def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(words, 1)))


def write_data(path: Path, bench: Bench, seed: int = 0) -> None:
    """Chat samples; `variable` lengths are log-normal (many short, a long tail), as
    instruction data is; `fixed` ones all overflow the sequence length (truncated)."""
    if bench.objective != "sft":
        {"dpo": write_pairs, "grpo": write_prompts}[bench.objective](path, bench, seed)
        return
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for _ in range(bench.samples):
            if bench.data == "fixed":
                prompt, answer = bench.seq_len // 4, bench.seq_len
            else:
                total = min(int(rng.lognormvariate(4.0, 0.9)) + 8, bench.seq_len)
                prompt = max(total // 3, 2)
                answer = max(total - prompt, 2)
            messages = [{"role": "user", "content": sentence(rng, prompt)},
                        {"role": "assistant", "content": sentence(rng, answer)}]
            out.write(json.dumps({"messages": messages}) + "\n")


def write_pairs(path: Path, bench: Bench, seed: int = 0) -> None:
    """Preference pairs in plain text (`prompt`, `chosen`, `rejected`): each prompt and
    answer as `variable` samples are (log-normal, many short, a long tail), the rejected
    answer's length drawn on its own; prompt + each answer within the sequence length, so
    that neither side truncates (our maxSeqLength and TRL's max_length both bound each of
    prompt + chosen and prompt + rejected). The prompt ends in a newline, so each answer
    starts a token of its own on both sides."""
    if bench.data != "variable":
        raise ValueError(f"{bench.name}: preference pairs come in variable lengths only")
    rng = random.Random(seed)
    room = bench.seq_len - 4  # a word is a token; BOS, the newline and EOS besides
    with path.open("w", encoding="utf-8") as out:
        for _ in range(bench.samples):
            total = min(int(rng.lognormvariate(4.0, 0.9)) + 8, room)
            prompt = max(total // 3, 2)
            chosen = max(total - prompt, 2)
            rejected = max(min(int(rng.lognormvariate(4.0, 0.9)) * 2 // 3, room - prompt), 2)
            out.write(json.dumps({"prompt": sentence(rng, prompt) + "\n",
                                  "chosen": sentence(rng, chosen),
                                  "rejected": sentence(rng, rejected)}) + "\n")


def write_prompts(path: Path, bench: Bench, seed: int = 0) -> None:
    """GRPO's prompts in plain text with an `answer` column (one word), the prompts'
    lengths log-normal as `variable` samples are, within what the sequence length leaves
    beside the completion (so that neither side cuts a prompt)."""
    if bench.data != "variable":
        raise ValueError(f"{bench.name}: GRPO prompts come in variable lengths only")
    rng = random.Random(seed)
    room = bench.seq_len - {**GRPO, **bench.extra.get("grpo", {})}["maxCompletionLength"] - 2
    with path.open("w", encoding="utf-8") as out:
        for _ in range(bench.samples):
            words = min(int(rng.lognormvariate(3.0, 0.8)) + 4, room)
            out.write(json.dumps({"prompt": sentence(rng, words) + "\n",
                                  "answer": rng.choice(WORDS)}) + "\n")


def build_model(where: Path, shape: Shape, corpus_file: Path) -> Path:
    """The random model and its tokenizer, saved under `where` by a child process: built on
    the GPU there (10x faster), and every byte of it gone with the child, so that no side's
    run shares the GPU with it (the parent once held 31.5 GiB of an 8B model through every
    run after it)."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(
        target=_build_model, args=(where, shape, corpus_file))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"building {where.name} failed (exit {child.exitcode})")
    return where


def _build_model(where: Path, shape: Shape, corpus_file: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune_trainer.tiny import build_tokenizer, corpus_from_jsonl

    tokenizer = build_tokenizer(corpus_from_jsonl(corpus_file)[:2000], vocab_size=1024)
    config = LlamaConfig(
        vocab_size=shape.vocab or len(tokenizer), hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=8192, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False)
    import torch

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # 10x faster init
        model = LlamaForCausalLM(config)
    if shape.bf16:
        model = model.to(torch.bfloat16)
    model.save_pretrained(where, safe_serialization=True)
    tokenizer.save_pretrained(where)


def model_name(shape: Shape) -> str:
    return f"model-{shape.hidden}-{shape.layers}-{shape.vocab}"


def trainer_config(bench: Bench, model: Path, data: Path, output: Path) -> dict:
    method: dict = {"type": bench.method}
    if bench.method != "full":
        method["lora"] = {"r": 16, "alpha": 32, "dropout": 0.0, "targetModules": ["all-linear"]}
    return {
        "job": {"name": f"bench-{bench.name}", "namespace": "bench"},
        "model": {"uri": str(model)},
        "dataset": {"uri": str(data), "format": {"dpo": "preference", "grpo": "prompt"}.get(
                        bench.objective, "chat"),
                    "maxSeqLength": bench.seq_len, "packing": bench.packing},
        "method": method,
        **objective_section(bench),
        "strategy": {"type": bench.strategy, "precision": bench.precision,
                     "gradientCheckpointing": bench.checkpointing, "compile": bench.compile,
                     "gradientCheckpointingPolicy": bench.extra.get("checkpointPolicy", "full")},
        "hyperparameters": {"maxSteps": bench.steps, "batchSizePerDevice": bench.batch,
                            "gradientAccumulationSteps": bench.accumulation,
                            "learningRate": 1e-4, "logEverySteps": bench.warmup,
                            "warmupRatio": 0.0, "scheduler": "constant",
                            **({"microBatchSize": bench.micro_batch}
                               if bench.micro_batch else {})},
        "output": {"uri": str(output), "checkpointEverySteps": 10**6},
        "metrics": {"port": 19208},
        "preflight": {"enabled": False},
    }


PLANNED_ON = "Standard_ND96isr_H100_v5"
"""The catalog's 80 GB H100 (8 per VM; the per-GPU estimate of a replicated job is the same
on one)."""
KEEP: Path | None = None
"""--keep DIR: where each configuration's log and progress records are copied."""
PLANNED_STEPS = 10_000
"""Unset settings are resolved as for a run this long (the benchmark itself runs fewer)."""


def as_users_run_it(bench: Bench, model: Path) -> Bench:
    """The bench with unset checkpointing, micro-batch and compile resolved as `finetune
    run` and the operator resolve them (finetune_operator.planner.choose_step_settings)."""
    if bench.checkpointing is not None and bench.compile is not None:
        return bench
    from finetune_operator.api import FineTuneJob
    from finetune_operator.planner import ModelConfig, choose_step_settings, planned_peak

    lora = {"lora": {"r": 16, "alpha": 32, "dropout": 0.0}} if bench.method != "full" else {}
    job = FineTuneJob.model_validate({
        "apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneJob",
        "metadata": {"name": bench.name}, "spec": {
            "model": {"uri": str(model)}, "dataset": {"uri": "/data.jsonl",
                                                      "maxSeqLength": bench.seq_len,
                                                      "packing": bench.packing},
            "method": {"type": bench.method, **lora},
            **objective_section(bench),
            "strategy": {"type": bench.strategy, "precision": bench.precision,
                         "gradientCheckpointing": bench.checkpointing,
                         "compile": bench.compile},
            "hyperparameters": {"maxSteps": PLANNED_STEPS, "batchSizePerDevice": bench.batch,
                                "gradientAccumulationSteps": bench.accumulation,
                                "microBatchSize": bench.micro_batch},
            "resources": {"gpusPerNode": 8, "gpuType": PLANNED_ON},
            "output": {"uri": "/out"}}})
    config = ModelConfig(source=str(model), config=json.loads(
        (model / "config.json").read_text()))
    settings = choose_step_settings(job, config, bench.strategy)
    peak = planned_peak(job, config, bench.strategy, settings)
    for note in settings.notes:
        print(f"  {bench.name}: {note}", flush=True)
    return replace(bench, checkpointing=settings.gradient_checkpointing,
                   compile=settings.compile, micro_batch=settings.micro_batch, extra={
                       **bench.extra, "checkpointPolicy": settings.checkpoint_policy,
                       "plannedPeakBytes": peak})


# --- running -------------------------------------------------------------------------------

RSS_WRAPPER = ("import resource, subprocess, sys\n"
               "code = subprocess.run(sys.argv[1:]).returncode\n"
               "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
               "sys.exit(code)\n")


def torchrun(processes: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={processes}", *args]


def worker_env() -> dict[str, str]:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def run(command: list[str], log: Path) -> int:
    """Run under a wrapper that reports the largest descendant's resident set."""
    result = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *command], env=worker_env(),
                            capture_output=True, text=True)
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{command[:6]} failed; see {log}:\n{result.stderr[-3000:]}")
    return int(next(line.split()[1] for line in result.stdout.splitlines()
                    if line.startswith("MAXRSS")))


EMPTY_GPU_USED = 2 * 2**30
"""What an idle GPU shows in use (the driver's own reserve, about 0.5 GiB on an H100);
more before a side starts is another process's memory, and the run would not be that
side's alone."""


def gpu_memory() -> dict[str, int] | None:
    """GPU 0's free, used and total bytes, read through NVML (no CUDA context in this
    process); None without a GPU or NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        return {"free": int(info.free), "used": int(info.used), "total": int(info.total)}
    finally:
        pynvml.nvmlShutdown()


def empty_gpu(bench: Bench, side: str) -> dict[str, int]:
    """The GPU's free memory before `side` starts (`gpu_free_bytes_at_start` in the JSON);
    refuses to time a side on a GPU that another process holds memory of."""
    if not bench.gpu or (memory := gpu_memory()) is None:
        return {}
    if memory["used"] > EMPTY_GPU_USED:
        raise RuntimeError(
            f"{bench.name}: {memory['used'] / 2**30:.1f} GiB of the GPU is in use before "
            f"{side} starts (a process left over, or another tenant): its run would not have "
            "the GPU to itself; free it (nvidia-smi names the process) and run again")
    return {"gpu_free_bytes_at_start": memory["free"]}


def run_ours(bench: Bench, config: Path, output: Path) -> dict:
    at_start = empty_gpu(bench, "ours")
    maxrss = run(torchrun(bench.processes, "-m", "finetune_trainer", f"--config={config}"),
                 config.with_suffix(".ours.log"))
    records = [json.loads(line) for line in (output / "progress.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > bench.warmup]  # the first window is warm-up
    seconds = sum(r["stepSeconds"] * bench.warmup for r in timed)

    def total(rate: str) -> float:
        return sum((r.get(rate) or 0) * r["stepSeconds"] * bench.warmup for r in timed)

    def mean(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    tokens = total("tokensPerSecond")
    peak = max(r["peakMemoryBytes"] for r in records) if bench.gpu else maxrss
    steps = len(timed) * bench.warmup
    return {"tokens_per_second": tokens / seconds, "step_seconds": seconds / steps,
            "input_tokens_per_second": total("inputTokensPerSecond") / seconds,
            "tokens_per_step": tokens / steps, "peak_memory_bytes": peak,
            "peak_host_bytes": maxrss, "mfu": mean("mfu"),
            "mfu_full_rows": mean("mfuFullRows"), **at_start}


@dataclass(frozen=True)
class Peer:
    worker: str
    """What `hf_worker.py --peer` runs."""
    prefix: str
    """Of its ratio keys in the results."""
    label: str
    objective: str = "sft"
    """The configurations it runs: those of this objective (`Bench.objective`)."""


PEERS = {"hf_trainer": Peer("trainer", "", "ours/HF"), "trl_sft": Peer("sft", "trl_", "ours/TRL"),
         "trl_liger": Peer("sft-liger", "liger_", "ours/Liger"),
         "trl_dpo": Peer("dpo", "trl_dpo_", "ours/TRLDPO", objective="dpo"),
         "trl_grpo": Peer("grpo", "trl_grpo_", "ours/TRLGRPO", objective="grpo")}
"""A side's key in the results → the peer."""


def run_peer(bench: Bench, config: Path, side: str) -> dict:
    at_start = empty_gpu(bench, side)
    peer = PEERS[side].worker
    result = config.with_suffix(f".{peer}.json")
    batch = bench.extra.get("peerBatch")
    maxrss = run(torchrun(bench.processes, str(REPO / "benchmarks/hf_worker.py"),
                          f"--config={config}", f"--result={result}", f"--peer={peer}",
                          f"--warmup-steps={bench.warmup}",
                          *([f"--batch-per-device={batch}"] if batch else []),
                          *(["--gradient-checkpointing"] if bench.extra.get(
                              "peerCheckpointing") else [])),
                 config.with_suffix(f".{peer}.log"))
    figures = {**json.loads(result.read_text()), **at_start}
    figures["peak_host_bytes"] = maxrss
    if not bench.gpu:
        figures["peak_memory_bytes"] = maxrss
    return figures


def pairs_per_sequence(config: Path) -> float:
    """The mean preference pairs in one of ours' packed rows (the trainer's own preflight:
    tokenised, truncated and packed as training does)."""
    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.train import preflight

    sequences = preflight(TrainerConfig.load(config), config.parent).train
    return sum(len(s["pairs"]) for s in sequences) / len(sequences)


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (its other figures with it), plus every rate."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_second"])
    return {**ranked[len(ranked) // 2], "all_tokens_per_second": [
        round(r["tokens_per_second"], 1) for r in runs]}


def compare(bench: Bench, work: Path, repeats: int, peers: tuple[str, ...]) -> dict:
    data = work / f"{bench.name}.jsonl"
    write_data(data, bench)
    model = work / model_name(bench.shape)
    if not model.exists():
        build_model(model, bench.shape, data)
    bench = as_users_run_it(bench, model)
    config = work / f"{bench.name}.yaml"
    output = work / f"out-{bench.name}"
    config.write_text(yaml.safe_dump(trainer_config(bench, model, data, output)))
    if bench.extra.get("peerBatch") == PAIRS:
        per_row = pairs_per_sequence(config)
        bench = replace(bench, extra={**bench.extra, "peerBatch": round(bench.batch * per_row)})
        print(f"  {bench.name}: {per_row:.2f} pairs per packed row of ours; the peers' batch "
              f"{bench.extra['peerBatch']} pairs per device", flush=True)
    sides = ("ours", *peers)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    failed: dict[str, str] = {}
    for repeat in range(repeats):
        # rotate who goes first, so a slow spell of a shared machine hits every side alike
        for side in sides[repeat % len(sides):] + sides[:repeat % len(sides)]:
            if side == "ours":
                shutil.rmtree(output, ignore_errors=True)
                runs[side].append(run_ours(bench, config, output))
            elif side not in failed:
                try:
                    runs[side].append(run_peer(bench, config, side))
                except RuntimeError as error:  # the other sides' figures are kept
                    failed[side] = str(error)
                    print(f"  {bench.name}: {side} failed: {error}", flush=True)
    if KEEP is not None:  # --keep: our last run's log and progress records, peers' logs
        KEEP.mkdir(parents=True, exist_ok=True)
        shutil.copy(config.with_suffix(".ours.log"), KEEP / f"{bench.name}.log")
        shutil.copy(output / "progress.jsonl", KEEP / f"{bench.name}.progress.jsonl")
        for side in peers:
            log = config.with_suffix(f".{PEERS[side].worker}.log")
            if log.exists():
                shutil.copy(log, KEEP / f"{bench.name}.{side}.log")
    ours = median_run(runs["ours"])
    row = {"config": asdict(bench), "ours": ours}
    if planned := bench.extra.get("plannedPeakBytes"):  # the planner's +10%, never under
        row["planned_over_measured_peak"] = planned / ours["peak_memory_bytes"]
    for side, error in failed.items():
        row[f"{side}_failed"] = error.splitlines()[0]
    for side in (side for side in peers if side not in failed):
        peer, prefix = median_run(runs[side]), PEERS[side].prefix
        # each repeat ran every side back to back: the median of those pairs' ratios is
        # what a noisy shared machine (another tenant, a frequency change) disturbs least
        pairs = sorted(o["tokens_per_second"] / p["tokens_per_second"]
                       for o, p in zip(runs["ours"], runs[side], strict=True))
        row[side] = peer
        row[f"{prefix}tokens_per_second_ratio"] = pairs[len(pairs) // 2]
        row[f"{prefix}tokens_per_second_pair_ratios"] = [round(r, 3) for r in pairs]
        row[f"{prefix}step_time_ratio"] = ours["step_seconds"] / peer["step_seconds"]
        row[f"{prefix}peak_memory_ratio"] = (ours["peak_memory_bytes"]
                                             / peer["peak_memory_bytes"])
        if ours.get("mfu") and peer.get("mfu"):
            row[f"{prefix}mfu_ratio"] = ours["mfu"] / peer["mfu"]
    return row


def table(rows: list[dict]) -> str:
    """trained tok/s: the label tokens the loss trains on; model tok/s: every token through
    the model (prompts too); MFU: attention over the pairs attended (ours), MFU rows: over
    whole rows (PaLM's and torchtitan's convention)."""
    lines = [f"{'config':<17} {'side':<11} {'trained/s':>10} {'model/s':>10} {'step s':>8} "
             f"{'peak MiB':>9} {'MFU':>6} {'MFU rows':>8} {'host MiB':>9} {'tok/step':>9}"]
    for row in rows:
        peers = [side for side in PEERS if side in row]
        for side in ("ours", *peers):
            f = row[side]
            mfu = f"{f['mfu']:.1%}" if f.get("mfu") else "-"
            rows_mfu = f"{f['mfu_full_rows']:.1%}" if f.get("mfu_full_rows") else "-"
            lines.append(f"{row['config']['name']:<17} {side:<11} "
                         f"{f['tokens_per_second']:>10,.0f} "
                         f"{f.get('input_tokens_per_second', 0):>10,.0f} "
                         f"{f['step_seconds']:>8.3f} "
                         f"{f['peak_memory_bytes'] / 2**20:>9,.0f} {mfu:>6} {rows_mfu:>8} "
                         f"{f.get('peak_host_bytes', 0) / 2**20:>9,.0f} "
                         f"{f.get('tokens_per_step', 0):>9,.0f}")
        if "planned_over_measured_peak" in row:
            lines.append(f"{'':<17} {'plan/peak':<11} "
                         f"{row['planned_over_measured_peak']:>9.2f}x")
        for side in peers:
            prefix = PEERS[side].prefix
            lines.append(f"{'':<17} {PEERS[side].label:<11} "
                         f"{row[prefix + 'tokens_per_second_ratio']:>9.2f}x {'':>10} "
                         f"{row[prefix + 'step_time_ratio']:>7.2f}x "
                         f"{row[prefix + 'peak_memory_ratio']:>8.2f}x")
    return "\n".join(lines)


def machine() -> str:
    """Through NVML, not torch.cuda: this process keeps no CUDA context beside the runs."""
    import platform

    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            return f"{name.decode() if isinstance(name, bytes) else name} x{count}"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, no GPU: a CPU machine
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU only"


def libraries() -> dict[str, str]:
    """The versions the figures were taken with (the peers change speed between releases)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    found = {"python": sys.version.split()[0], "cuda": torch.version.cuda or "none"}
    for name in ("torch", "transformers", "peft", "accelerate", "trl", "liger-kernel",
                 "bitsandbytes", "deepspeed"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    parser.add_argument("--only", default=None,
                        help="run these configurations (comma-separated names)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each side, alternating; the median is reported "
                        "(default: 3 on the CPU suites, 1 on the GPU suites)")
    parser.add_argument("--peers", default=None,
                        help=f"comma-separated, among {', '.join(PEERS)} (default: the "
                        "suite's); each configuration runs beside those of its objective "
                        "(trl_dpo beside the DPO ones, the others beside the rest)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="profile our warm-up steps (FINETUNE_PROFILE): the top "
                        "kernels per configuration under DIR/<name>/")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="copy our log and progress records of each configuration here")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/throughput.json for the cpu suite, "
                        "benchmarks/throughput-<suite>.json for another")
    args = parser.parse_args()
    global KEEP
    KEEP = args.keep
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else []
    known = {b.name for suite in SUITES.values() for b in suite.benches}
    if set(names) - known:
        parser.error(f"--only {args.only}: no configuration named "
                     f"{', '.join(sorted(set(names) - known))}; choose among "
                     f"{', '.join(sorted(known))}")
    chosen = [(key, b) for name in names for key, suite in SUITES.items()
              for b in suite.benches if b.name == name] if names else [
        (args.suite, b) for b in SUITES[args.suite].benches]
    asked = tuple(p.strip() for p in args.peers.split(",") if p.strip()) \
        if args.peers is not None else None
    if asked is not None and set(asked) - set(PEERS):
        parser.error(f"--peers {args.peers}: choose among {', '.join(PEERS)}")
    runs = [(bench, sides_of(bench, SUITES[key].peers if asked is None else asked),
             args.repeats or SUITES[key].repeats) for key, bench in chosen]
    peers = {side for _, sides, _ in runs for side in sides}
    for side in set(asked or ()) - peers:
        parser.error(f"--peers {args.peers}: {side} runs the {PEERS[side].objective} "
                     "configurations, and none is chosen")
    if any(side.startswith("trl_") for side in peers) and importlib.util.find_spec("trl") is None:
        parser.error('the TRL peers need trl: pip install -e ".[bench]" (make bench does), '
                     "or leave them out with --peers")
    if "trl_liger" in peers and importlib.util.find_spec("liger_kernel") is None:
        parser.error("the trl_liger peer needs liger-kernel (pip install liger-kernel) and a "
                     "GPU, or leave it out with --peers")
    out = args.out or REPO / "benchmarks" / (
        "throughput.json" if chosen[0][0] == "cpu" else f"throughput-{chosen[0][0]}.json")

    rows = []
    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as tmp:
        for bench, sides, repeats in runs:
            print(f"running {bench.name} ...", flush=True)
            if args.profile:  # inside the warm-up, so the timed steps run unprofiled
                os.environ["FINETUNE_PROFILE"] = str(args.profile / bench.name)
                os.environ["FINETUNE_PROFILE_STEPS"] = f"2:{max(bench.warmup - 2, 1)}"
            rows.append(compare(bench, Path(tmp), repeats, sides))
            print(table(rows[-1:]), flush=True)
            write_results(out, rows)  # after each: a run cut short keeps what finished
    print(f"\n{machine()}\n{table(rows)}")
    print(f"\nwrote {out}")


def sides_of(bench: Bench, peers: tuple[str, ...]) -> tuple[str, ...]:
    """The peers a configuration runs beside: those of its objective (SFTTrainer cannot
    train on preference pairs, nor DPOTrainer on chat samples)."""
    return tuple(side for side in peers if PEERS[side].objective == bench.objective)


def write_results(out: Path, rows: list[dict]) -> None:
    out.write_text(json.dumps({"machine": machine(), "libraries": libraries(),
                               "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
