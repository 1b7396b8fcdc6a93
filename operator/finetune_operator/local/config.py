"""`finetune run`'s trainer config: the job's locations opened on this machine (relative
paths from the manifest's folder; claims and Azure ML refused), the model's config.json for
the planner (a fetched copy first), the plan's warnings, the file the workers read."""

from __future__ import annotations

from pathlib import Path

from finetune_operator import yamlio
from finetune_operator.api import FineTuneJob
from finetune_operator.planner import (
    ModelConfig,
    ModelConfigs,
    StepSettings,
    VmSize,
    fetch_from_hub,
)
from finetune_operator.planner.report import plan_with_notes
from finetune_operator.trainer_config import (
    Mount,
    trainer_config_and_step_settings,
    unreachable_locations,
)
from finetune_operator.validation import InvalidJobError
from finetune_trainer.config import TrainerConfig
from finetune_trainer.fetch import complete_copy
from finetune_trainer.layout import LOCAL_CONFIG
from finetune_trainer.uris import Location, Unreachable


def model_config(job: FineTuneJob, base_dir: Path) -> ModelConfig | None:
    """The model's config.json, for the planner: the folder itself, the copy an earlier run
    fetched into the output folder (no request at all), or only that file from the hub (the
    run fetches the model next anyway)."""
    configs = ModelConfigs(fetch=fetch_from_hub, base_dir=base_dir)
    if (copy := fetched_copy(job, base_dir)) is not None:
        return configs.resolve(str(copy))
    return configs.resolve(job.spec.model.uri, job.spec.model.revision)


def fetched_copy(job: FineTuneJob, base_dir: Path) -> Path | None:
    """The complete copy of an hf:// model in the job's local output folder, if one is
    there (`finetune_trainer.fetch`)."""
    output = job.spec.output.location
    if output.scheme not in ("path", "relative"):
        return None  # refused by local_config
    return complete_copy((base_dir / output.raw).resolve(), job.spec.model)


def plan_warnings(job: FineTuneJob, model: ModelConfig | None,
                  machine: VmSize | None = None) -> list[str]:
    """The plan's warnings (a maxSeqLength beyond the model's context), and what the
    operator's Feasible=False would say; here it only warns: on this machine's GPUs
    (`machine`, by their free memory) the estimate may be off by its ±15%; without them
    (`job`: the spec) it is what the operator would say of the spec's gpuType, which this
    machine may not have."""
    plan = plan_with_notes(job, model, machine)
    warnings = [f"warning: {warning}" for warning in plan.warnings]
    if plan.fits is not False or job.spec.resources.skip_feasibility_check:
        return warnings
    if machine is not None:
        return [*warnings, f"warning: predicted not to fit this machine's GPUs — "
                f"{plan.reason} (an estimate, ±15%: the run starts anyway)"]
    if not job.spec.resources.gpu_type:  # the operator, not told a GPU, launches it
        return [*warnings, f"warning: predicted not to fit any GPU the planner knows — "
                f"{plan.reason} (`finetune plan` shows the breakdown)"]
    return [*warnings, f"warning: spec.resources.gpuType: predicted not to fit — "
            f"{plan.reason} (`finetune plan` shows the breakdown; the operator would not "
            "launch this job)"]


def local_config(job: FineTuneJob, base_dir: Path, model: ModelConfig | None = None,
                 machine: VmSize | None = None, manifest: str | None = None
                 ) -> tuple[TrainerConfig, StepSettings]:
    """The trainer config with every location usable here (relative paths resolved), and
    the step settings it holds with why unset checkpointing and compile became what they
    are (`notes`); `model` (its config.json) lets `strategy: auto` go through the planner,
    which sizes the step for `machine` (this machine's GPUs) where given. `manifest`: the
    file the job came from, which its checkpoints name as the job that wrote them."""
    mount = local_mount(base_dir)
    if problems := unreachable_locations(job, mount):
        raise InvalidJobError(problems)
    config, settings = trainer_config_and_step_settings(job, mount, model, machine)
    if manifest is not None:
        config = config.model_copy(update={
            "job": config.job.model_copy(update={"manifest": manifest})})
    return config, settings


def local_mount(base_dir: Path) -> Mount:
    """Where `finetune run` opens a location: relative paths from the manifest's folder,
    absolute paths and the hub as they are; claims and Azure ML exist only on a cluster."""

    def mount(location: Location) -> str:
        if location.scheme == "relative":
            return str((base_dir / location.raw).resolve())
        if location.scheme in ("pvc", "azureml"):
            raise Unreachable(f"{location.scheme}:// locations exist only on the cluster",
                              "use a local path (absolute or ./relative) with `finetune run`")
        return location.raw

    return mount


def write_config(config: TrainerConfig, output_dir: Path) -> Path:
    path = output_dir / LOCAL_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yamlio.dump(config.to_dict()))
    return path
