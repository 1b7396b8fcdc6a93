"""The trainer config contract: built from a job, read back by the trainer, torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError

from finetune_operator import naming
from finetune_operator.api import MAX_NAME_LENGTH, FineTuneJobStatus, LaunchPlan
from finetune_operator.render import render
from finetune_operator.trainer_config import build_trainer_config, resolve_strategy
from finetune_operator.validation import parse_job
from finetune_trainer.config import TrainerConfig
from finetune_trainer.objectives.dpo.settings import DpoConfig
from tests.conftest import minimal_job


@pytest.mark.process
def test_config_module_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "import finetune_trainer.config, finetune_operator.cli; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.process
@pytest.mark.parametrize(("step", "said"), [
    ("--check-resume", ""), ("--fetch-model", "is not an hf:// model: nothing to fetch")])
def test_the_init_containers_steps_never_import_torch(tmp_path, step, said):
    """The pods' init containers (`--check-resume`, `--fetch-model`) start in a moment: the
    trainer's torch-heavy modules are imported only after them (#62), so here, with torch
    unimportable, each still does its step and exits 0."""
    config = build_trainer_config(parse_job(minimal_job())).to_dict()
    config["model"]["uri"] = str(tmp_path / "model")
    config["output"]["uri"] = str(tmp_path / "out")
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(config))
    code = ("import sys; sys.modules['torch'] = None; "
            "from finetune_trainer.__main__ import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, "--config", str(path), step],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert said in result.stdout


def test_rendered_config_round_trips_through_the_trainer_loader(tmp_path):
    job = parse_job(minimal_job(method={"type": "lora"}))
    config_map = render(job)[0]
    path = tmp_path / naming.TRAINER_CONFIG_KEY
    path.write_text(config_map["data"][naming.TRAINER_CONFIG_KEY])
    config = TrainerConfig.load(path)
    assert config == build_trainer_config(job, mount=lambda location: (
        "/mnt/pvc/" + location.uri.rest if location.scheme == "pvc" else location.raw))
    assert config.method.lora is not None and config.method.lora.r == 16  # defaults spelled out
    assert config.hyperparameters.learning_rate == 2e-4
    assert config.output.uri == "/mnt/pvc/ckpt/demo"


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"method": {"type": "lora"}}, "ddp"),
    ({"method": {"type": "full"}}, "ddp"),
    ({"method": {"type": "full"}, "resources": {"gpusPerNode": 8}}, "fsdp"),
    ({"method": {"type": "full"}, "resources": {"gpusPerNode": 1, "nodes": 2}}, "fsdp"),
    ({"strategy": {"offload": "cpu"}}, "zero3"),
    ({"strategy": {"type": "zero2"}}, "zero2"),
], ids=["lora", "full-one-gpu", "full-eight-gpus", "full-two-nodes", "offload", "explicit"])
def test_auto_strategy(overrides, expected):
    assert resolve_strategy(parse_job(minimal_job(**overrides))) == expected


def test_trainer_refuses_an_unresolved_strategy():
    config = build_trainer_config(parse_job(minimal_job())).to_dict()
    config["strategy"]["type"] = "auto"
    with pytest.raises(ValidationError, match="must be resolved"):
        TrainerConfig.model_validate(config)


def test_full_method_gets_no_adapter_and_a_lower_learning_rate():
    config = build_trainer_config(parse_job(minimal_job(method={"type": "full"})))
    assert config.method.lora is None
    assert config.hyperparameters.learning_rate == 2e-5


def test_derived_names_fit_kubernetes_labels():
    longest = "a" * MAX_NAME_LENGTH
    for name in naming.all_names(longest, nodes=1024):
        assert len(name) <= 63, name


def test_workers_are_told_the_recorded_plan_not_a_fresh_decision():
    """#16: the strategy and step settings in status.plan win over what the planner would
    say now (for `auto` and unset checkpointing/compile)."""
    job = parse_job(minimal_job(method={"type": "lora"}))
    fresh = build_trainer_config(job).strategy
    recorded = LaunchPlan(strategy="zero3" if fresh.type != "zero3" else "fsdp",
                          gradient_checkpointing=not fresh.gradient_checkpointing,
                          gradient_checkpointing_policy="selective", compile=False)
    job.status = FineTuneJobStatus(plan=recorded)
    told = build_trainer_config(job).strategy
    assert (told.type, told.gradient_checkpointing, told.gradient_checkpointing_policy,
            told.compile) == (recorded.strategy, recorded.gradient_checkpointing, "selective",
                              False)


def test_workers_are_told_the_recorded_micro_batch_while_it_divides_the_step():
    """A micro-batch recorded in status.plan is what every launch runs; a record from
    before the operator chose one (none), or one the edited spec's step no longer divides,
    falls back to the spec's."""
    job = parse_job(minimal_job(hyperparameters={"maxSteps": 10, "batchSizePerDevice": 4,
                                                 "gradientAccumulationSteps": 2}))
    plan = {"strategy": "ddp", "gradient_checkpointing": True,
            "gradient_checkpointing_policy": "full", "compile": False}
    for recorded, told in ((2, 2), (8, 8), (None, 4), (3, 4)):
        job.status = FineTuneJobStatus(plan=LaunchPlan(**plan, micro_batch_size=recorded))
        assert build_trainer_config(job).hyperparameters.micro_steps()[0] == told


def test_the_trainer_is_told_the_objective_with_its_dpo_defaults_spelled_out(tmp_path):
    dpo = parse_job(minimal_job(objective={"type": "dpo"},
                                dataset={"uri": "pvc://data/pairs.jsonl", "format": "preference"}))
    config = build_trainer_config(dpo)
    assert config.objective.type == "dpo"
    assert config.objective.dpo == DpoConfig(beta=0.1, loss="sigmoid", label_smoothing=0.0)
    # as the workers read it: the rendered ConfigMap, every setting written out
    path = tmp_path / naming.TRAINER_CONFIG_KEY
    path.write_text(render(dpo)[0]["data"][naming.TRAINER_CONFIG_KEY])
    assert TrainerConfig.load(path).objective == config.objective
    assert yaml.safe_load(path.read_text())["objective"] == {
        "type": "dpo", "dpo": {"beta": 0.1, "loss": "sigmoid", "labelSmoothing": 0.0,
                               "precomputeRefLogProbs": False}}

    chosen = parse_job(minimal_job(objective={"type": "dpo", "dpo": {"loss": "robust",
                                                                     "labelSmoothing": 0.1}},
                                   dataset={"uri": "pvc://data/pairs.jsonl"}))
    assert build_trainer_config(chosen).objective.dpo == DpoConfig(
        beta=0.1, loss="robust", label_smoothing=0.1)
    sft = build_trainer_config(parse_job(minimal_job()))
    assert sft.objective.type == "sft" and sft.objective.dpo is None


def test_workers_are_told_the_plans_peak_for_their_gpu_check():
    """#63: each rank holds the planner's peak against its GPU's free memory before the
    model loads; the peak is of the step settings the workers run (a recorded plan's too),
    and there is none for CPU workers or a model the planner does not know."""
    from finetune_operator import planner
    from finetune_operator.trainer_config import launch_decisions

    gpu = {"model": {"uri": "hf://meta-llama/Llama-3.2-1B"},
           "resources": {"gpusPerNode": 1, "gpuType": "Standard_NC40ads_H100_v5"}}
    job = parse_job(minimal_job(**gpu))
    strategy, settings = launch_decisions(job)
    peak = build_trainer_config(job).preflight.planned_peak_bytes
    assert peak == planner.planned_peak(job, None, strategy, settings) and peak > 2**30
    job.status = FineTuneJobStatus(plan=LaunchPlan(
        strategy=strategy, gradient_checkpointing=True, gradient_checkpointing_policy="full",
        compile=False, micro_batch_size=settings.micro_batch))
    recorded = build_trainer_config(job).preflight.planned_peak_bytes
    assert recorded is not None and recorded <= peak  # checkpointing: less held
    cpu = parse_job(minimal_job(model=gpu["model"], resources={"gpusPerNode": 0,
                                                              "processesPerNode": 2}))
    assert build_trainer_config(cpu).preflight.planned_peak_bytes is None
    unknown = parse_job(minimal_job(resources=gpu["resources"],
                                    model={"uri": "pvc://models/mine"}))
    assert build_trainer_config(unknown).preflight.planned_peak_bytes is None
