"""Model-state estimates agree with DeepSpeed's own ZeRO memory estimators.

`estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` are the
functions behind DeepSpeed's `..._all_cold` printouts (GPU bytes of parameters,
gradients and optimizer states for a given parameter count and GPU layout). The
planner's weights + gradients + optimizer states (+ for ZeRO-3 DeepSpeed's gathered
largest layer) must equal them for full fine-tuning in bf16, with and without offload.
"""

from __future__ import annotations

import pytest

from finetune_operator.planner.architecture import from_hf_config
from finetune_operator.planner.known_models import KNOWN_MODELS
from finetune_operator.planner.memory import TrainingSetup, estimate_memory

pytest.importorskip("deepspeed")
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs,
)

MODELS = ["meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B", "mistralai/Mistral-7B-v0.1",
          "meta-llama/Llama-3.1-70B", "mistralai/Mixtral-8x7B-v0.1", "microsoft/phi-4"]
LAYOUTS = [(1, 1), (1, 8), (2, 8), (4, 8), (16, 8)]  # (nodes, GPUs per node)


def model_states(repo: str, strategy: str, nodes: int, gpus: int, offload: str = "none"):
    shape = from_hf_config(KNOWN_MODELS[repo])
    estimate = estimate_memory(shape, TrainingSetup(
        method="full", strategy=strategy, precision="bf16", offload=offload,
        world_size=nodes * gpus))
    lines = estimate.breakdown  # ZeRO keeps its gradient partitions allocated throughout
    return shape, estimate, lines["weights"] + lines["gradients"] + lines["optimizerStates"]


@pytest.mark.parametrize("repo", MODELS)
@pytest.mark.parametrize(("nodes", "gpus"), LAYOUTS)
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_zero2_model_states_equal_deepspeeds(repo, nodes, gpus, offload):
    shape, _, states = model_states(repo, "zero2", nodes, gpus, offload)
    _, expected = estimate_zero2_model_states_mem_needs(
        shape.total_params, num_gpus_per_node=gpus, num_nodes=nodes,
        cpu_offload=offload == "cpu")
    assert states == pytest.approx(expected, abs=8)  # integer division in both


@pytest.mark.parametrize("repo", MODELS)
@pytest.mark.parametrize(("nodes", "gpus"), LAYOUTS)
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_zero3_model_states_equal_deepspeeds(repo, nodes, gpus, offload):
    shape, estimate, states = model_states(repo, "zero3", nodes, gpus, offload)
    gathered = estimate.temporary_buffers["zeroGatheredLayer"]
    _, expected, largest = estimate_zero3_model_states_mem_needs(
        shape.total_params, shape.largest_layer_params(), num_gpus_per_node=gpus,
        num_nodes=nodes, cpu_offload=offload == "cpu", cpu_offload_params=offload == "cpu")
    assert gathered == largest
    assert states + gathered == pytest.approx(expected, abs=8)


def test_largest_layer_is_the_vocabulary_or_a_block():
    llama = from_hf_config(KNOWN_MODELS["meta-llama/Llama-3.1-8B"])
    assert llama.largest_layer_params() == 128256 * 4096  # the embedding table
    mixtral = from_hf_config(KNOWN_MODELS["mistralai/Mixtral-8x7B-v0.1"])
    assert mixtral.largest_layer_params() == mixtral.layer_params()  # 8 experts per block
