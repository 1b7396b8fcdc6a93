"""Sampling speed of `generate` on a LoRA model, several ways side by side: what a GRPO
generation round could gain before any trainer code changes (#60 asks GRPO at 2x TRL's
GRPOTrainer with the same engine, and on a GPU sampling is most of a GRPO step).

- `dynamic`: peft's model, adapters unmerged, a DynamicCache: how GRPOTrainer's
  transformers path samples, and ours today (objectives/grpo/objective.py).
- `merged`: the adapters merged into a copy of the weights (no adapter matmuls per token;
  the copy's memory is in the peak).
- `static`: a StaticCache and transformers' compiled decoding step (CUDA graphs; GPUs only).
- `merged-static`: both.

Each side: one warm-up call (compiles, where it does), then `--calls` timed calls of
`--rows` completions of exactly `--new-tokens` tokens (min_new_tokens: a random model's
EOS would end rows early), each call from one seed. Prints new tokens/s, each side over
`dynamic`, peak GPU memory, and the share of greedy tokens equal to `dynamic`'s (the side
samples the same model); writes JSON (`results[]`, `<side>` over `dynamic` in `ratio`).

    .venv/bin/python benchmarks/generation.py                  # tiny model on CPU
    .venv/bin/python benchmarks/generation.py --suite gpu      # 1B, LoRA r16 all-linear
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # a sibling script, not a package
from throughput import LLAMA_1B, TINY, Shape

SUITES = {
    # 2 prompts x 8 completions of up to 256 tokens: the gpu-grpo configuration's round
    "gpu": dict(shape=LLAMA_1B, rows=16, prompt=128, new_tokens=256, calls=3,
                sides=("dynamic", "merged", "static", "merged-static")),
    "cpu": dict(shape=TINY, rows=8, prompt=32, new_tokens=32, calls=3,
                sides=("dynamic", "merged")),
}
VOCABULARY = 32000
"""The tiny model's vocabulary here (no tokenizer: prompts are random ids)."""


def lora_model(shape: Shape, device: torch.device):
    """A random Llama of `shape` with LoRA r16 on every linear layer, its B matrices random
    too (at peft's zeros a merge would change nothing), in the compute dtype."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab or VOCABULARY, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=4096,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules="all-linear"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.02)
    return model.eval()


def side(name: str, model):
    """(the model `name` samples with, the generate settings it adds)."""
    from transformers import CompileConfig

    sampled = copy.deepcopy(model).merge_and_unload() if name.startswith("merged") else model
    settings = ({"cache_implementation": "static", "compile_config": CompileConfig(),
                 "disable_compile": False} if name.endswith("static")
                else {"disable_compile": True})
    return sampled, settings


def sample(model, prompts, new_tokens: int, settings: dict, seed: int, greedy: bool = False):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=not greedy, top_k=0, temperature=1.0, pad_token_id=0,
                              eos_token_id=2, **settings)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                             generation_config=config)
    return out[:, prompts.shape[1]:]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(name: str, model, prompts, suite: dict, device: torch.device,
            reference_greedy) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    sampled, settings = side(name, model)
    made = time.perf_counter() - started
    started = time.perf_counter()
    sample(sampled, prompts, suite["new_tokens"], settings, seed=0)  # warm-up: compiles
    synchronize(device)
    warmup = time.perf_counter() - started
    started = time.perf_counter()
    for call in range(suite["calls"]):
        sample(sampled, prompts, suite["new_tokens"], settings, seed=1 + call)
    synchronize(device)
    seconds = time.perf_counter() - started
    greedy = sample(sampled, prompts, min(32, suite["new_tokens"]), settings, seed=0,
                    greedy=True)
    agreement = (1.0 if reference_greedy is None
                 else (greedy == reference_greedy).float().mean().item())
    tokens = suite["calls"] * suite["rows"] * suite["new_tokens"]
    result = {"side": name, "tokens_per_second": tokens / seconds,
              "seconds_per_call": seconds / suite["calls"], "warmup_seconds": warmup,
              "setup_seconds": made, "greedy_agreement": agreement,
              "peak_memory_bytes": (torch.cuda.max_memory_allocated()
                                    if device.type == "cuda" else None)}
    del sampled
    return result, greedy


def table(rows: list[dict]) -> str:
    lines = [f"{'side':<15} {'new tok/s':>10} {'ratio':>7} {'s/call':>7} {'warm-up s':>9} "
             f"{'peak GiB':>9} {'greedy same':>11}"]
    for row in rows:
        peak = (f"{row['peak_memory_bytes'] / 2**30:.1f}" if row["peak_memory_bytes"]
                else "-")
        lines.append(f"{row['side']:<15} {row['tokens_per_second']:>10,.0f} "
                     f"{row['ratio']:>6.2f}x {row['seconds_per_call']:>7.2f} "
                     f"{row['warmup_seconds']:>9.1f} {peak:>9} "
                     f"{row['greedy_agreement']:>10.0%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=tuple(SUITES), default="cpu")
    parser.add_argument("--sides", default=None, help="comma-separated (default: the suite's)")
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/generation-<suite>.json")
    args = parser.parse_args()
    suite = dict(SUITES[args.suite])
    suite.update({k: v for k, v in (("calls", args.calls), ("new_tokens", args.new_tokens))
                  if v is not None})
    sides = args.sides.split(",") if args.sides else list(suite["sides"])
    if sides[0] != "dynamic":
        parser.error("--sides starts with dynamic: the others are measured against it")
    device = torch.device("cuda" if args.suite == "gpu" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--suite gpu needs a CUDA GPU")
    if device.type == "cpu" and any(s.endswith("static") for s in sides):
        parser.error("the static sides compile CUDA graphs: GPUs only")
    model = lora_model(suite["shape"], device)
    generator = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, suite["shape"].vocab or VOCABULARY,
                            (suite["rows"], suite["prompt"]), generator=generator).to(device)
    out = args.out or throughput.REPO / f"benchmarks/generation-{args.suite}.json"
    rows, reference = [], None
    for name in sides:
        print(f"sampling with {name} ...", flush=True)
        result, greedy = measure(name, model, prompts, suite, device, reference)
        reference = greedy if reference is None else reference
        result["ratio"] = result["tokens_per_second"] / (
            rows[0]["tokens_per_second"] if rows else result["tokens_per_second"])
        rows.append({**result, "suite": args.suite, "rows": suite["rows"],
                     "prompt_tokens": suite["prompt"], "new_tokens": suite["new_tokens"]})
        throughput.write_results(out, rows)  # after each: a run cut short keeps them
    print(f"\n{throughput.machine()}\n{table(rows)}\n\nwrote {out}")


if __name__ == "__main__":
    main()
