"""The resource planner: per-GPU memory, step time and the cheapest fitting setup.

Pure functions over a model's config.json (`architecture`, `memory`, `compute`,
`plan`) and the GPU catalog (`finetune_operator.gpu_catalog`, data below the planner and
validation both: the planner never recommends what validation refuses, and validation
checks a gpuType against the catalog), and the one module that reads files or the network
to find a config (`sources`).
"""

from finetune_operator.gpu_catalog import VM_SIZES, VmSize, find
from finetune_operator.planner.architecture import ModelShape, from_hf_config
from finetune_operator.planner.memory import MemoryEstimate, TrainingSetup, estimate_memory
from finetune_operator.planner.plan import (
    JobPlan,
    Recommendation,
    StepSettings,
    choose_step_settings,
    plan_job,
    planned_peak,
    recommend,
    resolve_strategy,
    with_step_settings,
)
from finetune_operator.planner.sources import ModelConfig, ModelConfigs, fetch_from_hub

__all__ = [
    "VM_SIZES",
    "JobPlan",
    "MemoryEstimate",
    "ModelConfig",
    "ModelConfigs",
    "ModelShape",
    "Recommendation",
    "StepSettings",
    "TrainingSetup",
    "VmSize",
    "choose_step_settings",
    "estimate_memory",
    "fetch_from_hub",
    "find",
    "from_hf_config",
    "plan_job",
    "planned_peak",
    "recommend",
    "resolve_strategy",
    "with_step_settings",
]
