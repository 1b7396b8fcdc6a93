"""A tiny Llama-architecture model and tokenizer, made locally.

Nothing can be downloaded in CI or in `make demo`, so both are built here and saved with
`save_pretrained`; everything downstream loads them through the real `from_pretrained`
path, exactly as it would load a hub model.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from finetune_trainer.generate import quiet_libraries

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|begin|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 512, show_progress: bool = False):
    """A byte-level BPE tokenizer trained on `corpus`, with a chat template (`show_progress`:
    the trainer's bars, on stdout; blank lines where that is no terminal)."""
    # after main's quiet_libraries (generate.py): transformers reads its settings on import
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>",
                                        eos_token="<|end|>", bos_token="<|begin|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def corpus_from_jsonl(path: str | Path) -> list[str]:
    """Every string in a JSONL file (message contents, prompts, responses, text)."""
    texts: list[str] = []

    def collect(value: object) -> None:
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, list):
            for item in value:
                collect(item)

    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            collect(json.loads(line))
    return texts


def build_tiny_llama(out_dir: str | Path, corpus: Iterable[str], *, hidden_size: int = 64,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                     show_progress: bool = False) -> Path:
    """Save a randomly initialised tiny Llama and its tokenizer to `out_dir`."""
    import torch  # as in build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(corpus, show_progress=show_progress)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny local model for demos and tests.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--corpus", type=Path, required=True,
                        help="JSONL whose strings train the tokenizer")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the libraries' progress bars and warnings")
    args = parser.parse_args(argv)
    if (args.out_dir / "config.json").is_file():
        print(f"{args.out_dir} already holds a model")
        return 0
    quiet_libraries(args.verbose)
    build_tiny_llama(args.out_dir, corpus_from_jsonl(args.corpus), show_progress=args.verbose)
    print(f"built a tiny Llama and its tokenizer in {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
