"""The peers: Hugging Face `transformers.Trainer`, or TRL's `SFTTrainer`, `DPOTrainer` or
`GRPOTrainer`, on the same model, data and settings.

Started under torchrun by benchmarks/throughput.py (`--config FILE`, the same trainer
config our trainer reads; `--peer trainer|sft|sft-liger|dpo|grpo`). The samples are tokenised
by our own data module, so every side trains on identical token sequences (preference pairs
and prompts excepted: DPOTrainer and GRPOTrainer take text). Each peer then does what its
users do:

- `Trainer`: one sample per row, padded to the longest in the batch
  (DataCollatorForSeq2Seq), labels -100 on padding.
- `SFTTrainer`: its own packing when the config packs (best-fit decreasing into
  max-length rows, padding-free, position ids restarting per sample), its fused output
  layer over the trained positions, LoRA through its `peft_config`; otherwise its padding
  collator.
- `SFTTrainer` with Liger kernels (`--peer sft-liger`, `use_liger_kernel=True`; needs
  `liger-kernel` and a GPU): Triton kernels for RMSNorm, RoPE, SwiGLU and a fused linear
  cross-entropy, what speed-conscious TRL users switch on.
- `DPOTrainer` (`--peer dpo`, the config's `objective.dpo` as its beta, loss_type and
  label_smoothing): the config's preference records as its `prompt`/`chosen`/`rejected`
  text rows, tokenised by itself (prompt, prompt + answer + EOS, the answer after the
  common prefix, as ours does; ours also starts the prompt with BOS where the tokenizer
  adds none), `max_length` the config's maxSeqLength (per prompt + answer, as ours); each
  batch `per_device_train_batch_size` pairs (`--batch-per-device` where the benchmark
  matches ours' pairs per step), chosen and rejected rows padded to the longest (its
  padding-free mode is switched off in TRL 1.16), its chunked log-probability head; the
  reference from a second forward at every step, with the adapters switched off under
  LoRA (`precompute_ref_log_probs=False`, its default), or taken once before training
  where the config's `precomputeRefLogProbs` says so, as ours then does.
- `GRPOTrainer` (`--peer grpo`, the config's `objective.grpo`): the config's prompt records
  as its text `prompt` rows with their other columns, the config's rewards as its reward
  functions (our built-ins, called as it calls any), completions sampled by transformers
  `generate` (its default engine, ours too), `per_device_train_batch_size` completions
  per device as ours counts `batchSizePerDevice`.

Writes a JSON result (label tokens/s over the timed steps, step time, peak memory) on
rank 0. Label tokens are counted as ours counts them: each trained position, both answers
of a preference pair, each completion token of a GRPO round (and beside it TRL's own
`completions/mean_length` x completions, `logged_tokens_per_step`); the reference's forward
and sampling (no grad) are not counted as work.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from transformers import TrainerCallback


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--peer", choices=("trainer", "sft", "sft-liger", "dpo", "grpo"),
                        default="trainer")
    parser.add_argument("--batch-per-device", type=int, default=None,
                        help="instead of the config's batchSizePerDevice")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="on, whatever the config says (a peer that would not fit "
                        "without it)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import (
        AutoModelForCausalLM,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
    )

    from finetune_trainer import flops
    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.data import IGNORE, read_records, resolve_format, tokenize_records
    from finetune_trainer.model import load_tokenizer

    config = TrainerConfig.load(args.config)
    base = args.config.parent
    hp, strategy = config.hyperparameters, config.strategy
    if args.gradient_checkpointing:
        strategy = strategy.model_copy(update={"gradient_checkpointing": True})
    tokenizer = load_tokenizer(config.model, base)
    records = read_records(config.dataset, base)
    fmt = resolve_format(config.dataset.format, records.column_names)
    if {"preference": "dpo", "prompt": "grpo"}.get(fmt) != (
            args.peer if args.peer in ("dpo", "grpo") else None):
        raise SystemExit(f"--peer {args.peer} does not train on {fmt} data")
    if fmt == "preference":  # DPOTrainer tokenises the text itself
        train = [{side: record[side] for side in ("prompt", "chosen", "rejected")}
                 for record in records]
    elif fmt == "prompt":  # so does GRPOTrainer, and it hands the other columns to rewards
        train = list(records)
    else:
        samples = tokenize_records(records, fmt, tokenizer, config.dataset.max_seq_length)
        train = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]

    gpu = torch.cuda.is_available()
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        strategy.precision]
    # as ours: full fine-tunes keep fp32 master weights under autocast; adapters train on
    # a base held in the compute dtype; QLoRA's base is 4-bit NF4 (the same settings)
    kwargs = {"attn_implementation": "sdpa",
              "dtype": compute if gpu and config.method.type != "full" else torch.float32}
    if config.method.type == "qlora":
        from finetune_trainer.model import _four_bit

        kwargs["quantization_config"] = _four_bit(compute)
    model = AutoModelForCausalLM.from_pretrained(config.model.uri, **kwargs)
    if config.method.type == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=strategy.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    adapters = None
    if config.method.type in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        lora = config.method.lora
        adapters = LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=lora.target_modules if lora.target_modules != ["all-linear"]
            else "all-linear", task_type="CAUSAL_LM")
        if args.peer == "trainer":
            model = get_peft_model(model, adapters)

    timing = StepTiming(args.warmup_steps)
    settings = dict(
        output_dir=str(args.result.parent / f"{args.peer}-output"),
        per_device_train_batch_size=args.batch_per_device or hp.batch_size_per_device,
        gradient_accumulation_steps=hp.gradient_accumulation_steps,
        max_steps=hp.max_steps, learning_rate=hp.resolved_learning_rate(config.method.type),
        warmup_steps=int(hp.warmup_ratio * hp.max_steps), lr_scheduler_type=hp.scheduler,
        weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm, seed=hp.seed,
        bf16=gpu and strategy.precision == "bf16", fp16=gpu and strategy.precision == "fp16",
        gradient_checkpointing=strategy.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        use_cpu=not gpu, ddp_backend=None if gpu else "gloo",
        dataloader_num_workers=0, report_to=[], save_strategy="no", logging_steps=10**9,
        disable_tqdm=True, remove_unused_columns=False, optim="adamw_torch_fused" if gpu
        else "adamw_torch")
    if args.peer == "dpo":
        trainer = dpo_trainer(config, model, train, tokenizer, adapters, timing, settings)
    elif args.peer == "grpo":
        trainer = grpo_trainer(config, model, train, tokenizer, adapters, timing, settings)
    elif args.peer.startswith("sft"):
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(
            model=model, train_dataset=Dataset.from_list(train), processing_class=tokenizer,
            peft_config=adapters, callbacks=[timing], args=SFTConfig(
                **settings, packing=config.dataset.packing,
                max_length=config.dataset.max_seq_length,
                use_liger_kernel=args.peer == "sft-liger"))
    else:
        collator = DataCollatorForSeq2Seq(tokenizer, padding="longest",
                                          label_pad_token_id=IGNORE)
        trainer = Trainer(model=model, args=TrainingArguments(**settings),
                          train_dataset=train, data_collator=collator, callbacks=[timing])
    # on the model each peer calls (SFTTrainer and DPOTrainer wrap it in PEFT themselves)
    trainer.model.register_forward_pre_hook(timing.count, with_kwargs=True)
    trainer.train()

    label_tokens, input_tokens, attended = all_ranks_sum(
        [timing.timed_tokens, timing.timed_inputs, timing.timed_attended])
    logged = {"logged_tokens_per_step": timing.logged_tokens / max(timing.timed_steps, 1)
              } if args.peer == "grpo" else {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    peak = (torch.cuda.max_memory_allocated() if gpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if not dist.is_initialized() or dist.get_rank() == 0:
        seconds = timing.timed_seconds
        mfu = None
        peak_flops = gpu and flops.peak_flops(torch.cuda.get_device_name())
        if peak_flops and seconds:
            # as ours counts: the pairs each document attends, the reference's forward
            params, frozen, layers, width = flops.model_shape(trainer.model)
            referenced = (args.peer == "dpo" and not config.objective.settings()
                          .precompute_ref_log_probs) or (
                args.peer == "grpo" and config.objective.settings().beta > 0)
            reference = frozen if referenced and adapters is not None else 0.0
            work = flops.ModelWork.of(params, frozen, layers, width, reference)
            mfu = work.flops(input_tokens, attended) / seconds / (peak_flops * world)
        args.result.write_text(json.dumps({
            "tokens_per_second": label_tokens / seconds if seconds else 0.0, "mfu": mfu,
            "input_tokens_per_second": input_tokens / seconds if seconds else 0.0,
            "step_seconds": seconds / max(timing.timed_steps, 1),
            "tokens_per_step": label_tokens / max(timing.timed_steps, 1),
            "timed_steps": timing.timed_steps, "peak_memory_bytes": int(peak), **logged}))


def dpo_trainer(config, model, rows: list[dict], tokenizer, adapters, timing, settings: dict):
    """TRL's DPOTrainer as its users run it, on the config's pairs and DPO settings."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    dpo = config.objective.settings()
    if config.objective.type != "dpo":
        raise SystemExit("--peer dpo needs a config with objective.type dpo")
    if dpo.loss == "sigmoid" and dpo.label_smoothing:
        # TRL 1.16's sigmoid loss leaves label_smoothing out (its robust and exo_pair use it)
        print(f"note: DPOTrainer's sigmoid loss ignores label_smoothing "
              f"{dpo.label_smoothing:g}", file=sys.stderr)
    return DPOTrainer(
        model=model, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        peft_config=adapters, callbacks=[timing], args=DPOConfig(
            **{**settings, "remove_unused_columns": True},  # its default: the ids alone
            max_length=config.dataset.max_seq_length, beta=dpo.beta, loss_type=[dpo.loss],
            label_smoothing=dpo.label_smoothing,
            precompute_ref_log_probs=dpo.precompute_ref_log_probs))


def grpo_trainer(config, model, rows: list[dict], tokenizer, adapters, timing, settings: dict):
    """TRL's GRPOTrainer as its users run it, on the config's prompts, rewards and GRPO
    settings."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from finetune_trainer.objectives.grpo.rewards import load_rewards

    if config.objective.type != "grpo":
        raise SystemExit("--peer grpo needs a config with objective.type grpo")
    grpo = config.objective.settings()
    rewards = load_rewards(grpo.rewards, grpo.max_completion_length, [])

    def reward_function(reward):
        def score(prompts, completions, completion_ids, **columns):
            names = [name for name in columns if name not in ("trainer_state", "log_extra",
                                                              "log_metric")]
            values = reward.score(prompts, completions, completion_ids,
                                  {name: columns[name] for name in names})
            return [None if value != value else value for value in values]  # NaN: None
        score.__name__ = reward.name
        return score

    return GRPOTrainer(
        model=model, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        peft_config=adapters, callbacks=[timing],
        reward_funcs=[reward_function(reward) for reward in rewards], args=GRPOConfig(
            **{**settings, "logging_steps": 1},  # TRL's own completion lengths, per step
            num_generations=grpo.num_generations,
            max_completion_length=grpo.max_completion_length, temperature=grpo.temperature,
            top_p=grpo.top_p, beta=grpo.beta, epsilon=grpo.epsilon,
            epsilon_high=grpo.epsilon_high or grpo.epsilon, loss_type=grpo.loss,
            scale_rewards=grpo.scale_rewards, num_iterations=grpo.iterations,
            reward_weights=[reward.weight for reward in rewards]))


def collective_device(backend: str, local_rank: int) -> str:
    """Where a tensor must live for `backend`'s collectives: nccl serves GPU tensors only
    (a CPU tensor fails: "No backend type associated with device type cpu"), gloo CPU."""
    return f"cuda:{local_rank}" if backend == "nccl" else "cpu"


def all_ranks_sum(values: list[float]) -> list[float]:
    import os

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return list(values)
    device = collective_device(dist.get_backend(), int(os.environ.get("LOCAL_RANK", "0")))
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


class StepTiming(TrainerCallback):
    """Wall time of the steps after the warm-up, and the label tokens the model trained on
    in them (counted in a forward pre-hook, so the dataloader's read-ahead does not
    matter)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.step = warmup, 0
        self.timed_tokens = self.timed_inputs = self.timed_steps = self.timed_attended = 0
        self.logged_tokens = 0.0
        self.timed_seconds, self.started = 0.0, None

    def count(self, module, args, kwargs) -> None:
        import torch

        labels, mask = kwargs.get("labels"), kwargs.get("attention_mask")
        if self.started is None or not torch.is_grad_enabled():
            return  # DPOTrainer's reference and GRPOTrainer's sampling run without grad
        if labels is not None:  # GRPOTrainer's: the completion's tokens (its fused head)
            self.timed_tokens += int((labels[:, 1:] != -100).sum())
            self.timed_inputs += int(mask.sum()) if mask is not None else labels.numel()
            self.timed_attended += attended(kwargs.get("position_ids"), mask, labels)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.step == self.warmup and self.started is None:
            _sync()
            self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step += 1
        if self.started is not None:
            self.timed_steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        """GRPOTrainer's own count of a timed step's completion tokens (logged every step:
        the mean length over all ranks' completions), to hold the hook's count against."""
        if self.started is not None and logs and "completions/mean_length" in logs:
            completions = args.per_device_train_batch_size * args.world_size
            self.logged_tokens += logs["completions/mean_length"] * completions

    def on_train_end(self, args, state, control, **kwargs):
        _sync()
        if self.started is not None:
            self.timed_seconds = time.perf_counter() - self.started


def attended(positions, mask, labels) -> int:
    """Query-key pairs the forward's causal attention computes within documents: from the
    position ids of a padding-free row, else each row's unpadded length (one document)."""
    from finetune_trainer.flops import attended_pairs

    if positions is not None:
        return sum(attended_pairs(row) for row in positions.tolist())
    lengths = mask.sum(1).tolist() if mask is not None else [labels.shape[1]] * len(labels)
    return sum(n * (n + 1) // 2 for n in lengths)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
