"""From a FineTuneJob to a plan: per-GPU memory on the GPU it asks for, a verdict, and the
cheapest configuration that fits. Pure: the model's config is handed in."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from finetune_operator import gpu_catalog as catalog
from finetune_operator.api import FineTuneJob
from finetune_operator.gpu_catalog import VmSize
from finetune_operator.planner.architecture import ConfigError, ModelShape, from_hf_config
from finetune_operator.planner.compute import COMPILE_SPEEDUP, Throughput, estimate_throughput
from finetune_operator.planner.disk import estimate_disk, stored_bytes_per_param
from finetune_operator.planner.host import HostMemoryEstimate, estimate_host_memory
from finetune_operator.planner.memory import (
    CheckpointPolicy,
    MemoryEstimate,
    Precision,
    Strategy,
    TrainingSetup,
    estimate_memory,
)
from finetune_operator.planner.sources import ModelConfig, from_table
from finetune_operator.validation import setting_errors
from finetune_trainer import layout
from finetune_trainer.config import Hyperparameters, LoraConfig, StrategyConfig
from finetune_trainer.objectives import spec_of

HEADROOM = 0.10
"""A recommendation leaves this fraction of GPU memory free (allocator fragmentation,
longer-than-average batches, the estimate's own error of about ±15%)."""
AUTO_ORDER: tuple[Strategy, ...] = ("ddp", "zero1", "zero2", "fsdp", "zero3")
"""Fastest first: replicas need no parameter traffic; full sharding the most."""
NODE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CHECKPOINTING_LEVELS: tuple[tuple[bool, CheckpointPolicy, str], ...] = (
    (False, "full", "off"), (True, "selective", "selective"), (True, "full", "full"))
"""What an unset gradientCheckpointing tries, fastest first."""
TOKENS_PER_PASS = 4096
"""A micro-batch of this many tokens keeps a GPU's matmuls large enough to run near their
peak (M = tokens): the planner splits a step into smaller passes down to this size rather
than recompute activations, and merges smaller passes up to it. Beyond it a larger pass
gains little and spends memory the estimate may have misjudged."""
COMPILE_PAYS_AFTER_S = 20 * 60
"""A per-layer compile costs a minute or two at start and saves ~18% of every step
(benchmarks/changes-gpu.json): it pays back within a run of this length."""

Verdict = Literal["fits", "tight", "does-not-fit", "unknown"]


class PlanModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")


class Change(PlanModel):
    """One setting an option sets otherwise than the plan it is offered with: the spec's
    field, the plan's value (an unset field: what the plan chose) and the option's."""

    field: str
    """The spec's field, e.g. `spec.strategy.gradientCheckpointing`."""
    from_: bool | int | str | None = Field(alias="from")
    to: bool | int | str | None

    def label(self) -> str:
        return f"{self.field}: {_value(self.from_)} → {_value(self.to)}"


def _value(value: bool | int | str | None) -> str:
    """A setting as YAML writes it: `true`, `4`, `fsdp`; `unset` for None."""
    if value is None:
        return "unset"
    return str(value).lower() if isinstance(value, bool) else str(value)


class Option(PlanModel):
    """One configuration that fits with headroom."""

    vm_size: str
    gpu: str
    nodes: int
    gpus_per_node: int
    strategy: Strategy
    precision: Precision
    per_gpu_bytes: int
    gpu_memory_bytes: int
    tokens_per_second: float
    price_per_hour: float
    cost_per_million_tokens: float
    changes: list[Change] = Field(default_factory=list)
    """What the option sets otherwise than the plan it comes with, field by field (filled
    in by `plan_job`): the VM size, nodes, strategy and precision it names, and the
    checkpointing and micro-batch it is sized with (the spec's as written; an unset
    gradientCheckpointing as on, an unset microBatchSize as batchSizePerDevice)."""


class Recommendation(PlanModel):
    """The cheapest option per trained token, and why."""

    best: Option | None
    on_requested_gpu: Option | None = None
    """The cheapest option on the VM size the job asks for (other strategy or nodes)."""
    why: str
    alternatives: list[Option] = Field(default_factory=list)


class StepSettings(PlanModel):
    """Gradient checkpointing, micro-batch and compile as the workers run them, and why
    (for unset fields): decided once, from the same estimate `finetune plan` prints."""

    gradient_checkpointing: bool
    checkpoint_policy: CheckpointPolicy
    micro_batch: int
    """Sequences per forward pass on each device (`microBatchSize`)."""
    compile: bool
    notes: list[str] = Field(default_factory=list)

    def label(self) -> str:
        checkpointing = self.checkpoint_policy if self.gradient_checkpointing else "off"
        return f"checkpointing {checkpointing}, compile {'on' if self.compile else 'off'}"


class JobPlan(PlanModel):
    """What `finetune plan` prints and the operator's Feasible condition says."""

    fits: bool | None
    verdict: Verdict
    reason: str
    model_source: str | None = None
    total_params: int | None = None
    trainable_params: int | None = None
    strategy: Strategy | None = None
    precision: Precision | None = None
    world_size: int = 1
    gpu_type: str | None = None
    gpu_memory_bytes: int | None = None
    per_gpu_bytes: int | None = None
    breakdown: dict[str, int] = Field(default_factory=dict)
    temporary_buffers: dict[str, int] = Field(default_factory=dict)
    peak_phase: str | None = None
    throughput: Throughput | None = None
    recommendation: Recommendation | None = None
    notes: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    """What the spec asks that the model was not made for (`context_warning`): the job
    runs, and `finetune plan`, `finetune run` and the operator's events say so."""
    step_settings: StepSettings | None = None
    """Checkpointing and compile as the workers will run them (`plan_with_notes`)."""
    host_bytes: int | None = None
    """Host memory of node 0 at its peak (planner.host): while loading or training."""
    host_memory_bytes: int | None = None
    """The VM size's host memory."""
    host_breakdown: dict[str, int] = Field(default_factory=dict)
    host_peak_phase: str | None = None
    disk_bytes: int | None = None
    """The output volume at the end of the run (planner.disk)."""
    disk_breakdown: dict[str, int] = Field(default_factory=dict)


def gib(value: float) -> str:
    """Bytes for people: GiB, MiB below one GiB, KiB below one MiB (a tiny model's
    optimizer states would read `0 MiB`, as if there were none)."""
    if abs(value) >= 1024**3:
        return f"{value / 1024**3:.1f} GiB"
    if abs(value) >= 1024**2 or value == 0:
        return f"{value / 1024**2:.0f} MiB"
    return f"{value / 1024:.0f} KiB" if abs(value) >= 1024 else f"{value:.0f} B"


def setup_for(job: FineTuneJob, strategy: Strategy, world_size: int | None = None,
              precision: Precision | None = None) -> TrainingSetup:
    """The planner's view of the job with one strategy and world size."""
    spec = job.spec
    lora = spec.method.lora or LoraConfig()  # the trainer's defaults where the spec has none
    resources = spec.resources
    world = world_size or resources.nodes * resources.processes()
    # unset microBatchSize: planned at batchSizePerDevice until `choose_step_settings` sizes it
    micro_batch, passes = spec.hyperparameters.micro_steps()
    # a sample's row: DPO's holds a pair (prompt + chosen, prompt + rejected)
    objective = spec_of(spec.objective.type)
    plans = {"reference_forward": objective.runs_reference_each_batch(spec),
             **(objective.plans(spec) if objective.plans is not None else {})}
    return TrainingSetup(
        method=spec.method.type,
        lora_rank=lora.r, lora_targets=list(lora.target_modules), lora_dropout=lora.dropout,
        strategy=strategy, offload=spec.strategy.offload,
        precision=precision or spec.strategy.precision,
        micro_batch=micro_batch,
        seq_len=objective.rows_per_sample * spec.dataset.max_seq_length,
        # unset: planned with checkpointing until `choose_step_settings` relaxes it
        gradient_checkpointing=spec.strategy.gradient_checkpointing is not False,
        checkpoint_policy=spec.strategy.gradient_checkpointing_policy,
        compile=spec.strategy.compile is True,  # unset: planned eager (the larger)
        fused_loss=spec.strategy.fused_loss,
        gradient_accumulation=passes,
        world_size=world, device="cuda" if resources.on_gpus else "cpu", **plans)


def allowed_strategies(job: FineTuneJob) -> list[Strategy]:
    """What `auto` may pick for this job without breaking a validation rule."""
    spec = job.spec
    if spec.strategy.offload == "nvme":
        return ["zero3"]
    out: list[Strategy] = list(AUTO_ORDER)
    if spec.strategy.offload == "cpu":
        out = ["zero2", "fsdp", "zero3"]
    if spec.method.type == "qlora":
        out = [s for s in out if s in ("ddp", "fsdp")]  # bitsandbytes + DeepSpeed: untested
    if spec.method.type == "full" and spec.strategy.precision == "fp16":
        out = [s for s in out if s != "fsdp"]  # refused by validation (unstable)
    return out


def context_warning(job: FineTuneJob, shape: ModelShape) -> str | None:
    """maxSeqLength beyond the model's context: a sample that long trains at positions the
    model never saw (its position encoding extrapolated), which HF's and TRL's trainers
    also only warn of; packed samples each start at position 0, so only long ones do."""
    longest, context = job.spec.dataset.max_seq_length, shape.context_length
    if context is None or longest <= context:
        return None
    return (f"spec.dataset.maxSeqLength: {longest} is longer than the model's context "
            f"(max_position_embeddings {context} in its config.json): a sample longer than "
            f"{context} tokens trains at positions the model was not made for — set "
            f"maxSeqLength to {context} or less, or use a model with a longer context")


def shape_of(model: ModelConfig | None) -> tuple[ModelShape | None, str | None]:
    if model is None:
        return None, None
    try:
        return from_hf_config(model.config), None
    except ConfigError as error:
        return None, str(error)


def _precision_on(gpu_bf16: bool, precision: Precision) -> Precision:
    return "fp16" if precision == "bf16" and not gpu_bf16 else precision


def _fits(estimate: MemoryEstimate, vm: VmSize, headroom: float,
          host: HostMemoryEstimate | None = None) -> bool:
    """The GPU estimate (and node 0's host memory, when given) within the VM's, with
    `headroom` left."""
    on_host = host is None or host.total <= vm.memory_bytes * (1 - headroom)
    return on_host and estimate.total <= vm.gpu.memory_bytes * (1 - headroom)


def host_estimate(shape: ModelShape, job: FineTuneJob, setup: TrainingSetup,
                  ranks_per_node: int | None = None) -> HostMemoryEstimate:
    """Node 0's host memory for `setup`, the job's ranks per node unless given."""
    return estimate_host_memory(shape, setup, ranks_per_node or job.spec.resources.processes())


def as_recommended(job: FineTuneJob, vm: VmSize, nodes: int, strategy: Strategy,
                   precision: Precision) -> FineTuneJob:
    """The job as a recommendation would have it written."""
    spec = job.spec
    return job.model_copy(update={"spec": spec.model_copy(update={
        "strategy": spec.strategy.model_copy(update={"type": strategy, "precision": precision}),
        "resources": spec.resources.model_copy(update={
            "gpu_type": vm.name, "gpus_per_node": vm.gpus, "nodes": nodes})})})


def sized_settings(job: FineTuneJob, strategy: Strategy | None, precision: Precision | None,
                   gpu_type: str | None) -> dict[str, bool | int | str | None]:
    """The settings a plan or an option is sized with, by the spec's field names: unset
    checkpointing and micro-batch as `setup_for` plans them (on; batchSizePerDevice)."""
    spec, chosen = job.spec, job.spec.strategy
    checkpointing = chosen.gradient_checkpointing is not False
    return {"spec.resources.gpuType": gpu_type,
            "spec.resources.nodes": spec.resources.nodes,
            "spec.resources.gpusPerNode": spec.resources.gpus_per_node,
            "spec.strategy.type": strategy,
            "spec.strategy.precision": precision,
            "spec.strategy.offload": chosen.offload,
            "spec.strategy.gradientCheckpointing": checkpointing,
            "spec.strategy.gradientCheckpointingPolicy": chosen.gradient_checkpointing_policy,
            "spec.hyperparameters.microBatchSize": spec.hyperparameters.micro_steps()[0]}


def with_changes(recommendation: Recommendation, planned: dict[str, bool | int | str | None],
                 written: FineTuneJob) -> Recommendation:
    """`recommendation` with each option's `changes` from the plan's settings (`planned`,
    `sized_settings`); the options were sized from `written`, the spec as written."""

    def explained(option: Option | None) -> Option | None:
        if option is None or (vm := catalog.find(option.vm_size)) is None:
            return option
        mine = sized_settings(as_recommended(written, vm, option.nodes, option.strategy,
                                             option.precision),
                              option.strategy, option.precision, option.vm_size)
        checkpointing = mine["spec.strategy.gradientCheckpointing"]
        changes = [Change(field=field, from_=planned.get(field), to=value)
                   for field, value in mine.items() if value != planned.get(field) and (
                       checkpointing or not field.endswith("Policy"))]
        return option.model_copy(update={"changes": changes})

    return recommendation.model_copy(update={
        "best": explained(recommendation.best),
        "on_requested_gpu": explained(recommendation.on_requested_gpu),
        "alternatives": [explained(o) for o in recommendation.alternatives]})


def refused(job: FineTuneJob) -> str | None:
    """Why the validator would refuse `job` (its first error), or None: the planner never
    recommends a setup `finetune validate` or the API server turns down."""
    errors = setting_errors(job)
    return f"{errors[0].message} — {errors[0].fix}" if errors else None


def _option(shape: ModelShape, job: FineTuneJob, vm: VmSize, nodes: int, strategy: Strategy,
            headroom: float) -> Option | None:
    precision = _precision_on(vm.gpu.bf16, job.spec.strategy.precision)
    setup = setup_for(job, strategy, vm.gpus * nodes, precision)
    setup = setup.model_copy(update={"device": "cuda"})
    estimate = estimate_memory(shape, setup)
    host = host_estimate(shape, job, setup, vm.gpus)
    # the validator only looks at what would be offered: options that fit
    if not _fits(estimate, vm, headroom, host) or refused(
            as_recommended(job, vm, nodes, strategy, precision)):
        return None
    speed = estimate_throughput(shape, setup, vm, nodes)
    cost = vm.price_per_hour * nodes / (speed.tokens_per_second * 3600) * 1e6
    return Option(vm_size=vm.name, gpu=vm.gpu.name, nodes=nodes, gpus_per_node=vm.gpus,
                  strategy=strategy, precision=precision, per_gpu_bytes=estimate.total,
                  gpu_memory_bytes=vm.gpu.memory_bytes,
                  tokens_per_second=round(speed.tokens_per_second, 1),
                  price_per_hour=vm.price_per_hour,
                  cost_per_million_tokens=round(cost, 4))


def options_on(shape: ModelShape, job: FineTuneJob, vm: VmSize,
               headroom: float = HEADROOM) -> list[Option]:
    """For each strategy, the fewest nodes of `vm` on which the job fits."""
    found = []
    for strategy in allowed_strategies(job):
        for nodes in NODE_COUNTS:
            option = _option(shape, job, vm, nodes, strategy, headroom)
            if option is not None:
                found.append(option)
                break
    return found


def recommend(shape: ModelShape, job: FineTuneJob, requested: VmSize | None = None,
              headroom: float = HEADROOM) -> Recommendation:
    """The cheapest option per trained token over the catalog, and on the requested VM."""
    options = [o for vm in catalog.VM_SIZES for o in options_on(shape, job, vm, headroom)]
    options.sort(key=lambda o: (o.cost_per_million_tokens, o.nodes * o.gpus_per_node))
    mine = None
    if requested is not None:
        on_requested = sorted(options_on(shape, job, requested, headroom),
                              key=lambda o: (o.nodes, o.cost_per_million_tokens))
        mine = on_requested[0] if on_requested else None
    if not options:
        return Recommendation(best=None, on_requested_gpu=mine, why=(
            f"nothing in the catalog fits up to {NODE_COUNTS[-1]} nodes with "
            f"{int(headroom * 100)}% headroom: {_smaller_job(job)}"))
    best = options[0]
    why = (f"cheapest per trained token of {len(options)} fitting options: {best.strategy} on "
           f"{best.nodes} x {best.vm_size} ({best.gpus_per_node} x {best.gpu}), "
           f"{gib(best.per_gpu_bytes)} of {gib(best.gpu_memory_bytes)} per GPU, "
           f"~{best.tokens_per_second:,.0f} tokens/s, ~${best.cost_per_million_tokens:.2f} "
           "per million tokens at list price")
    if len(options) > 1:
        runner = options[1]
        ratio = runner.cost_per_million_tokens / max(best.cost_per_million_tokens, 1e-12)
        why += (f"; next: {runner.strategy} on {runner.nodes} x {runner.vm_size} "
                f"({ratio:.1f}x the cost)")
    return Recommendation(best=best, on_requested_gpu=mine, why=why, alternatives=options[1:6])


def _smaller_job(job: FineTuneJob) -> str:
    """What would make a job that fits nowhere smaller, of what it does not do already:
    the options were sized at its micro-batch and with checkpointing on unless the spec
    sets it off, and a method is only smaller than the job's own (full > lora > qlora)."""
    spec = job.spec
    fixes = ["shorten spec.dataset.maxSeqLength"]
    if spec.hyperparameters.micro_steps()[0] > 1:  # the same global batch, in more passes
        fixes.append("set spec.hyperparameters.microBatchSize: 1")
    if spec.strategy.gradient_checkpointing is False:
        fixes.append("set spec.strategy.gradientCheckpointing: true")
    smaller = {"full": "lora or qlora", "lora": "qlora"}.get(spec.method.type)
    if smaller:
        fixes.append(f"use spec.method.type: {smaller}")
    return ", ".join(fixes) + ", or train a smaller model"


def _vm_of(job: FineTuneJob, machine: VmSize | None = None) -> VmSize | None:
    """What the job's GPUs are planned as: `machine` (`finetune run`: this machine's GPUs,
    `catalog.this_machine`), else the catalog's entry for its gpuType."""
    resources = job.spec.resources
    if machine is not None:
        return machine
    return catalog.find(resources.gpu_type, resources.gpus_per_node) if resources.gpu_type else None


def auto_strategy(job: FineTuneJob, model: ModelConfig | None,
                  machine: VmSize | None = None) -> Strategy | None:
    """The strategy expected to run fastest on the job's own GPUs (or `machine`'s), each
    judged by the step its workers would run (`_size_the_step`: the checkpointing and
    micro-batch chosen for it), not by batchSizePerDevice alone: first those at which a
    full-size pass fits with headroom, then those that fit only smaller passes; among
    them the least estimated step time (compute, or traffic where that is longer), then
    the least recomputation, then AUTO_ORDER. When none fits, the least memory-hungry.
    None when the planner cannot tell (no model config, no known gpuType, CPU workers)."""
    ranked = _ranked_strategies(job, model, machine)
    return ranked[0].strategy if ranked else None


@dataclass(frozen=True)
class _Candidate:
    strategy: Strategy
    key: tuple[Any, ...]
    """What auto_strategy ranks by, smallest first."""
    step_seconds: float | None
    """The estimated step (compile counted); None when not even the smallest pass fits."""
    compiled: bool

    @property
    def fit(self) -> int:
        """0: a full-size pass fits, 1: only smaller passes, 2: nothing fits."""
        return self.key[0]


def _ranked_strategies(job: FineTuneJob, model: ModelConfig | None,
                       machine: VmSize | None) -> list[_Candidate]:
    """Every strategy that `auto` may choose for the job, best first (auto_strategy)."""
    shape, _ = shape_of(model)
    resources = job.spec.resources
    vm = _vm_of(job, machine)
    if shape is None or vm is None or not resources.on_gpus:
        return []
    world = resources.nodes * resources.gpus_per_node
    precision = _precision_on(vm.gpu.bf16, job.spec.strategy.precision)
    levels = _levels(job.spec.strategy)
    ranked = []
    for order, strategy in enumerate(allowed_strategies(job)):
        # the validator looks only at a strategy that would be chosen
        if refused(as_recommended(job, vm, resources.nodes, strategy, precision)):
            continue
        sized = _size_the_step(shape, setup_for(job, strategy, world, precision), vm, levels,
                               job.spec.hyperparameters, job.spec.dataset.packing)
        fits = sized.fits and _fits(sized.estimate, vm, HEADROOM,
                                    host_estimate(shape, job, sized.setup))
        if not fits:
            ranked.append(_Candidate(strategy, (2, sized.estimate.total, order), None, False))
            continue
        step = estimate_throughput(shape, sized.setup, vm, resources.nodes).step_seconds
        compiled = _compiled(job, strategy, sized.setup, shape, vm)
        if compiled:
            step /= COMPILE_SPEEDUP
        ranked.append(_Candidate(strategy, (0 if sized.full_pass else 1, round(step, 3),
                                            levels.index(sized.level), order), step, compiled))
    return sorted(ranked, key=lambda c: c.key)


def _why_ranked(ranked: list[_Candidate]) -> str:
    """Why the first of `ranked` won, in a line: each strategy's estimated step where the
    winner's passes fit, and what the others fit."""
    best = ranked[0]
    if best.fit == 2:
        return "nothing fits; it needs the least memory"
    where = ("a full-size pass fits" if best.fit == 0 else
             "no strategy fits a full-size pass; smaller ones fit")
    steps = ", ".join(f"{c.strategy} {c.step_seconds:.2f} s{' compiled' if c.compiled else ''}"
                      for c in ranked if c.fit == best.fit)
    why = f"{where}; the shortest estimated step of those ({steps})"
    for fit, what in ((1, "only smaller passes fit"), (2, "nothing fits")):
        if fit > best.fit and (names := [c.strategy for c in ranked if c.fit == fit]):
            why += f"; {what} with {', '.join(names)}"
    return why


def _compiled(job: FineTuneJob, strategy: Strategy, setup: TrainingSetup, shape: ModelShape,
              vm: VmSize) -> bool:
    """Whether the workers would compile with `strategy`: the spec's `compile`, else the
    planner's choice."""
    if (compile_ := job.spec.strategy.compile) is not None:
        return compile_
    return _compile_by_length(job, strategy, setup, shape, vm, None)[0]


def fallback_strategy(job: FineTuneJob) -> Strategy:
    """The rules `auto` follows without a plan: adapters are small, so LoRA/QLoRA replicate
    the frozen base (ddp); full fine-tuning shards once there is more than one device
    (fsdp); offload needs DeepSpeed ZeRO-3."""
    spec = job.spec
    if spec.strategy.offload != "none":
        return "zero3"
    devices = spec.resources.nodes * spec.resources.processes()
    if spec.method.type == "full" and devices > 1:
        return "fsdp"
    return "ddp"


def resolve_strategy(job: FineTuneJob, model: ModelConfig | None = None,
                     machine: VmSize | None = None) -> Strategy:
    """The concrete strategy of a job: its own, or `auto` resolved through the planner
    (with `model`, else the built-in table; on `machine`, else its gpuType), else the
    fallback rules."""
    return explain_strategy(job, model, machine)[0]


def explain_strategy(job: FineTuneJob, model: ModelConfig | None = None,
                     machine: VmSize | None = None) -> tuple[Strategy, str | None]:
    """`resolve_strategy`, and why `auto` resolved so (None: the spec names the strategy)."""
    if job.spec.strategy.type != "auto":
        return job.spec.strategy.type, None
    if job.spec.strategy.offload != "none":
        return "zero3", "offload needs DeepSpeed ZeRO-3"
    ranked = _ranked_strategies(job, model or from_table(job.spec.model.uri), machine)
    if not ranked:
        _, _, unknown = _gpu_and_shape(job, model, machine)
        why = unknown or "every strategy it may choose is refused for it"
        return fallback_strategy(job), (
            f"the planner cannot size this job ({why}), so the simple rules: fsdp for full "
            "fine-tuning on several devices, else ddp")
    return ranked[0].strategy, _why_ranked(ranked)


def with_step_settings(job: FineTuneJob, settings: StepSettings) -> FineTuneJob:
    """The job as its workers run it: checkpointing, micro-batch and compile set."""
    spec = job.spec
    strategy = spec.strategy.model_copy(update={
        "gradient_checkpointing": settings.gradient_checkpointing,
        "gradient_checkpointing_policy": settings.checkpoint_policy,
        "compile": settings.compile})
    hyperparameters = spec.hyperparameters.model_copy(
        update={"micro_batch_size": settings.micro_batch})
    return job.model_copy(update={"spec": spec.model_copy(update={
        "strategy": strategy, "hyperparameters": hyperparameters})})


def _gpu_and_shape(job: FineTuneJob, model: ModelConfig | None, machine: VmSize | None
                   ) -> tuple[ModelShape | None, VmSize | None, str | None]:
    """The model's shape and the job's VM size (`machine`, else its gpuType's), or why the
    planner cannot tell."""
    resources = job.spec.resources
    if not resources.on_gpus:
        return None, None, "CPU workers: the planner estimates GPU memory only"
    shape, error = shape_of(model or from_table(job.spec.model.uri))
    if shape is None:
        return None, None, error or f"no config.json known for {job.spec.model.uri}"
    vm = _vm_of(job, machine)
    if vm is None:
        return shape, None, ("spec.resources.gpuType is not set" if not resources.gpu_type
                             else f"gpuType {resources.gpu_type!r} is not in the catalog")
    return shape, vm, None


def choose_step_settings(job: FineTuneJob, model: ModelConfig | None,
                         strategy: Strategy, machine: VmSize | None = None) -> StepSettings:
    """What an unset `gradientCheckpointing`, `microBatchSize` and `compile` stand for on
    this job: the fastest checkpointing that fits the GPU (the gpuType's, or `machine`'s
    free memory) with headroom (off, selective, full) at the micro-batch that fits it
    (`_size_the_step`), full where the planner cannot tell, off on CPU workers (host memory
    holds the activations); and compile for GPU runs long enough to pay for it. Set fields
    are kept as they are."""
    chosen, hp, notes = job.spec.strategy, job.spec.hyperparameters, []
    shape, vm, unknown = _gpu_and_shape(job, model, machine)
    resources = job.spec.resources
    world = resources.nodes * resources.processes()
    setup = None
    if vm is not None and shape is not None:
        precision = _precision_on(vm.gpu.bf16, chosen.precision)
        setup = setup_for(job, strategy, world, precision).model_copy(update={"device": "cuda"})

    # compile first: a compiled layer saves less, which the step is sized by
    compile_, compile_why = chosen.compile, None
    if compile_ is None:
        compile_, compile_why = _compile_by_length(job, strategy, setup, shape, vm, unknown)
    if setup is not None:
        setup = setup.model_copy(update={"compile": compile_})
    checkpointing, policy = chosen.gradient_checkpointing, chosen.gradient_checkpointing_policy
    micro = hp.micro_steps()[0]
    if not resources.on_gpus:
        if checkpointing is None:  # host memory is what a CPU worker has plenty of
            checkpointing = False
            notes.append("gradientCheckpointing unset → off: CPU workers (recomputing "
                         "activations only slows a CPU run)")
    elif setup is None or shape is None or vm is None:
        if checkpointing is None:
            checkpointing, policy = True, "full"
            notes.append(f"gradientCheckpointing unset → full: {unknown}")
    else:
        sized = _size_the_step(shape, setup, vm, _levels(chosen), hp, job.spec.dataset.packing)
        checkpointing, policy = sized.level[0], sized.level[1]
        setup = sized.setup
        micro = setup.micro_batch
        at = f" at microBatchSize {micro}" if micro != hp.batch_size_per_device else ""
        total = (f"{gib(sized.estimate.total)} of {gib(vm.gpu.memory_bytes)} per GPU{at}"
                 + (f" fits with {HEADROOM:.0%} headroom" if sized.fits
                    else ", the least there is, does not fit either"))
        if chosen.gradient_checkpointing is None:
            notes.append(f"gradientCheckpointing unset → {sized.level[2]}: {total}")
        if hp.micro_batch_size is None and micro != hp.batch_size_per_device:
            notes.append(f"microBatchSize unset → {micro}: {sized.why}"
                         + ("" if chosen.gradient_checkpointing is None else f"; {total}"))

    if compile_why is not None:
        notes.append(f"compile unset → {'on' if compile_ else 'off'}: {compile_why}")
    return StepSettings(gradient_checkpointing=checkpointing, checkpoint_policy=policy,
                        micro_batch=micro, compile=compile_, notes=notes)


def planned_peak(job: FineTuneJob, model: ModelConfig | None, strategy: Strategy,
                 settings: StepSettings, machine: VmSize | None = None) -> int | None:
    """The planner's peak GPU memory per process with these step settings (the estimate
    `choose_step_settings` sized them by); None for a CPU job, or where the model or the
    GPU is not known."""
    shape, vm, _ = _gpu_and_shape(job, model, machine)
    if shape is None or vm is None or not job.spec.resources.on_gpus:
        return None
    resources, hp = job.spec.resources, job.spec.hyperparameters
    precision = _precision_on(vm.gpu.bf16, job.spec.strategy.precision)
    per_device = hp.batch_size_per_device * hp.gradient_accumulation_steps
    setup = setup_for(job, strategy, resources.nodes * resources.processes(), precision)
    return estimate_memory(shape, setup.model_copy(update={
        "device": "cuda", "gradient_checkpointing": settings.gradient_checkpointing,
        "checkpoint_policy": settings.checkpoint_policy, "micro_batch": settings.micro_batch,
        "gradient_accumulation": per_device // settings.micro_batch,
        "compile": settings.compile})).total


def _levels(chosen: StrategyConfig) -> tuple[tuple[bool, CheckpointPolicy, str], ...]:
    """The checkpointing levels the planner may choose from: all, fastest first, when
    gradientCheckpointing is unset; else the one the spec sets."""
    if chosen.gradient_checkpointing is None:
        return CHECKPOINTING_LEVELS
    policy = chosen.gradient_checkpointing_policy
    return ((chosen.gradient_checkpointing, policy,
             policy if chosen.gradient_checkpointing else "off"),)


@dataclass(frozen=True)
class _SizedStep:
    level: tuple[bool, CheckpointPolicy, str]
    setup: TrainingSetup
    estimate: MemoryEstimate
    fits: bool
    full_pass: bool
    """A pass of TOKENS_PER_PASS tokens (or the job's own, when smaller) or more."""
    why: str = ""


def _size_the_step(shape: ModelShape, setup: TrainingSetup, vm: VmSize,
                   levels: tuple[tuple[bool, CheckpointPolicy, str], ...],
                   hp: Hyperparameters, packing: bool) -> _SizedStep:
    """Checkpointing level and micro-batch, aiming at passes of `TOKENS_PER_PASS` tokens:
    the fastest level (off, selective, full) at which a pass of at least that many tokens
    (or the job's own, when smaller) fits, the largest such pass at that level.
    Recomputation costs a third of the forward's work on every step; a smaller pass of
    that many tokens keeps the matmuls large and costs next to nothing. A job whose passes
    are smaller runs fewer, larger ones up to that size, on packed data (where a larger
    pass adds no padding). When no level fits such a pass, the largest micro-batch that
    fits at all; then the least memory there is. A set microBatchSize is kept."""
    per_device = hp.batch_size_per_device * hp.gradient_accumulation_steps
    own, seq = hp.micro_steps()[0], setup.seq_len
    choices = hp.micro_batch_choices() if hp.micro_batch_size is None else [own]
    choices = [m for m in choices if m <= own or (packing and m * seq <= TOKENS_PER_PASS)]
    floor = min(TOKENS_PER_PASS, own * seq)

    def trial(level: tuple[bool, CheckpointPolicy, str], micro: int) -> _SizedStep:
        tried = setup.model_copy(update={
            "gradient_checkpointing": level[0], "checkpoint_policy": level[1],
            "micro_batch": micro, "gradient_accumulation": per_device // micro})
        estimate = estimate_memory(shape, tried)
        return _SizedStep(level=level, setup=tried, estimate=estimate,
                          fits=_fits(estimate, vm, HEADROOM), full_pass=micro * seq >= floor,
                          why=_why(micro, own, level, per_device))

    for level in levels:
        for micro in reversed([m for m in choices if m * seq >= floor]):
            if (step := trial(level, micro)).fits:
                return step
    for micro in reversed([m for m in choices if m * seq < floor]):
        for level in levels:
            if (step := trial(level, micro)).fits:
                return step
    least = trial(levels[-1], choices[0])
    return replace(least, why=f"no micro-batch fits; {_passes(per_device, choices[0])} "
                   "need the least memory")


def _why(micro: int, own: int, level: tuple[bool, CheckpointPolicy, str], per_device: int
         ) -> str:
    if micro > own:
        return (f"{_passes(per_device, micro)} a step instead of {per_device // own} of "
                f"batchSizePerDevice {own}: fewer, larger passes")
    return (f"batchSizePerDevice {own} does not fit with checkpointing {level[2]}; "
            f"{_passes(per_device, micro)} do and keep the global batch")


def _passes(per_device: int, micro: int) -> str:
    count = per_device // micro
    return f"{count} pass{'es' if count > 1 else ''} of {micro}"


def _compile_by_length(job: FineTuneJob, strategy: Strategy, setup: TrainingSetup | None,
                       shape: ModelShape | None, vm: VmSize | None,
                       unknown: str | None) -> tuple[bool, str]:
    if not job.spec.resources.on_gpus:
        return False, "CPU workers"
    if job.spec.method.type == "qlora":
        return False, "4-bit layers are not compiled"
    if strategy not in ("ddp", "fsdp"):
        return False, f"{strategy} runs DeepSpeed's own engine"
    if setup is None or shape is None or vm is None:
        return False, f"the run's length is unknown ({unknown})"
    steps = job.spec.hyperparameters.max_steps
    if steps is None:
        return True, "an epochs-long run (its length is known once the data is read)"
    seconds = steps * estimate_throughput(shape, setup, vm, job.spec.resources.nodes
                                          ).step_seconds
    minutes = seconds / 60
    if seconds < COMPILE_PAYS_AFTER_S:
        return False, (f"~{minutes:.0f} min of steps; a compile pays back in runs of "
                       f"{COMPILE_PAYS_AFTER_S // 60} min or more")
    return True, f"~{minutes:.0f} min of steps: the compile pays back"


def plan_job(job: FineTuneJob, model: ModelConfig | None, strategy: Strategy,
             gpu_type: str | None = None, search_catalog: bool = True,
             as_written: FineTuneJob | None = None, machine: VmSize | None = None,
             offline: str | None = None, unanswered: str | None = None,
             by_operator: bool = False) -> JobPlan:
    """The plan for `job` run with `strategy` (already resolved) on `gpu_type` (default:
    the spec's), given the model's config (None: unknown). `search_catalog=False` (the
    operator's admission) only looks for alternatives on the requested VM size, and only
    when the job does not fit: ~1 ms instead of ~100. `as_written`: the spec before its
    step settings were chosen for `gpu_type`, which the alternatives are sized from (a
    micro-batch chosen for one GPU says nothing of another); each alternative says which
    settings it changes (`Option.changes`). `machine`: this machine's GPUs in place of
    `gpu_type` (`finetune run`). `offline`: why the hub was not asked (`--offline`), said
    where a hub model's config is missing; None: it was asked. `unanswered`: why the hub,
    asked, gave none (`sources.HubUnanswered`), said there too. `by_operator`: the
    operator's admission, whose pod holds no path of the trainer image and whose Feasible
    condition is about GPU memory, which CPU workers do not use."""
    written = as_written or job
    plan = _plan_on(job, model, strategy, gpu_type, search_catalog, written, machine,
                    offline, unanswered, by_operator)
    if plan.recommendation is None:
        return plan
    planned = sized_settings(job, plan.strategy, plan.precision, plan.gpu_type)
    return plan.model_copy(update={
        "recommendation": with_changes(plan.recommendation, planned, written)})


def _plan_on(job: FineTuneJob, model: ModelConfig | None, strategy: Strategy,
             gpu_type: str | None, search_catalog: bool, options_for: FineTuneJob,
             machine: VmSize | None, offline: str | None, unanswered: str | None = None,
             by_operator: bool = False) -> JobPlan:
    """`plan_job` but for the options' changes."""
    spec, resources = job.spec, job.spec.resources
    gpu_type = machine.name if machine else gpu_type or resources.gpu_type
    shape, config_error = shape_of(model)
    world = resources.nodes * resources.processes()
    if shape is None:
        why = config_error or (f"no config.json for {spec.model.uri}: "
                               + _where_configs_come_from(spec.model.uri, offline,
                                                          unanswered, by_operator))
        if by_operator and not resources.on_gpus:  # nothing to check: its config is no fix
            why = "CPU workers: the planner checks GPU memory only"
        return JobPlan(fits=None, verdict="unknown", reason=why, strategy=strategy,
                       world_size=world, gpu_type=gpu_type,
                       model_source=model.source if model else None)
    vm = machine or (catalog.find(gpu_type, resources.gpus_per_node) if gpu_type else None)
    precision = _precision_on(vm.gpu.bf16, spec.strategy.precision) if vm else (
        spec.strategy.precision)
    setup = setup_for(job, strategy, world, precision)
    estimate = estimate_memory(shape, setup)
    notes = list(estimate.notes)
    if precision != spec.strategy.precision:
        notes.append(_no_bf16(job, vm, strategy, precision))
    output = spec.output
    disk = estimate_disk(shape, setup, fetched=spec.model.location.scheme == "hf",
                         stored_bytes=stored_bytes_per_param(model.config),
                         keep_last=output.keep_last, merge_adapter=output.merge_adapter,
                         keeps_best=spec.hyperparameters.early_stopping_patience is not None)
    warning = context_warning(job, shape)
    common = dict(model_source=model.source, total_params=estimate.total_params,
                  trainable_params=estimate.trainable_params, strategy=strategy,
                  precision=precision, world_size=world, per_gpu_bytes=estimate.total,
                  breakdown=estimate.breakdown, temporary_buffers=estimate.temporary_buffers,
                  peak_phase=estimate.peak_phase, notes=notes, disk_bytes=disk.total,
                  disk_breakdown=disk.breakdown, warnings=[warning] if warning else [])
    if not resources.on_gpus:
        return JobPlan(fits=None, verdict="unknown", gpu_type=None, reason=(
            f"CPU workers: about {gib(estimate.total)} of memory per process "
            "(the planner checks GPU memory)"), **common)
    if search_catalog:  # more nodes of this machine are not to be had
        recommendation = recommend(shape, options_for, None if machine else vm)
    else:
        recommendation = Recommendation(best=None, why="catalog not searched")
    if vm is None:
        largest = max(catalog.GPUS, key=lambda gpu: gpu.memory_bytes)
        if not gpu_type and search_catalog and estimate.total > largest.memory_bytes:
            return JobPlan(fits=False, verdict="does-not-fit", gpu_type=None,
                           recommendation=recommendation, reason=_does_not_fit(
                               estimate, strategy, world, recommendation,
                               f"any GPU in the planner's catalog (the largest: "
                               f"{largest.name}, {gib(largest.memory_bytes)})"), **common)
        why = ("spec.resources.gpuType is not set" if not gpu_type else
               f"spec.resources.gpuType {gpu_type!r}: {unknown_gpu_type(gpu_type)}")
        return JobPlan(fits=None, verdict="unknown", gpu_type=gpu_type, recommendation=(
            recommendation), reason=f"{gib(estimate.total)} per GPU; {why}", **common)
    memory = vm.gpu.memory_bytes
    host = host_estimate(shape, job, setup)
    fits = estimate.total <= memory and host.total <= vm.memory_bytes
    if not fits and not search_catalog and machine is None:
        on_requested = sorted(options_on(shape, options_for, vm),
                              key=lambda o: (o.nodes, o.cost_per_million_tokens))
        recommendation = Recommendation(
            best=None, on_requested_gpu=on_requested[0] if on_requested else None,
            why="only the requested VM size was searched")
    verdict, reason = _gpu_verdict(estimate, vm, strategy, world, recommendation)
    if verdict != "does-not-fit":
        verdict, reason = _host_verdict(verdict, reason, host, job, vm, strategy)
    if machine is None and (too_many := _more_gpus_than(job, vm, gpu_type)):
        fits, verdict, reason = False, "does-not-fit", too_many
    throughput = estimate_throughput(shape, setup, vm, resources.nodes)
    return JobPlan(fits=fits, verdict=verdict, reason=reason, gpu_type=vm.name,
                   gpu_memory_bytes=memory, throughput=throughput,
                   recommendation=recommendation, host_bytes=host.total,
                   host_memory_bytes=vm.memory_bytes, host_breakdown=host.breakdown,
                   host_peak_phase=host.peak_phase, **{
                       **common, "notes": [*common["notes"], *host.notes]})


def unknown_gpu_type(gpu_type: str) -> str:
    """What is wrong with a gpuType the catalog does not know, and the names it likely
    meant: the same words for the spec's field and for `--gpu-type`."""
    close = catalog.close_names(gpu_type)
    listed = "`finetune plan --list-gpus` lists the catalog"
    return "not in the planner's catalog — " + (
        f"did you mean {' or '.join(close)}? ({listed})" if close else listed)


def _no_bf16(job: FineTuneJob, vm: VmSize, strategy: Strategy, precision: Precision) -> str:
    """The note of a bf16 job planned in fp16 on a GPU without bf16."""
    why_not = refused(as_recommended(job, vm, job.spec.resources.nodes, strategy, precision))
    if why_not is None:
        return f"{vm.gpu.name} has no bf16: planned in fp16; set spec.strategy.precision: fp16"
    return f"{vm.gpu.name} has no bf16, and fp16 is refused here: {why_not}"


def _gpu_verdict(estimate: MemoryEstimate, vm: VmSize, strategy: Strategy, world: int,
                 recommendation: Recommendation) -> tuple[Verdict, str]:
    """The verdict and its reason on the GPUs' memory."""
    memory = vm.gpu.memory_bytes
    verdict: Verdict = ("does-not-fit" if estimate.total > memory else
                        "tight" if estimate.total > memory * (1 - HEADROOM) else "fits")
    where = f"{vm.name} ({vm.gpu.name}, {gib(memory)})"
    if verdict != "does-not-fit":
        return verdict, (f"{gib(estimate.total)} of {gib(memory)} per GPU on {where} with "
                         f"{strategy}" + (" (less than 10% headroom)" if verdict == "tight"
                                          else "") + f": {_lines(estimate)}")
    return verdict, _does_not_fit(estimate, strategy, world, recommendation, where)


def _lines(estimate: MemoryEstimate) -> str:
    return ", ".join(f"{_LABELS[k]} {gib(v)}" for k, v in estimate.breakdown.items() if v)


def _does_not_fit(estimate: MemoryEstimate, strategy: Strategy, world: int,
                  recommendation: Recommendation, than: str) -> str:
    """Why a job does not fit `than` (the GPU it asks for, or every GPU the catalog has),
    and what would fit: on the VM size it asks for, else the cheapest anywhere."""
    reason = (f"needs {gib(estimate.total)} per GPU with {strategy} on {world} GPU"
              f"{'s' if world > 1 else ''}, more than {than}: {_lines(estimate)}")
    mine = recommendation.on_requested_gpu
    if mine is not None:
        reason += (f" — fits as strategy {mine.strategy} on {mine.nodes} node"
                   f"{'s' if mine.nodes > 1 else ''} ({gib(mine.per_gpu_bytes)} per GPU)")
    elif recommendation.best is not None:
        b = recommendation.best
        reason += f" — fits on {b.nodes} x {b.vm_size} with {b.strategy}"
    return reason


def _more_gpus_than(job: FineTuneJob, vm: VmSize, gpu_type: str) -> str | None:
    """Why no node of the VM size `gpu_type` names can hold one worker: it asks more GPUs
    per node than the size has. A GPU name (`A100-80GB`) is left to the validator's
    warning: machines outside Azure's catalog may have more of them."""
    resources = job.spec.resources
    if resources.gpus_per_node <= vm.gpus or not catalog.is_vm_size(gpu_type):
        return None
    world = resources.nodes * resources.gpus_per_node
    nodes = -(-world // vm.gpus)
    return (f"spec.resources.gpusPerNode: {resources.gpus_per_node} GPUs per node, but "
            f"{vm.name} has {vm.gpus} ({vm.gpu.name}), so no node of it can hold a worker "
            f"— set gpusPerNode: {vm.gpus} and nodes: {nodes} ({nodes * vm.gpus} GPUs), or "
            "a gpuType with more GPUs per node")


def _host_verdict(verdict: Verdict, reason: str, host: HostMemoryEstimate, job: FineTuneJob,
                  vm: VmSize, strategy: Strategy) -> tuple[Verdict, str]:
    """The GPU verdict, refused (or marked tight) where node 0's host memory does not hold
    what its ranks keep there."""
    ram = vm.memory_bytes
    if host.total <= ram * (1 - HEADROOM):
        return verdict, reason
    if host.total <= ram:
        return "tight", reason + f"; host memory {gib(host.total)} of {gib(ram)} per node " \
                                 "(less than 10% headroom)"
    lines = ", ".join(f"{_HOST_LABELS[k]} {gib(v)}" for k, v in host.breakdown.items() if v)
    return "does-not-fit", (
        f"spec.resources: node 0 needs {gib(host.total)} of host memory while "
        f"{host.peak_phase} with {strategy} ({lines}), more than {vm.name} has "
        f"({gib(ram)}) — {_host_fixes(host, job, vm)}")


def _host_fixes(host: HostMemoryEstimate, job: FineTuneJob, vm: VmSize) -> str:
    """What would give node 0 enough host memory, most direct first: the phase at the peak
    says which (loading: the copy rank 0 reads; training: what CPU offload keeps)."""
    fixes = []
    roomier = sorted((v for v in catalog.vm_sizes_with(vm.gpu.name)
                      if v.memory_bytes * (1 - HEADROOM) >= host.total and v.gpus >= vm.gpus),
                     key=lambda v: v.price_per_hour)
    if roomier:
        fixes.append(f"a VM size with more memory (spec.resources.gpuType: {roomier[0].name})")
    spec = job.spec
    if host.peak_phase == "training":
        if spec.strategy.offload == "cpu":
            fixes.append("no CPU offload (spec.strategy.offload: none, or nvme)")
        fixes.append("more nodes (spec.resources.nodes) or fewer ranks per node "
                     "(spec.resources.gpusPerNode): each rank offloads a smaller share")
    elif spec.method.type == "full" and spec.strategy.precision != "fp32":
        fixes.append("LoRA (spec.method.type: lora reads the frozen base in 16 bits, not "
                     "fp32)")
    return "use " + ", or ".join(fixes) if fixes else "use a VM size with more memory"


_LABELS = {"weights": "weights", "gradients": "gradients", "optimizerStates": "optimizer states",
           "activations": "activations", "temporaryBuffers": "temporary buffers",
           "cudaContext": "CUDA context", "kvCache": "generation KV cache",
           "referenceWeights": "reference weights"}
_HOST_LABELS = {"weightsWhileLoading": "the weights read once",
                "offloadedTrainingState": "offloaded training state",
                "processes": "the processes"}


def _where_configs_come_from(uri: str, offline: str | None = None,
                             unanswered: str | None = None, by_operator: bool = False) -> str:
    """Why no config was found for `uri`; `offline`: why the hub was not asked;
    `unanswered`: why, asked, it gave none; `by_operator`: an absolute path was looked for
    in the operator's pod, not where the trainer reads it."""
    if uri.startswith("pvc://"):
        return ("the operator cannot read inside a claim; run `finetune plan` where the "
                "model is, or use a model the built-in table knows")
    if by_operator and uri.startswith("/"):
        return ("the operator cannot read it (a path inside the trainer image, not the "
                "operator's pod); run `finetune plan` where the model is, or use a model the "
                "built-in table knows")
    if uri.startswith("hf://") and offline:
        return (f"the hub was not asked (offline: {offline}), and the planner's built-in "
                "table does not know it (`finetune plan --list-models` lists the models it "
                "knows) — give a local folder holding its config.json, or plan with the hub")
    if uri.startswith("hf://") and unanswered:
        return (f"the hub did not answer ({unanswered}), and the planner's built-in table "
                "does not know it (`finetune plan --list-models` lists the models it "
                "knows) — give a local folder holding its config.json, or plan where the hub "
                "can be reached")
    if uri.startswith("hf://"):
        return ("the hub could not be reached (or the repo is gated) and the built-in "
                "table does not know it")
    demo = PurePath(layout.DEMO_MODEL).parts
    if PurePath(os.path.normpath(uri)).parts[-len(demo):] == demo:  # examples 01 and 08
        return ("the path holds no config.json here that reads as JSON — run `make demo` "
                f"first: it builds the tiny model these examples use ({layout.DEMO_MODEL})")
    return "the path holds no config.json here that reads as JSON"
