"""The planner never recommends what the validator refuses, and names GPUs by what the
catalog holds (#19, items 4 and 5)."""

from __future__ import annotations

from finetune_operator import gpu_catalog as catalog
from finetune_operator.api import FineTuneJob
from finetune_operator.planner.plan import as_recommended, plan_job, refused, resolve_strategy
from finetune_operator.planner.sources import from_table
from finetune_operator.validation import check_document
from tests.conftest import minimal_job

LLAMA_8B = "meta-llama/Llama-3.1-8B"


def full_job(gpu_type: str, strategy: str = "fsdp", nodes: int = 2, gpus: int = 4):
    return minimal_job(model={"uri": f"hf://{LLAMA_8B}"}, method={"type": "full"},
                       strategy={"type": strategy},
                       resources={"nodes": nodes, "gpusPerNode": gpus, "gpuType": gpu_type})


def test_no_recommendation_on_t4_is_one_the_validator_refuses():
    job = FineTuneJob.model_validate(full_job("Standard_NC64as_T4_v3"))
    plan = plan_job(job, from_table(job.spec.model.uri), "fsdp")
    rec = plan.recommendation
    options = [o for o in [rec.best, rec.on_requested_gpu, *rec.alternatives] if o]
    assert options
    for option in options:
        vm = catalog.find(option.vm_size)
        recommended = as_recommended(job, vm, option.nodes, option.strategy, option.precision)
        manifest = recommended.model_dump(by_alias=True, exclude_none=True, mode="json")
        _, problems = check_document(manifest)
        assert not [p for p in problems if p.severity == "error"], (option, problems)
    # the precision hint no longer sends the user into the fp16 + FSDP refusal
    note = next(n for n in plan.notes if "no bf16" in n)
    assert "fp16 is refused here" in note and "zero3" in note


def test_auto_never_resolves_to_a_refused_strategy_on_fp16_gpus():
    manifest = full_job("Standard_NC64as_T4_v3", strategy="auto")
    job = FineTuneJob.model_validate(manifest)
    chosen = resolve_strategy(job)
    vm = catalog.find("Standard_NC64as_T4_v3", 4)
    assert refused(as_recommended(job, vm, 2, chosen, "fp16")) is None, chosen


def test_impossible_gpus_per_node_is_a_warning_naming_a_vm_that_has_them():
    _, problems = check_document(full_job("Standard_NC24ads_A100_v4", nodes=2, gpus=8))
    warning = next(p for p in problems if p.path == "spec.resources.gpusPerNode")
    assert warning.severity == "warning"
    assert "Standard_NC24ads_A100_v4 has 1 (A100-80GB-PCIe)" in warning.message
    assert warning.fix == "use gpuType Standard_ND96amsr_A100_v4 (8 GPUs)"


def test_an_ambiguous_gpu_name_says_which_vm_it_planned_for():
    _, problems = check_document(full_job("a100", gpus=8))
    warning = next(p for p in problems if p.path == "spec.resources.gpuType")
    assert "could be A100-40GB, A100-80GB, A100-80GB-PCIe" in warning.message
    assert "planned as Standard_ND96asr_v4 (8 x A100-40GB)" in warning.message
    _, problems = check_document(full_job("A100-80GB", gpus=8))
    assert not [p for p in problems if p.path.startswith("spec.resources")]
