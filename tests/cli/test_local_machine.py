"""`finetune run` on a machine unlike the spec's: it says so in one line and keeps the
spec's global batch, or refuses with the fix (#19, item 6)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from finetune_operator.api import FineTuneJob
from finetune_operator.local import MachineMismatch, fit_to_machine
from tests.conftest import minimal_job


def job(nodes=2, gpus=8, batch=4, accumulation=1, processes=None) -> FineTuneJob:
    resources = {"nodes": nodes, "gpusPerNode": gpus}
    if processes:
        resources["processesPerNode"] = processes
    hyperparameters = {"maxSteps": 10, "batchSizePerDevice": batch,
                       "gradientAccumulationSteps": accumulation}
    return FineTuneJob.model_validate(minimal_job(resources=resources,
                                                  hyperparameters=hyperparameters))


def test_two_visible_gpus_keep_a_two_by_eight_jobs_global_batch():
    accumulation, notes = fit_to_machine(job(), processes=2, gpus=2)
    assert accumulation == 8  # 2 x 4 x 8 = 64 = 2 nodes x 8 GPUs x 4
    assert notes == ["2 local processes instead of the spec's 16: gradientAccumulationSteps 8 "
                     "keeps the global batch of 64 sequences"]


def test_cpu_instead_of_the_gpu_the_spec_asks_for_is_said():
    accumulation, notes = fit_to_machine(job(nodes=1, gpus=1), processes=1, gpus=0)
    assert accumulation == 1
    assert notes == ["no GPU is visible here: training on 1 CPU process instead of the 1 GPU "
                     "the spec asks for (slow; fine for a check)"]


def test_the_same_machine_changes_nothing():
    assert fit_to_machine(job(nodes=1, gpus=0, processes=2), processes=2, gpus=0) == (1, [])


def test_a_global_batch_that_does_not_divide_is_refused_with_the_fix():
    with pytest.raises(MachineMismatch) as refused:
        fit_to_machine(job(nodes=1, gpus=0, processes=2, batch=3), processes=4, gpus=0)
    assert "global batch of 6 sequences" in str(refused.value)
    assert ("cannot be kept on 4 local processes — pass --nproc with a divisor of 2"
            in str(refused.value))


def test_finetune_run_refuses_it_before_anything_starts(tmp_path):
    manifest = minimal_job(model={"uri": "./model"}, dataset={"uri": "./data.jsonl"},
                           output={"uri": "./out"},
                           resources={"gpusPerNode": 0, "processesPerNode": 2},
                           hyperparameters={"maxSteps": 10, "batchSizePerDevice": 3})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "run", "job.yaml",
                             "--nproc", "4"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot be kept on 4 local processes" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("accumulation", "expected"), [
    (3, 6),   # the spec's own machine: kept
    (24, 6),  # 1 process for 8: 6 divides 2 x 24
    (4, 2),   # 6 processes for 8: 2 x 4 = 8 sequences a step, the largest divisor of both
])
def test_the_micro_batch_divides_the_local_step_and_never_grows(accumulation, expected):
    """The spec's 8 workers run 2 x 3 sequences a step in one pass of 6 (as the planner
    may merge them); `finetune run` on another process count keeps a pass that divides
    its step and is no larger than the spec's."""
    from finetune_operator.local import with_accumulation
    from finetune_operator.trainer_config import build_trainer_config

    spec = minimal_job(resources={"nodes": 1, "gpusPerNode": 0, "processesPerNode": 8},
                       hyperparameters={"maxSteps": 10, "batchSizePerDevice": 2,
                                        "gradientAccumulationSteps": 3, "microBatchSize": 6},
                       model={"uri": "/models/tiny"}, dataset={"uri": "/data/train.jsonl"},
                       output={"uri": "/out"})
    config = build_trainer_config(FineTuneJob.model_validate(spec))
    local = with_accumulation(config, accumulation).hyperparameters
    assert local.gradient_accumulation_steps == accumulation
    assert local.micro_batch_size == expected
