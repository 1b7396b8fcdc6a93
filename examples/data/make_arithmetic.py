"""Writes arithmetic.jsonl, the prompts of examples/09-grpo-arithmetic.yaml.

Sums and differences of small numbers, each with its answer, so a reward can check a
completion without a judge. Seeded, so the file is the same on every machine.

    python examples/data/make_arithmetic.py                  # 200 records, seed 0
    python examples/data/make_arithmetic.py --count 1000 --seed 1 --out /tmp/more.jsonl

Each line is {"prompt": [{"role": "user", "content": "What is 17 + 25? Answer with the
number only."}], "answer": "42"}: a chat prompt (the model writes the assistant's turn) and
the answer the rewards compare against. Differences never go below zero.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def records(count: int, seed: int, largest: int = 50) -> list[dict]:
    """`count` questions on numbers 0..`largest`, half additions and half subtractions."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, largest), rng.randint(0, largest)
        if rng.random() < 0.5:
            question, answer = f"{a} + {b}", a + b
        else:
            a, b = max(a, b), min(a, b)  # a non-negative answer
            question, answer = f"{a} - {b}", a - b
        content = f"What is {question}? Answer with the number only."
        out.append({"prompt": [{"role": "user", "content": content}], "answer": str(answer)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200, help="records to write (200)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("arithmetic.jsonl"),
                        help="where to write (arithmetic.jsonl beside this script)")
    args = parser.parse_args()
    with args.out.open("w", encoding="utf-8") as file:
        for record in records(args.count, args.seed):
            file.write(json.dumps(record) + "\n")
    print(f"wrote {args.count} records to {args.out}")


if __name__ == "__main__":
    main()
