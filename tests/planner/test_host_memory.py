"""Host memory per node (#17): what the ranks of node 0 hold while loading and training,
against the VM size's RAM; a job whose nodes would run out of it is refused, the
refusal naming the field and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from finetune_operator import gpu_catalog as catalog
from finetune_operator.planner import plan_job
from finetune_operator.planner.architecture import from_hf_config
from finetune_operator.planner.host import PROCESS_BYTES, estimate_host_memory
from finetune_operator.planner.known_models import KNOWN_MODELS
from finetune_operator.planner.memory import TrainingSetup
from finetune_operator.planner.report import table
from finetune_operator.planner.sources import ModelConfig
from finetune_operator.validation import parse_job
from tests.conftest import REPO, minimal_job
from tests.support import waits

GiB = 1024**3
LLAMA_70B = ModelConfig(config=KNOWN_MODELS["meta-llama/Llama-3.1-70B"], source="test")
SHAPE = from_hf_config(LLAMA_70B.config)


def job(**spec):
    return parse_job(minimal_job(model={"uri": "hf://meta-llama/Llama-3.1-70B"}, **spec))


@pytest.mark.parametrize(("vm", "ram"), [
    ("Standard_ND96isr_H100_v5", 1900), ("Standard_ND96asr_v4", 900),
    ("Standard_NC24ads_A100_v4", 220), ("Standard_NC40ads_H100_v5", 320),
    ("Standard_ND40rs_v2", 672), ("Standard_NC4as_T4_v3", 28)])
def test_the_catalog_knows_each_vm_sizes_ram(vm, ram):
    assert catalog.find(vm).memory_bytes == ram * GiB


def test_every_vm_size_has_more_ram_than_gpu_memory():
    for vm in catalog.VM_SIZES:
        assert vm.memory_bytes > vm.gpus * vm.gpu.memory_bytes / 2, vm.name


def _setup(**fields) -> TrainingSetup:
    return TrainingSetup(**{"method": "full", "strategy": "fsdp", "precision": "bf16",
                            "world_size": 32, **fields})


def test_fsdp_reads_one_copy_per_node_not_one_per_rank():
    host = estimate_host_memory(SHAPE, _setup(), ranks_per_node=8)
    # rank 0 reads the fp32 master weights once; the other ranks build the model empty
    assert host.breakdown["weightsWhileLoading"] == 4 * SHAPE.total_params
    assert host.breakdown["processes"] == 8 * PROCESS_BYTES
    assert host.peak_phase == "loading"
    assert host.total == 4 * SHAPE.total_params + 8 * PROCESS_BYTES


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_replicas_on_gpus_are_read_straight_onto_them(strategy):
    host = estimate_host_memory(SHAPE, _setup(strategy=strategy, method="lora"), 8)
    assert host.total == 8 * PROCESS_BYTES


def test_cpu_offload_keeps_every_ranks_share_of_the_training_state_on_the_host():
    setup = _setup(offload="cpu")
    host = estimate_host_memory(SHAPE, setup, ranks_per_node=8)
    # fp32 shards of weights, gradients and two Adam moments: 16 bytes a weight, 8/32 of them
    assert host.breakdown["offloadedTrainingState"] == pytest.approx(
        16 * SHAPE.total_params * 8 / 32, rel=1e-6)
    zero3 = estimate_host_memory(SHAPE, setup.model_copy(update={"strategy": "zero3"}), 8)
    # rank 0's 16-bit read and the node's 16-bit parameter partitions while loading
    assert zero3.breakdown["weightsWhileLoading"] == pytest.approx(
        2 * SHAPE.total_params * (1 + 8 / 32), rel=1e-6)


def test_a_70b_full_fine_tune_fits_on_nd_h100_nodes_with_a_host_memory_line():
    j = job(method={"type": "full"}, strategy={"type": "fsdp"},
            resources={"nodes": 4, "gpusPerNode": 8, "gpuType": "Standard_ND96isr_H100_v5"})
    result = plan_job(j, LLAMA_70B, "fsdp", search_catalog=False)
    assert result.fits is True
    assert result.host_memory_bytes == 1900 * GiB
    assert result.host_bytes == sum(result.host_breakdown.values()) < 1900 * GiB
    # every rank reading its own fp32 copy would have asked 8 x 263 GiB of this node
    assert 8 * 4 * SHAPE.total_params > 1900 * GiB
    line = next(x for x in table(j, result).splitlines() if x.startswith("host memory"))
    assert line.startswith(f"host memory per node: {result.host_bytes / GiB:.1f} GiB of "
                           "1900.0 GiB (node 0, peak while loading: weights read once")


def test_a_job_whose_nodes_run_out_of_host_memory_is_refused_with_the_fix():
    j = job(method={"type": "full"}, strategy={"type": "fsdp", "offload": "cpu"},
            resources={"nodes": 16, "gpusPerNode": 1, "gpuType": "Standard_NC24ads_A100_v4"})
    result = plan_job(j, LLAMA_70B, "fsdp", search_catalog=False)
    assert result.per_gpu_bytes < catalog.find("Standard_NC24ads_A100_v4").gpu.memory_bytes
    assert result.fits is False and result.verdict == "does-not-fit"
    assert result.host_bytes > 220 * GiB
    assert result.reason.startswith("spec.resources: node 0 needs")
    assert "of host memory while loading" in result.reason
    assert "more than Standard_NC24ads_A100_v4 has (220.0 GiB)" in result.reason
    assert "spec.resources.gpuType: Standard_NC48ads_A100_v4" in result.reason
    assert "spec.method.type: lora" in result.reason


def test_offloaded_state_past_the_ram_names_offload_and_the_ranks_per_node():
    j = job(method={"type": "full"}, strategy={"type": "zero3", "offload": "cpu"},
            resources={"nodes": 1, "gpusPerNode": 8, "gpuType": "Standard_ND96asr_v4"})
    result = plan_job(j, LLAMA_70B, "zero3", search_catalog=False)
    assert result.fits is False and result.host_peak_phase == "training"
    assert "spec.strategy.offload: none" in result.reason
    assert "spec.resources.nodes" in result.reason
    assert "spec.resources.gpusPerNode" in result.reason


def test_recommendations_only_offer_nodes_with_enough_host_memory():
    j = job(method={"type": "full"}, strategy={"type": "fsdp", "offload": "cpu"},
            resources={"nodes": 16, "gpusPerNode": 1, "gpuType": "Standard_NC24ads_A100_v4"})
    result = plan_job(j, LLAMA_70B, "fsdp")
    for option in [result.recommendation.best, *result.recommendation.alternatives]:
        vm = catalog.find(option.vm_size)
        assert vm.memory_bytes > 4 * SHAPE.total_params or option.strategy != "fsdp"


@pytest.mark.process
def test_finetune_plan_prints_the_host_memory_line_and_refuses(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(minimal_job(
        model={"uri": "hf://meta-llama/Llama-3.1-70B"}, method={"type": "full"},
        strategy={"type": "fsdp", "offload": "cpu"},
        resources={"nodes": 16, "gpusPerNode": 1, "gpuType": "Standard_NC24ads_A100_v4"})))
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "plan", str(path),
                             "--offline"], capture_output=True, text=True, cwd=REPO,
                            timeout=waits.seconds_left(), env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1, result.stderr
    assert "host memory per node: " in result.stdout
    assert "of 220.0 GiB (node 0, peak while loading" in result.stdout
    assert "verdict: DOES NOT FIT — spec.resources: node 0 needs" in result.stdout
