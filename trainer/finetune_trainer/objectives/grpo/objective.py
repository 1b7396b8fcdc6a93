"""GRPO's trainer side: prompts tokenised before the first step; at each generation round the
model samples `numGenerations` completions per prompt, the rewards score them, and the
micro-batches of prompt + completion rows carry each completion's advantage to the loss.

Generation is seeded per round and rank (`generation_seed`), in a forked RNG: a run resumed
from a checkpoint samples what the uninterrupted run sampled, and the seed of no other
component moves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import defaultdict

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GenerationConfig

from finetune_trainer import flops
from finetune_trainer.attention import forward_kwargs
from finetune_trainer.data import IGNORE, DataError
from finetune_trainer.data_files import local_path
from finetune_trainer.loading import load_for
from finetune_trainer.loss import loss_targets
from finetune_trainer.model import model_location
from finetune_trainer.objectives.base import Evaluation, Objective, PreparedData, RunContext
from finetune_trainer.objectives.grpo import loss as grpo_loss
from finetune_trainer.objectives.grpo.batches import GroupBatches
from finetune_trainer.objectives.grpo.rewards import load_rewards
from finetune_trainer.step_batch import StepBatch, StepWork

COMPLETIONS_FILE = "completions.jsonl"
"""In the output folder: each log step's latest round of completions, every rank's, with
their prompts, rewards and advantages (TRL's `log_completions`)."""

MICRO_FIGURES = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean")
"""What each micro-batch's loss reports, token-weighted over all ranks (TRL's names)."""


EVAL_SEED = 104_729
"""Evaluations sample from `generation_seed(seed + EVAL_SEED, call, rank)`: the same draws at
every evaluation of a run, none shared with a training round."""


def generation_seed(seed: int, round_index: int, rank: int) -> int:
    """The seed of rank `rank`'s sampling in generation round `round_index`."""
    return seed + 1_000_003 * round_index + 7_919 * rank


@dataclasses.dataclass
class Round:
    """One generation round of one rank: what its `iterations` steps train on."""

    index: int
    micro_batches: list[dict]
    units: int
    work: StepWork
    local_labels: int
    local_samples: int

    def state_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "work": list(self.work)}

    @classmethod
    def from_state(cls, state: dict) -> Round:
        return cls(**{**state, "work": StepWork(*state["work"])})


class GrpoObjective(Objective):
    """The clipped policy loss over sampled completions (`loss.token_losses`), summed as the
    loss type counts it (`loss.summed_loss`); its figures under TRL's names."""

    def __init__(self, config, spec) -> None:
        super().__init__(config, spec)
        self.settings = config.objective.settings()
        self.round: Round | None = None
        self.figures: dict[str, list[float]] = defaultdict(list)
        """The rounds' figures since the last log step (TRL's `reward`, ...)."""
        self.micro: list[torch.Tensor] = []
        """Per micro-batch: the sums of MICRO_FIGURES, the token count, and the lowest and
        highest per-completion clip fractions."""
        self.samples: list[dict] = []
        """This rank's completions of the latest round, for the next log step."""
        self.flat_round = False
        """Each group of the latest round was scored alike (frac_reward_zero_std 1)."""
        self.flat_steps = 0
        """Steps in a row trained on such rounds (`loss.flat_rewards_warning`)."""
        self.flat_warned = False

    # --- before the first step -------------------------------------------------------------

    def prepare(self, tokenizer, records, eval_records, fmt: str) -> PreparedData:
        """The prompts as token ids (a chat prompt through the template with the generation
        prompt; text as the tokenizer encodes it, as TRL does), each kept with its record's
        other columns for the rewards; the rewards imported."""
        data, grpo = self.config.dataset, self.settings
        workers = int(os.environ.get("WORLD_SIZE", "1"))
        for rule in self.spec.job_rules:  # as `finetune validate` says them
            if (problem := rule.problem(self.config, workers)) is not None:
                raise DataError(rule.field, problem, rule.fix)
        room = data.max_seq_length - grpo.max_completion_length
        folders = []  # a user's reward module ships beside the data, or in the image
        if data.location.scheme in ("path", "relative"):
            folder = local_path(data.uri, self.base_dir)
            folders.append(folder if folder.is_dir() else folder.parent)
        self.rewards = load_rewards(grpo.rewards, grpo.max_completion_length, folders)
        self.tokenizer = tokenizer
        self.chat = len(records) > 0 and isinstance(records[0]["prompt"], list)
        self.prompts, self.columns = [], []
        train, evaluation = self._prompt_rows(records, room), self._prompt_rows(eval_records, room)
        if not train:
            raise DataError(data.uri, "holds no prompt", "add records with a `prompt`")
        if data.eval_split is not None and not evaluation:
            raise DataError(data.eval_split, "holds no prompt",
                            "add records with a `prompt`, or remove spec.dataset.evalSplit")
        rows = [*train, *evaluation]
        cut = sum(row["cut"] for row in rows)
        notes = ((f"truncated {cut} of {len(rows)} prompts to {room} tokens (maxSeqLength "
                  f"{data.max_seq_length} minus maxCompletionLength "
                  f"{grpo.max_completion_length}), keeping their end",) if cut else ())
        for row in rows:
            del row["cut"]
        return PreparedData(train, evaluation, notes)

    def _prompt_rows(self, records, room: int) -> list[dict]:
        """One row a prompt (its last `room` tokens; `cut` when it had more), its record's
        other columns kept for the rewards (`prompt` holds its index there)."""
        rows = []
        for record in records:
            ids = self._prompt_ids(record["prompt"])
            kept = ids[-room:]
            rows.append({"input_ids": kept, "labels": [IGNORE] * len(kept),
                         "position_ids": list(range(len(kept))),
                         "prompt": [len(self.prompts)], "cut": len(ids) > room})
            self.prompts.append(record["prompt"])
            self.columns.append({k: v for k, v in record.items() if k != "prompt"})
        return rows

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            return list(self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        return list(self.tokenizer(text=str(prompt))["input_ids"])

    def units(self, sequence) -> int:
        return 0  # a step's units come from its completions (step_batch)

    def batches(self, count, micro_batch, accumulation, world, seed) -> GroupBatches:
        return GroupBatches(count, micro_batch, accumulation, world, seed,
                            generations=self.settings.num_generations,
                            iterations=self.settings.iterations)

    def summary(self, train) -> str:
        grpo = self.settings
        rewards = ", ".join(f"{r.name} x {r.weight:g}" for r in self.rewards)
        kl = f", beta {grpo.beta:g}" if grpo.beta else ""
        return (f"objective grpo ({grpo.loss}{kl}): {len(train)} prompts, "
                f"{grpo.num_generations} completions each of up to "
                f"{grpo.max_completion_length} tokens, rewards {rewards}")

    def attach(self, run: RunContext) -> None:
        """The generation settings, and the reference where beta > 0: the base with its
        adapters off, or for full weights the model as it was read (loaded again: a resumed
        run's weights have moved)."""
        super().attach(run)
        grpo, tokenizer = self.settings, self.tokenizer
        model = run.strategy.unwrapped()
        self.pad_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                       else tokenizer.eos_token_id)
        eos = model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
        self.eos_ids = list(dict.fromkeys([tokenizer.eos_token_id, *eos]))
        self.generation = GenerationConfig(
            max_new_tokens=grpo.max_completion_length, do_sample=True,
            pad_token_id=self.pad_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=self.eos_ids, temperature=grpo.temperature, top_p=grpo.top_p,
            top_k=0, disable_compile=True)
        self.reference_model = None
        if grpo.beta and self.config.method.type == "full":
            self.reference_model = self._frozen_reference(run)

    def _frozen_reference(self, run: RunContext):
        """Under fsdp and zero3 read as the trained model was (every rank building it
        empty, rank 0 reading and sending the weights) and sharded as it is: each process
        holds its shard of the reference too. Elsewhere a whole copy in the compute dtype."""
        strategy = run.strategy
        if strategy.shards_weights:
            model, weights = load_for(strategy, self.config.model, self.config.method,
                                      self.config.strategy.precision, False, self.base_dir,
                                      device=strategy.device)
            return strategy.frozen(model, weights)
        reference = AutoModelForCausalLM.from_pretrained(
            model_location(self.config.model, self.base_dir), dtype=torch.float32)
        reference.to(device=run.strategy.device, dtype=run.strategy.compute_dtype)
        return reference.eval().requires_grad_(False)

    # --- at each step ----------------------------------------------------------------------

    def load(self, sequences):
        return sequences  # prompts: sampled on the training thread, at the step

    def step_batch(self, key, mine, loaded) -> StepBatch:
        epoch, step = key
        index = (epoch * self.run.batches.steps_per_epoch + step) // self.settings.iterations
        if self.round is None or self.round.index != index:
            self.round = self._sample(index, [row for micro in loaded for row in micro])
        r = self.round
        self.flat_steps = self.flat_steps + 1 if self.flat_round else 0
        return StepBatch(r.micro_batches, r.units, r.work, r.local_labels, r.local_samples)

    def _sample(self, index: int, rows: list[dict]) -> Round:
        """Sample this rank's completions, score every rank's, and lay out the micro-batches
        (shuffled as TRL shuffles a generation batch before splitting it)."""
        grpo = self.settings
        rank, world = dist.get_rank(), dist.get_world_size()
        prompts = [row["input_ids"] for row in rows]
        completions, order = self._generate(prompts, generation_seed(
            self.config.hyperparameters.seed, index, rank))
        indices = [row["prompt"][0] for row in rows]
        texts, scores = self._scored(indices, completions)
        local = torch.tensor([[*(s[j] for s in scores), len(completions[j]),
                               self._clipped(completions[j]), len(prompts[j])]
                              for j in range(len(rows))], dtype=torch.float64)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=self.run.group)
        every = torch.cat(gathered)
        count = len(self.rewards)
        scored = grpo_loss.score(every[:, :count], [r.name for r in self.rewards],
                                 [r.weight for r in self.rewards], grpo.num_generations,
                                 grpo.scale_rewards)
        lengths = [int(n) for n in every[:, count]]
        for name, value in {**grpo_loss.length_figures(
                lengths, [bool(c) for c in every[:, count + 1]]), **scored.figures}.items():
            self.figures[name].append(value)
        self.flat_round = scored.figures["frac_reward_zero_std"] == 1.0
        advantages = scored.advantages[rank * len(rows):(rank + 1) * len(rows)]
        self._keep_samples(index, [self.prompts[i] for i in indices], texts, scores,
                           advantages.tolist())
        sequences = [{"input_ids": prompts[j] + completions[j],
                      "labels": [IGNORE] * len(prompts[j]) + completions[j],
                      "position_ids": list(range(len(prompts[j]) + len(completions[j]))),
                      "advantage": float(advantages[j])} for j in order]
        micro = self.config.hyperparameters.micro_steps()[0]
        batches = [self._collate(sequences[i:i + micro])
                   for i in range(0, len(sequences), micro)]
        tokens, prompt_tokens = sum(lengths), int(every[:, count + 2].sum())
        units = {"dapo": tokens, "bnpo": len(batches) * world}.get(grpo.loss, len(lengths))
        inputs = [int(p) + n for p, n in zip(every[:, count + 2], lengths, strict=True)]
        work = StepWork(labels=tokens, inputs=tokens + prompt_tokens, sequences=len(lengths),
                        attended=sum(n * (n + 1) // 2 for n in inputs),
                        full_rows=sum(flops.full_row_pairs(n) for n in inputs))
        if grpo.iterations > 1 or grpo.beta:
            self._score_before_steps(batches)
        return Round(index, batches, units, work, sum(len(c) for c in completions), len(rows))

    def _clipped(self, completion: list[int]) -> bool:
        """Cut at maxCompletionLength, never ended."""
        return not completion or completion[-1] not in self.eos_ids

    def _scored(self, indices: list[int], completions: list[list[int]]
                ) -> tuple[list[str], list[list[float]]]:
        """The completions of the prompts at `indices` as text, and each reward's scores
        of them (NaN where a reward returned None), handed the records' other columns."""
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        said = [[{"role": "assistant", "content": t}] for t in texts] if self.chat else texts
        columns = {name: [self.columns[i][name] for i in indices] for name in self.columns[0]}
        return texts, [reward.score([self.prompts[i] for i in indices], said, completions,
                                    columns) for reward in self.rewards]

    def evaluate(self, sequences) -> Evaluation | None:
        """The held-out prompts, each answered `numGenerations` times by the weights as they
        are (sampled as a training round is, from seeds fixed for the run: evaluations at
        different steps differ by the weights, not the draw) and scored by the rewards; the
        figures of a training round under TRL's names (`reward`, `rewards/<name>/mean`,
        `completions/mean_length`, ...). No loss: GRPO's centres on each group's mean and
        says nothing of progress. Each process answers whole groups, in batches of a
        round's size; under fsdp and zero3 every process makes as many `generate` calls
        (each is collective), one without prompts left answering the first one again."""
        if not sequences:
            return None
        grpo, hp = self.settings, self.config.hyperparameters
        rank, world = dist.get_rank(), dist.get_world_size()
        groups = grpo.num_generations
        requests = [row for row in sequences[rank::world] for _ in range(groups)]
        size = hp.batch_size_per_device * hp.gradient_accumulation_steps
        most = math.ceil(len(sequences) / world) * groups  # completions: rank 0's share
        calls = math.ceil(most / size)
        completions: list[list[int]] = []
        for call in range(calls):
            part = requests[call * size:(call + 1) * size]
            if not part and not self.strategy.shards_weights:
                break
            made, _ = self._generate([row["input_ids"] for row in part or sequences[:1]],
                                     generation_seed(hp.seed + EVAL_SEED, call, rank))
            completions += made if part else []
        indices = [row["prompt"][0] for row in requests]
        _, scores = self._scored(indices, completions)
        count = len(self.rewards)
        local = torch.full((most, count + 3), math.nan, dtype=torch.float64)
        for j, completion in enumerate(completions):  # the last column: a row answered
            local[j] = torch.tensor([*(s[j] for s in scores), len(completion),
                                     self._clipped(completion), 1.0], dtype=torch.float64)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=self.run.group)
        every = torch.cat(gathered)
        every = every[every[:, count + 2] == 1.0]  # whole groups, each process's in turn
        scored = grpo_loss.score(every[:, :count], [r.name for r in self.rewards],
                                 [r.weight for r in self.rewards], groups, grpo.scale_rewards)
        lengths = grpo_loss.length_figures([int(n) for n in every[:, count]],
                                           [bool(c) for c in every[:, count + 1]])
        return Evaluation(None, {**lengths, **scored.figures})

    def _keep_samples(self, index: int, prompts: list, texts: list[str],
                      scores: list[list[float]], advantages: list[float]) -> None:
        """This rank's completions of the round, with their rewards and advantages, kept for
        the next log step (which gathers every rank's: `completions.jsonl` in the output
        folder, TRL's `log_completions`, and a few in the log)."""
        names = [reward.name for reward in self.rewards]
        step = index * self.settings.iterations + 1
        self.samples = [{"step": step, "prompt": prompt, "completion": text,
                         "advantage": round(advantage, 6),
                         "rewards": {n: (None if math.isnan(v[j]) else v[j]) for n, v in zip(
                             names, scores, strict=True)}}
                        for j, (prompt, text, advantage) in enumerate(zip(
                            prompts, texts, advantages, strict=True))]

    def _generate(self, prompts: list[list[int]], seed: int
                  ) -> tuple[list[list[int]], list[int]]:
        """Each prompt's completion (up to and including its end of text), sampled in one
        batch, left-padded; and the order the rows are shuffled into."""
        strategy = self.strategy
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model = strategy.unwrapped()
        devices = [strategy.device] if strategy.device.type == "cuda" else []
        was_training = model.training
        model.eval()  # no dropout while sampling
        # compiled layers run eagerly here: each decoding step's shapes differ (the cache
        # grows a token) and would recompile them (CPU, tiny model, compile on: a timed step
        # 0.86 s with compiled sampling, 0.73 s with eager; benchmarks/throughput.py cpu-grpo)
        with (torch.random.fork_rng(devices=devices), torch.no_grad(), strategy.autocast(),
              strategy.generating(), torch.compiler.set_stance("force_eager")):
            torch.manual_seed(seed)
            out = model.generate(input_ids=ids.to(strategy.device),
                                 attention_mask=mask.to(strategy.device),
                                 generation_config=self.generation,
                                 synced_gpus=strategy.shards_weights)
            order = torch.randperm(len(prompts)).tolist()
        model.train(was_training)
        completions = []
        for row in out[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token in self.eos_ids]
            completions.append(row[:ends[0] + 1] if ends else row)
        return completions, order

    def _collate(self, sequences: list[dict]) -> dict:
        batch = self.run.collation.tensors(sequences)
        if "loss_rows" not in batch:
            batch.update(loss_targets(batch["labels"]))
        width = batch["input_ids"].shape[1]
        batch["token_rows"] = torch.div(batch["loss_rows"], width, rounding_mode="floor")
        batch["advantages"] = torch.tensor([s["advantage"] for s in sequences])
        return batch

    def _score_before_steps(self, batches: list[dict]) -> None:
        """The sampling model's log-probabilities (for the ratio of a round's later steps)
        and the reference's (for the KL), without gradients, once per round."""
        device = self.strategy.device
        with torch.no_grad():
            for batch in batches:
                on_device = {k: v.to(device) for k, v in batch.items()}
                with self.strategy.autocast():
                    if self.settings.iterations > 1:
                        batch["old_logps"] = self._logps(self.strategy.model, on_device)[0].cpu()
                    if self.settings.beta:
                        batch["reference_logps"] = self._reference_logps(on_device).cpu()

    def _reference_logps(self, batch) -> torch.Tensor:
        if self.reference_model is not None:
            return self._logps(self.reference_model, batch)[0]
        with self.strategy.unwrapped().disable_adapter():
            return self._logps(self.strategy.model, batch)[0]

    def _logps(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each completion token's log-probability at the sampling temperature, and the
        entropy there (no gradient)."""
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False, **forward_kwargs(batch)).logits
        picked = logits.flatten(0, 1).index_select(0, batch["loss_rows"]).float()
        logps = (picked / self.settings.temperature).log_softmax(-1)
        chosen = logps.gather(1, batch["loss_targets"][:, None]).squeeze(1)
        with torch.no_grad():
            entropy = -(logps.exp() * logps).sum(-1)
        return chosen, entropy

    def summed(self, batch):
        grpo = self.settings
        logps, entropy = self._logps(self.strategy.model, batch)
        rows = batch["token_rows"]
        losses = grpo_loss.token_losses(logps, batch.get("old_logps"),
                                        batch.get("reference_logps"),
                                        batch["advantages"].to(logps.dtype)[rows], grpo)
        completions = batch["advantages"].shape[0]
        with torch.no_grad():
            region = torch.maximum(losses.low, losses.high)
            kl = losses.kl.detach().sum() if losses.kl is not None else logps.new_zeros(())
            lengths = torch.bincount(rows, minlength=completions).clamp(min=1)

            def per_completion(x):
                return torch.zeros(completions, device=x.device).index_add(0, rows, x) / lengths

            self.micro.append(torch.stack([
                kl, entropy.sum(), losses.low.sum(), losses.high.sum(), region.sum(),
                logps.new_tensor(float(rows.shape[0])), per_completion(losses.low).min(),
                per_completion(losses.high).max()]).double())  # to the host at the log step
        return grpo_loss.summed_loss(losses.losses, rows, completions, grpo), None

    def state_dict(self) -> dict:
        """The round in progress (a checkpoint inside a round of `iterations` > 1 resumes
        on its completions and their sampling log-probabilities: sampled again, they would
        come from the moved weights) and what the next log step reports of the rounds and
        micro-batches since the last one."""
        if self.round is None:
            return {}
        return {"world": dist.get_world_size(), "round": self.round.state_dict(),
                "figures": dict(self.figures), "micro": [m.cpu() for m in self.micro],
                "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        """Taken back only by the same number of ranks (a round is one rank's share of a
        generation batch); otherwise the round in progress is sampled again, with a line
        saying so."""
        if not state:
            return
        if state["world"] != dist.get_world_size():
            if self.run.step % self.settings.iterations:
                self.run.say(f"resuming inside a generation round with {dist.get_world_size()}"
                             f" processes where {state['world']} sampled it: the round is "
                             "sampled again with the resumed weights")
            return
        self.round = Round.from_state(state["round"])
        self.figures.update(state["figures"])
        self.micro = [m.to(self.strategy.device) for m in state["micro"]]
        self.samples = state["samples"]

    def _write_samples(self, samples: list[dict]) -> None:
        """The latest round's completions appended to `completions.jsonl`; the first
        `logCompletions` said in the log."""
        with (self.run.output_dir / COMPLETIONS_FILE).open("a", encoding="utf-8") as handle:
            for row in samples:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        shown = samples[:self.settings.log_completions]
        if shown:
            lines = [f"  {row['completion']!r} → " + ", ".join(
                f"{name} {value:g}" if value is not None else f"{name} n/a"
                for name, value in row["rewards"].items()) for row in shown]
            print(f"sampled at step {shown[0]['step']} (all in {COMPLETIONS_FILE}):\n"
                  + "\n".join(lines), flush=True)

    def logged(self, sums, units) -> dict[str, float]:
        """The window's figures: each round's and each micro-batch's (over all ranks),
        averaged as TRL averages them; the latest round's samples printed; once, a warning
        when the rewards have told no completion from another for many steps."""
        out = {name: sum(values) / len(values) for name, values in self.figures.items()}
        if self.micro:
            micro = torch.stack(self.micro).cpu()
            sums_ = micro[:, :6].clone()
            low, high = micro[:, 6].clone(), micro[:, 7].clone()
            dist.all_reduce(sums_, group=self.run.group)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.run.group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.run.group)
            means = sums_[:, :5] / sums_[:, 5:6].clamp(min=1)
            for column, name in enumerate(MICRO_FIGURES):
                if name == "kl" and not self.settings.beta:
                    continue
                out[name] = means[:, column].mean().item()
            out["clip_ratio/low_min"] = low.mean().item()
            out["clip_ratio/high_max"] = high.mean().item()
        if self.samples:  # every rank has sampled, or none has
            every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(self.samples, every, dst=0, group=self.run.group)
            if every is not None:
                self._write_samples([row for part in every for row in part])
        self.figures.clear()
        self.micro.clear()
        self.samples = []
        warning = grpo_loss.flat_rewards_warning(self.flat_steps)
        if warning is not None and not self.flat_warned:  # just above the step's line
            self.flat_warned = True
            self.run.say(warning)
        return out
