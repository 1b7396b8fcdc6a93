"""The planner's pure parts and its one edge (finding a config): catalog lookups, config
sources (never the network: a fake fetch stands in for the hub), `strategy: auto`,
verdicts and the recommendation."""

from __future__ import annotations

import json

import pytest

from finetune_operator import gpu_catalog as catalog
from finetune_operator.planner import plan_job, recommend, resolve_strategy
from finetune_operator.planner.architecture import from_hf_config
from finetune_operator.planner.known_models import KNOWN_MODELS
from finetune_operator.planner.plan import HEADROOM, fallback_strategy
from finetune_operator.planner.report import plan_with_notes
from finetune_operator.planner.sources import ModelConfig, ModelConfigs, fetch_from_hub, from_table
from finetune_operator.validation import check_document, parse_job
from tests.conftest import minimal_job

LLAMA_8B = ModelConfig(config=KNOWN_MODELS["meta-llama/Llama-3.1-8B"], source="test")


def job(**spec):
    return parse_job(minimal_job(**spec))


# --- catalog -----------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "per_node", "vm", "gpus"), [
    ("Standard_ND96asr_v4", 1, "Standard_ND96asr_v4", 8),
    ("nd96amsr_a100_v4", 1, "Standard_ND96amsr_A100_v4", 8),
    ("A100-80GB", 1, "Standard_NC24ads_A100_v4", 1),
    ("A100-80GB", 8, "Standard_ND96amsr_A100_v4", 8),  # #19 item 5: not a 1-GPU VM for 2x8
    ("H100", 8, "Standard_ND96isr_H100_v5", 8),
    ("H100", 1, "Standard_NC40ads_H100_v5", 1),
    ("h200", 1, "Standard_ND96isr_H200_v5", 8),
    ("T4", 1, "Standard_NC4as_T4_v3", 1),
    ("T4", 4, "Standard_NC64as_T4_v3", 4),
    ("T4-16GB", 1, "Standard_NC4as_T4_v3", 1),  # the name `finetune plan` prints
    ("H100-NVL-94GB", 2, "Standard_NC80adis_H100_v5", 2),
    ("V100-32GB", 1, "Standard_ND40rs_v2", 8),
])
def test_catalog_finds_vm_sizes_and_gpu_models(name, per_node, vm, gpus):
    found = catalog.find(name, per_node)
    assert found is not None and found.name == vm and found.gpus == gpus


def test_every_name_the_planner_prints_is_found():
    for name in catalog.known_names() + [gpu.name for gpu in catalog.GPUS]:
        assert catalog.find(name) is not None, name


def test_catalog_covers_the_series_users_pick_from():
    series = {vm.series for vm in catalog.VM_SIZES}
    assert series >= {"NCasT4_v3", "NCv3", "NDv2", "NC_A100_v4", "NDasrA100_v4",
                      "NDm_A100_v4", "NCads_H100_v5", "ND_H100_v5", "ND_H200_v5"}
    assert catalog.find("Standard_ND96asr_v4").gpu.memory_bytes == 40 * 1024**3
    assert catalog.find("Standard_ND96isr_H100_v5").interconnect == (
        "NVLink; InfiniBand 3200 Gb/s")
    assert catalog.find("MI300X") is None


def test_a_name_the_catalog_does_not_know_gets_its_closest_names_whatever_the_case():
    assert catalog.close_names("Standard_ND96asr_v5")[0] == "Standard_ND96asr_v4"
    assert catalog.close_names("STANDARD_ND96ASR_V5")[0] == "Standard_ND96asr_v4"
    assert catalog.close_names("ND96sr_v4")[0] == "Standard_ND96asr_v4"  # no Standard_
    assert catalog.close_names("a100-80g")[0] == "A100-80GB"
    assert "Standard_ND96asr_v4" in catalog.close_names("Standard_ND96asr_A100_v4")
    assert len(catalog.close_names("Standard_ND96asr_A100_v4")) <= 3
    assert catalog.close_names("MI300X") == []


# --- where configs come from -------------------------------------------------------------

def test_a_local_folder_or_file_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    configs = ModelConfigs(base_dir=tmp_path)
    assert configs.resolve(str(tmp_path)).source == f"path:{tmp_path / 'config.json'}"
    assert configs.resolve("./config.json").config == {"model_type": "llama"}
    assert configs.resolve(str(tmp_path / "missing")) is None


def test_hub_models_are_fetched_once_and_fall_back_to_the_table():
    calls = []

    def fetch(repo, revision):
        calls.append((repo, revision))
        return {"model_type": "llama", "vocab_size": 1} if repo == "me/custom" else None

    configs = ModelConfigs(fetch=fetch)
    custom = configs.resolve("hf://me/custom", "abc123")
    assert custom.source == "hub:me/custom@abc123"
    assert configs.resolve("hf://me/custom", "abc123") == custom
    assert calls == [("me/custom", "abc123")]  # remembered
    gated = configs.resolve("hf://meta-llama/Llama-3.1-8B")
    assert gated.source == "built-in table: meta-llama/Llama-3.1-8B"
    assert configs.resolve("hf://nobody/knows") is None


def test_offline_lookups_never_call_out():
    configs = ModelConfigs()  # no fetch
    assert configs.resolve("hf://Qwen/Qwen2.5-7B-Instruct").source.startswith("built-in")
    registry = "azureml://registries/azureml/models/mistralai-Mistral-7B-v01/versions/19"
    assert configs.resolve(registry).source == "built-in table: mistralai/Mistral-7B-v0.1"
    assert configs.resolve("pvc://models/llama") is None


def test_hub_offline_switch_skips_the_request(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://192.0.2.1:9")  # TEST-NET: would hang if used
    assert fetch_from_hub("meta-llama/Llama-3.1-8B", None, timeout=0.01) is None


def test_a_failing_hub_answers_none_quickly(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")  # refused at once, no network
    assert fetch_from_hub("org/name", "main", timeout=1.0) is None


def test_a_hub_that_does_not_answer_says_why_and_the_lookup_remembers_it(monkeypatch):
    """`finetune plan` without the hub planned from the built-in table (or said `unknown`)
    without a word of the hub; `--offline` said it. The reason is kept for the plan."""
    from finetune_operator.planner.sources import HubUnanswered, ask_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")  # refused at once, no network
    with pytest.raises(HubUnanswered) as refused:
        ask_hub("org/name", "main", timeout=1.0)
    assert str(refused.value) == "127.0.0.1:1: Connection refused"
    configs = ModelConfigs(fetch=ask_hub)
    known = configs.resolve("hf://meta-llama/Llama-3.1-8B")
    assert known.source == "built-in table: meta-llama/Llama-3.1-8B"
    assert configs.unanswered("hf://meta-llama/Llama-3.1-8B") == str(refused.value)
    assert configs.unanswered("hf://meta-llama/Llama-3.1-8B", "v2") is None  # not asked
    assert ModelConfigs(fetch=fetch_from_hub).unanswered("hf://org/name") is None


def test_the_hubs_refusals_are_named(monkeypatch):
    from finetune_operator.planner.sources import HubUnanswered, ask_hub
    from tests.support.hub_fake import FakeHub, Repo

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    repos = {"me/gated": Repo(files={"config.json": b"{}"}, token="secret"),
             "me/broken": Repo(files={"config.json": b"{not json"})}
    with FakeHub(repos) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        said = {}
        for repo in ("me/gated", "me/missing", "me/broken"):
            with pytest.raises(HubUnanswered) as refused:
                ask_hub(repo, None, timeout=5.0)
            said[repo] = str(refused.value)
    assert said == {"me/gated": "HTTP 401: no such repo, or a gated or private one (set "
                                "HF_TOKEN)",
                    "me/missing": "HTTP 404: no such repo, revision or file",
                    "me/broken": "its config.json is not JSON"}


def test_the_plan_says_the_hub_did_not_answer_and_where_the_config_came_from():
    llama = job(model={"uri": "hf://meta-llama/Llama-3.1-8B"},
                resources={"gpusPerNode": 1, "gpuType": "H100"})
    plan = plan_with_notes(llama, from_table("hf://meta-llama/Llama-3.1-8B"),
                           unanswered="huggingface.co: Name or service not known")
    assert plan.notes[1] == (  # after the strategy's
        "the hub did not answer (huggingface.co: Name or service not known) for "
        "hf://meta-llama/Llama-3.1-8B; its config.json came from the built-in table: "
        "meta-llama/Llama-3.1-8B")
    unknown = plan_with_notes(job(model={"uri": "hf://me/custom"}), None,
                              unanswered="huggingface.co: Name or service not known")
    assert unknown.reason == (
        "no config.json for hf://me/custom: the hub did not answer (huggingface.co: Name or "
        "service not known), and the planner's built-in table does not know it (`finetune "
        "plan --list-models` lists the models it knows) — give a local folder holding its "
        "config.json, or plan where the hub can be reached")


# --- strategy auto -----------------------------------------------------------------------

def test_auto_goes_through_the_planner_when_model_and_gpu_are_known():
    small = job(model={"uri": "hf://meta-llama/Llama-3.2-1B"}, method={"type": "full"},
                resources={"gpusPerNode": 8, "gpuType": "Standard_ND96amsr_A100_v4"})
    assert fallback_strategy(small) == "fsdp"
    assert resolve_strategy(small) == "ddp"  # 1B full fits replicated: no sharding traffic
    big = job(model={"uri": "hf://meta-llama/Llama-3.1-70B"}, method={"type": "full"},
              resources={"gpusPerNode": 8, "nodes": 4, "gpuType": "Standard_ND96amsr_A100_v4"})
    assert resolve_strategy(big) in ("fsdp", "zero3")
    mid = job(model={"uri": "hf://meta-llama/Llama-3.1-8B"}, method={"type": "full"},
              resources={"gpusPerNode": 8, "gpuType": "Standard_ND96amsr_A100_v4"})
    chosen = resolve_strategy(mid)
    assert chosen in ("zero1", "zero2", "fsdp", "zero3")
    plan = plan_with_notes(mid, from_table("hf://meta-llama/Llama-3.1-8B"))  # sized for chosen
    assert plan.strategy == chosen and plan.fits is True
    assert plan.per_gpu_bytes <= catalog.find("A100-80GB").gpu.memory_bytes * (1 - HEADROOM)


def test_auto_keeps_the_simple_rules_without_a_config_or_gpu_type():
    unknown = job(model={"uri": "hf://someone/unknown"}, method={"type": "full"},
                  resources={"gpusPerNode": 8, "gpuType": "H100"})
    assert resolve_strategy(unknown) == "fsdp"
    no_gpu_type = job(model={"uri": "hf://meta-llama/Llama-3.2-1B"}, method={"type": "full"},
                      resources={"gpusPerNode": 8})
    assert resolve_strategy(no_gpu_type) == "fsdp"
    assert resolve_strategy(job(strategy={"type": "zero2"})) == "zero2"
    assert resolve_strategy(job(strategy={"offload": "cpu"})) == "zero3"


# --- verdicts ----------------------------------------------------------------------------

def test_a_job_that_fits_says_how_much_it_uses():
    j = job(model={"uri": "hf://meta-llama/Llama-3.1-8B"},
            resources={"gpusPerNode": 1, "gpuType": "A100-80GB"})
    result = plan_job(j, LLAMA_8B, "ddp")
    assert result.fits is True and result.verdict == "fits"
    assert result.per_gpu_bytes == sum(result.breakdown.values())
    assert set(result.breakdown) == {"weights", "gradients", "optimizerStates", "activations",
                                     "temporaryBuffers", "cudaContext"}
    assert "of 80.0 GiB per GPU" in result.reason
    data = result.to_dict()
    assert {"fits", "perGpuBytes", "breakdown", "recommendation"} <= set(data)


def test_a_job_that_does_not_fit_names_a_setup_that_does():
    j = job(model={"uri": "hf://meta-llama/Llama-3.1-8B"}, method={"type": "full"},
            strategy={"type": "ddp"},
            resources={"gpusPerNode": 8, "gpuType": "Standard_ND96amsr_A100_v4"})
    result = plan_job(j, LLAMA_8B, "ddp")
    assert result.fits is False and result.verdict == "does-not-fit"
    mine = result.recommendation.on_requested_gpu
    assert mine is not None and mine.strategy != "ddp"
    assert f"fits as strategy {mine.strategy}" in result.reason


def test_more_gpus_per_node_than_the_vm_size_has_does_not_fit():
    """No node of the VM size can hold a worker, however small the model: refused before
    launch like a job too big for its memory, with the same GPUs on more nodes named."""
    sized = job(resources={"nodes": 2, "gpusPerNode": 16, "gpuType": "Standard_ND96asr_v4"})
    result = plan_job(sized, LLAMA_8B, "fsdp")
    assert result.fits is False and result.verdict == "does-not-fit"
    assert result.reason == (
        "spec.resources.gpusPerNode: 16 GPUs per node, but Standard_ND96asr_v4 has 8 "
        "(A100-40GB), so no node of it can hold a worker — set gpusPerNode: 8 and nodes: 4 "
        "(32 GPUs), or a gpuType with more GPUs per node")
    fitting = job(resources={"nodes": 4, "gpusPerNode": 8, "gpuType": "Standard_ND96asr_v4"})
    assert plan_job(fitting, LLAMA_8B, "fsdp").verdict == "fits"
    # a GPU name may be a machine outside Azure's catalog (16 x V100 in a DGX-2): the
    # validator warns, the verdict is on memory alone
    by_gpu = job(resources={"gpusPerNode": 16, "gpuType": "V100-32GB"})
    assert plan_job(by_gpu, LLAMA_8B, "fsdp").verdict == "fits"


@pytest.mark.parametrize(("spec", "model", "why"), [
    ({"model": {"uri": "hf://someone/unknown"}}, None, "no config.json for hf://someone/unknown"),
    ({"resources": {"gpusPerNode": 1}}, LLAMA_8B, "gpuType is not set"),
    ({"resources": {"gpusPerNode": 1, "gpuType": "MI300X"}}, LLAMA_8B, "not in the planner"),
    ({"resources": {"gpusPerNode": 0}}, LLAMA_8B, "CPU workers"),
    ({}, ModelConfig(config={"model_type": "bert"}, source="x"), "no vocab_size"),
])
def test_unknown_verdicts_say_why(spec, model, why):
    result = plan_job(job(**spec), model, "ddp")
    assert result.fits is None and result.verdict == "unknown"
    assert why in result.reason


def test_bf16_on_a_gpu_without_it_is_planned_in_fp16_with_a_note():
    j = job(model={"uri": "hf://meta-llama/Llama-3.1-8B"}, method={"type": "qlora"},
            resources={"gpusPerNode": 1, "gpuType": "T4"})
    result = plan_job(j, LLAMA_8B, "ddp")
    assert result.precision == "fp16"
    assert any("no bf16" in note for note in result.notes)


def test_the_recommendation_is_the_cheapest_fit_per_token():
    shape = from_hf_config(KNOWN_MODELS["meta-llama/Llama-3.1-70B"])
    j = job(model={"uri": "hf://meta-llama/Llama-3.1-70B"}, method={"type": "full"},
            resources={"gpusPerNode": 8, "gpuType": "H100"})
    rec = recommend(shape, j)
    best = rec.best
    assert best is not None and best.per_gpu_bytes <= best.gpu_memory_bytes * (1 - HEADROOM)
    assert all(best.cost_per_million_tokens <= o.cost_per_million_tokens
               for o in rec.alternatives)
    assert best.vm_size in rec.why and "cheapest" in rec.why


def test_an_option_names_each_setting_it_sets_otherwise_than_the_plan():
    """#51 item 7: options are sized from the spec as written, so they may differ from the
    plan in more than the VM size; `changes` names each field, and only those."""
    settled = job(model={"uri": "hf://meta-llama/Llama-3.1-8B"},
                  strategy={"type": "ddp", "gradientCheckpointing": False,
                            "gradientCheckpointingPolicy": "selective"},
                  hyperparameters={"maxSteps": 10, "microBatchSize": 2},
                  resources={"gpusPerNode": 1, "gpuType": "Standard_NC40ads_H100_v5"})
    same = plan_job(settled, LLAMA_8B, "ddp").recommendation.best
    assert (same.vm_size, same.strategy, same.nodes) == ("Standard_NC40ads_H100_v5", "ddp", 1)
    assert same.changes == []  # nor the policy of a checkpointing that stays off
    unset = job(model={"uri": "hf://meta-llama/Llama-3.1-8B"}, strategy={"type": "ddp"},
                resources={"gpusPerNode": 8, "gpuType": "H100-80GB"})
    planned = unset.model_copy(deep=True)
    planned.spec.strategy.gradient_checkpointing = True
    planned.spec.strategy.gradient_checkpointing_policy = "selective"
    result = plan_job(planned, LLAMA_8B, "ddp", as_written=unset)
    best = result.recommendation.best
    assert best.vm_size != result.gpu_type
    assert [(c.field, c.from_, c.to) for c in best.changes] == [
        ("spec.resources.gpuType", "Standard_ND96isr_H100_v5", best.vm_size),
        ("spec.resources.gpusPerNode", 8, best.gpus_per_node),
        ("spec.strategy.gradientCheckpointingPolicy", "selective", "full")]
    assert best.to_dict()["changes"][0] == {"field": "spec.resources.gpuType",
                                            "from": "Standard_ND96isr_H100_v5",
                                            "to": best.vm_size}


def test_nothing_fits_is_said_plainly():
    shape = from_hf_config({**KNOWN_MODELS["meta-llama/Llama-3.1-70B"], "vocab_size": 10**8})
    j = job(method={"type": "full"}, resources={"gpusPerNode": 8, "gpuType": "H100"},
            dataset={"uri": "pvc://d/x.jsonl", "maxSeqLength": 131072})
    rec = recommend(shape, j)
    assert rec.best is None and "nothing in the catalog fits" in rec.why


@pytest.mark.parametrize(("method", "smaller"), [
    ("full", ", use spec.method.type: lora or qlora, "),
    ("lora", ", use spec.method.type: qlora, "), ("qlora", None)])
def test_what_fits_nowhere_is_told_a_smaller_method_only_where_there_is_one(method, smaller):
    """A QLoRA job that fits nowhere was told `or use lora/qlora`: the method it has."""
    shape = from_hf_config({**KNOWN_MODELS["meta-llama/Llama-3.1-70B"], "vocab_size": 10**8})
    j = job(method={"type": method}, resources={"gpusPerNode": 1, "gpuType": "T4"},
            dataset={"uri": "pvc://d/x.jsonl", "maxSeqLength": 131072})
    why = recommend(shape, j).why
    assert why.startswith("nothing in the catalog fits up to 64 nodes with 10% headroom: "
                          "shorten spec.dataset.maxSeqLength, set "
                          "spec.hyperparameters.microBatchSize: 1, "), why
    assert why.endswith("or train a smaller model")
    if smaller:
        assert smaller in why
    else:
        assert "method" not in why and "lora" not in why


def test_a_job_no_catalog_gpu_holds_does_not_fit_without_a_gpu_type():
    """70B full fine-tuning on 1 GPU, no gpuType: `unknown — 1315.2 GiB per GPU`, exit 0.
    No GPU of the catalog holds that: does-not-fit, as with a gpuType. The operator's
    admission, planning for a cluster's GPUs it does not know, still says unknown."""
    seventy = ModelConfig(config=KNOWN_MODELS["meta-llama/Llama-3.1-70B"], source="test")
    j = job(model={"uri": "hf://meta-llama/Llama-3.1-70B"}, method={"type": "full"},
            resources={"gpusPerNode": 1})
    result = plan_job(j, seventy, "ddp")
    assert (result.fits, result.verdict) == (False, "does-not-fit")
    assert ", more than any GPU in the planner's catalog (the largest: H200-141GB, 140.4 " \
           "GiB): weights " in result.reason, result.reason
    assert result.reason.endswith(f" — fits on {result.recommendation.best.nodes} x "
                                  f"{result.recommendation.best.vm_size} with "
                                  f"{result.recommendation.best.strategy}")
    assert plan_job(j, seventy, "ddp", search_catalog=False).verdict == "unknown"
    assert plan_job(job(resources={"gpusPerNode": 1}), LLAMA_8B, "ddp").verdict == "unknown"


def test_validate_warns_about_a_gpu_type_the_planner_does_not_know():
    _, problems = check_document(minimal_job(resources={"gpuType": "MI300X"}))
    assert [(p.path, p.severity) for p in problems] == [("spec.resources.gpuType", "warning")]
    assert "memory check before launch is skipped" in problems[0].message


def test_finetune_run_warns_where_the_operator_would_refuse():
    from finetune_operator.local.config import plan_warnings
    from finetune_operator.planner.sources import from_table

    spec = {"model": {"uri": "hf://meta-llama/Llama-3.1-70B"}, "method": {"type": "full"},
            "strategy": {"type": "ddp"}, "resources": {"gpusPerNode": 1, "gpuType": "A100-80GB"}}
    model = from_table(spec["model"]["uri"])
    [warning] = plan_warnings(job(**spec), model)
    assert warning.startswith("warning: spec.resources.gpuType: predicted not to fit")
    assert "the operator would not launch this job" in warning
    skipped = {**spec, "resources": {**spec["resources"], "skipFeasibilityCheck": True}}
    assert plan_warnings(job(**skipped), model) == []
    small = {**spec, "model": {"uri": "hf://Qwen/Qwen2.5-0.5B"}}
    assert plan_warnings(job(**small), from_table(small["model"]["uri"])) == []
    # no gpuType: the operator launches it; no GPU the planner knows holds it
    anywhere = {**spec, "resources": {"gpusPerNode": 1}}
    [warning] = plan_warnings(job(**anywhere), model)
    assert warning.startswith("warning: predicted not to fit any GPU the planner knows — ")
    assert "operator" not in warning


def test_grpo_is_planned_with_its_kv_cache_its_sampling_time_and_its_reference():
    """GRPO samples a round's completions before its forward passes: a third candidate
    peak holding the weights, the optimizer's states and the KV cache of the process's
    completions (2 x layers x KV width x 2 bytes x rows x maxSeqLength), and sampling
    time in the step (shared by `iterations` steps). With full weights and beta > 0 a frozen
    copy of the weights sits beside the model all along, sharded as the model is."""
    def plan(method: str, rows: int, beta: float = 0.0, iterations: int = 1,
             strategy: str = "ddp", gpus: int = 1):
        spec = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B"}, "method": {"type": method},
                "resources": {"gpusPerNode": gpus, "gpuType": "Standard_NC40ads_H100_v5"},
                "strategy": {"type": strategy, "gradientCheckpointing": True},
                "hyperparameters": {"batchSizePerDevice": rows, "microBatchSize": 1,
                                    "maxSteps": 100},
                "dataset": {"uri": "pvc://data/prompts.jsonl", "format": "prompt",
                            "maxSeqLength": 4096},
                "objective": {"type": "grpo", "grpo": {
                    "numGenerations": 8, "maxCompletionLength": 2048, "beta": beta,
                    "iterations": iterations, "rewards": [{"name": "exact_match"}]}}}
        return plan_job(job(**spec), LLAMA_8B, strategy)

    config = KNOWN_MODELS["meta-llama/Llama-3.1-8B"]
    kv_width = config["num_key_value_heads"] * config["hidden_size"] // config[
        "num_attention_heads"]
    few, many = plan("lora", 8), plan("lora", 64)
    assert many.peak_phase == "generation"
    cache = 2 * config["num_hidden_layers"] * kv_width * 2 * 64 * 4096
    assert many.breakdown["kvCache"] == cache + 4 * 64 * config["vocab_size"]
    assert many.per_gpu_bytes > few.per_gpu_bytes + 0.8 * cache
    assert few.throughput.generation_seconds > 0
    once, twice = plan("lora", 8, iterations=1), plan("lora", 8, iterations=2)
    assert once.throughput.step_seconds - twice.throughput.step_seconds == pytest.approx(
        once.throughput.generation_seconds / 2, rel=1e-6)
    full, reference = plan("full", 8), plan("full", 8, beta=0.04)
    assert "referenceWeights" not in full.breakdown
    assert reference.breakdown["referenceWeights"] == 2 * reference.total_params
    # sharded as the model is: FSDP2 in fp32 as it reads the model, ZeRO-3 in bf16
    fsdp, zero3 = (plan("full", 8, beta=0.04, strategy=name, gpus=8) for name in ("fsdp",
                                                                                   "zero3"))
    assert fsdp.breakdown["referenceWeights"] == int(4 * fsdp.total_params / 8)
    assert zero3.breakdown["referenceWeights"] == int(2 * zero3.total_params / 8)


def test_dpo_is_planned_with_its_pairs_and_its_reference():
    """A DPO row holds a pair (two sequences of up to maxSeqLength): more activations per
    row than SFT's, and longer attention; with adapters each batch also runs the reference
    forward (adapters off), which full weights take once before training instead."""
    def plans(method: str):
        spec = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B"}, "method": {"type": method},
                "resources": {"gpusPerNode": 8, "gpuType": "Standard_ND96amsr_A100_v4"},
                "strategy": {"type": "fsdp", "gradientCheckpointing": True}}
        dpo = {"objective": {"type": "dpo"},
               "dataset": {"uri": "pvc://data/pairs.jsonl", "format": "preference"}}
        return plan_job(job(**spec), LLAMA_8B, "fsdp"), plan_job(job(**spec, **dpo),
                                                                  LLAMA_8B, "fsdp")

    def flops(plan) -> float:
        return plan.throughput.hardware_flops_per_token

    (lora_sft, lora_dpo), (full_sft, full_dpo) = plans("lora"), plans("full")
    assert lora_dpo.breakdown["activations"] > 1.9 * lora_sft.breakdown["activations"]
    longer = flops(full_dpo) / flops(full_sft)  # forward, backward, recompute: longer rows
    assert 1.0 < longer < 1.2
    # LoRA: forward, backward (half), recompute, plus the reference forward: 4 forwards, not 3
    assert flops(lora_dpo) / flops(lora_sft) == pytest.approx(longer * 4 / 3, rel=1e-9)
