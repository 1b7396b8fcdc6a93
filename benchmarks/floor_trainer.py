"""The host-memory floor for a full fine-tune: the same job's samples (tokenised by our
data module), the model read in fp32, torch's AdamW, one row per sample as
transformers.Trainer batches them; no process group, checkpoint or export. What any
trainer must hold; whatever ours holds beyond it is ours to justify
(tests/trainer/test_host_memory.py).

    python benchmarks/floor_trainer.py --config JOB.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.data import (
        collate,
        one_per_sequence,
        read_records,
        resolve_format,
        tokenize_records,
    )
    from finetune_trainer.model import load_tokenizer

    config = TrainerConfig.load(args.config)
    base, hp = args.config.parent, config.hyperparameters
    tokenizer = load_tokenizer(config.model, base)
    records = read_records(config.dataset, base)
    fmt = resolve_format(config.dataset.format, records.column_names)
    rows = one_per_sequence(tokenize_records(records, fmt, tokenizer,
                                             config.dataset.max_seq_length))
    model = AutoModelForCausalLM.from_pretrained(config.model.uri, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp.learning_rate or 1e-4)
    size = hp.batch_size_per_device
    for step in range(hp.max_steps):
        start = step * size % max(len(rows) - size + 1, 1)
        batch = collate(rows[start:start + size], tokenizer.pad_token_id)
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
              labels=batch["labels"], use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
