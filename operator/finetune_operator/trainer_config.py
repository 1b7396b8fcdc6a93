"""FineTuneJob → TrainerConfig: what every worker of a job is told."""

from __future__ import annotations

from collections.abc import Callable

from finetune_operator import planner
from finetune_operator.api import FineTuneJob, LaunchPlan
from finetune_operator.planner import ModelConfig, StepSettings, VmSize
from finetune_operator.validation import Problem
from finetune_trainer.config import (
    ConcreteStrategy,
    JobIdentity,
    LoraConfig,
    MethodConfig,
    ObjectiveConfig,
    StrategyConfig,
    TrainerConfig,
    TrainerPreflight,
)
from finetune_trainer.uris import Location, Unreachable

Mount = Callable[[Location], str]
"""A backend's answer to where its workers open a location: a mount path, a local path, an
Azure ML placeholder, or the URI unchanged; `Unreachable` (what, fix) where they cannot."""


def keep_location(location: Location) -> str:
    return location.raw


def unreachable_locations(job: FineTuneJob, mount: Mount) -> list[Problem]:
    """The problems of the job's locations `mount` cannot open, each naming its field."""
    problems = []
    for location in job.spec.locations:
        try:
            mount(location)
        except Unreachable as error:
            problems.append(Problem(location.field, error.what, error.fix))
    return problems


def resolve_strategy(job: FineTuneJob, model: ModelConfig | None = None) -> ConcreteStrategy:
    """The strategy `auto` stands for: the fastest that fits the job's GPUs with headroom,
    when the planner knows the model (`model`, else its built-in table) and `gpuType`;
    otherwise the simple rules (adapters → ddp, full on several devices → fsdp, offload →
    zero3). See `finetune_operator.planner.plan.resolve_strategy`."""
    return planner.resolve_strategy(job, model)


def launch_decisions(job: FineTuneJob, model: ModelConfig | None = None,
                     machine: VmSize | None = None) -> tuple[ConcreteStrategy, StepSettings]:
    """The strategy and step settings the workers run with: as recorded in the status
    (`status.plan`, decided before the first launch), else decided now (for `machine`'s
    GPUs where given, `finetune run`; else for the job's gpuType)."""
    recorded = job.status.plan if job.status is not None else None
    if recorded is not None:
        return recorded.strategy, StepSettings(
            gradient_checkpointing=recorded.gradient_checkpointing,
            checkpoint_policy=recorded.gradient_checkpointing_policy,
            micro_batch=_recorded_micro_batch(recorded, job),
            compile=recorded.compile, notes=["as recorded in status.plan"])
    chosen = planner.resolve_strategy(job, model, machine)
    return chosen, planner.choose_step_settings(job, model, chosen, machine)


def _recorded_micro_batch(recorded: LaunchPlan, job: FineTuneJob) -> int:
    """The recorded micro-batch while it still divides the spec's step (a record from
    before the operator chose it has none)."""
    hp = job.spec.hyperparameters
    if recorded.micro_batch_size in hp.micro_batch_choices():
        return recorded.micro_batch_size
    return hp.micro_steps()[0]


def launch_plan(job: FineTuneJob, model: ModelConfig | None = None
                ) -> tuple[LaunchPlan, FineTuneJob]:
    """The record `launch_decisions` reads back, and the job as its workers will run it
    (the record's step settings in its spec: what the planner's verdict is about)."""
    chosen, settings = launch_decisions(job, model)
    record = LaunchPlan(strategy=chosen, gradient_checkpointing=settings.gradient_checkpointing,
                        gradient_checkpointing_policy=settings.checkpoint_policy,
                        compile=settings.compile, micro_batch_size=settings.micro_batch)
    return record, planner.with_step_settings(job, settings)


def _explicit_settings(objective: ObjectiveConfig) -> ObjectiveConfig:
    """The objective with its settings section written out, defaults included (the trainer
    reads what the operator resolved, not its own defaults)."""
    settings = objective.settings()
    if settings is None:
        return objective
    return objective.model_copy(update={objective.type: settings})


def _explicit_lora(method: MethodConfig) -> MethodConfig:
    """Workers get the adapter settings spelled out, defaults included."""
    if method.type == "full" or method.lora is not None:
        return method
    return method.model_copy(update={"lora": LoraConfig()})


def build_trainer_config(job: FineTuneJob, mount: Mount = keep_location,
                         model: ModelConfig | None = None) -> TrainerConfig:
    """`model`: the model's config.json where the caller has read it (`finetune run`),
    for resolving `strategy: auto`, and unset checkpointing and compile."""
    return trainer_config_and_step_settings(job, mount, model)[0]


def trainer_config_and_step_settings(job: FineTuneJob, mount: Mount = keep_location,
                                     model: ModelConfig | None = None,
                                     machine: VmSize | None = None
                                     ) -> tuple[TrainerConfig, StepSettings]:
    """`build_trainer_config`, and the step settings it chose with their reasons (the
    notes `finetune run` prints come from this one decision), for `machine` if given."""
    spec = job.spec
    model_at, dataset_at, output_at = (mount(location) for location in spec.locations)
    chosen, settings = launch_decisions(job, model, machine)
    strategy: StrategyConfig = spec.strategy.model_copy(update={
        "type": chosen, "gradient_checkpointing": settings.gradient_checkpointing,
        "gradient_checkpointing_policy": settings.checkpoint_policy,
        "compile": settings.compile})
    config = TrainerConfig(
        job=JobIdentity(name=job.name, namespace=job.namespace, uid=job.metadata.uid),
        model=spec.model.model_copy(update={"uri": model_at}),
        dataset=spec.dataset.model_copy(update={"uri": dataset_at}),
        method=_explicit_lora(spec.method),
        objective=_explicit_settings(spec.objective),
        strategy=strategy,
        hyperparameters=spec.hyperparameters.model_copy(update={
            "learning_rate": spec.hyperparameters.resolved_learning_rate(spec.method.type),
            "micro_batch_size": settings.micro_batch}),
        output=spec.output.model_copy(update={"uri": output_at}),
        workers=spec.resources.nodes * spec.resources.processes(),
        preflight=TrainerPreflight(
            **spec.preflight.model_dump(),
            planned_peak_bytes=planner.planned_peak(job, model, chosen, settings, machine)),
    )
    return config, settings

