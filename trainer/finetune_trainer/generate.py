"""Smoke-test an exported model: `python -m finetune_trainer.generate DIR "question"`.

DIR is what a run exported (`final/` or `merged/`): a peft adapter or a full model.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from pathlib import Path


def quiet_libraries(verbose: bool) -> None:
    """Unless `verbose`, the libraries' progress bars, warnings and notices off, as a plain
    `finetune run` shows none (`finetune_operator.local`: `processes.worker_env`,
    `logs.QuietLog`): before transformers and huggingface_hub are imported, which read these
    variables then; a variable set already is kept."""
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars too
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations in transformers
    # DeepSpeed, imported by accelerate's save and load, logs that it found no GPU; its
    # logger's level is set on import, a filter stays
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)


def answer(model_dir: Path, question: str, max_new_tokens: int = 32) -> str:
    # after main's quiet_libraries: transformers reads its settings when imported
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (model_dir / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM  # as above; a full model needs no peft

        model = AutoPeftModelForCausalLM.from_pretrained(model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        output = model.eval().generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("question")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the libraries' progress bars and warnings")
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file() and not (
            args.model_dir / "adapter_config.json").is_file():
        # else transformers takes the path for a hub name: a minute of retries, a traceback
        what = "does not exist" if not args.model_dir.exists() else (
            "holds neither config.json nor adapter_config.json")
        parser.error(f"{args.model_dir} {what}: name what a run exported, its final/ or "
                     "merged/ folder")
    quiet_libraries(args.verbose)
    print(answer(args.model_dir, args.question, args.max_new_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
