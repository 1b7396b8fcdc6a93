"""`finetune plan` as a user runs it: a real subprocess, offline (the built-in table or a
local config.json), never the network."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, minimal_job
from tests.support import waits

pytestmark = pytest.mark.process

FINETUNE = [sys.executable, "-m", "finetune_operator.cli"]
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}


def finetune(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*FINETUNE, *args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, timeout=waits.seconds_left(), env=OFFLINE)


def manifest(**spec) -> str:
    return yaml.safe_dump(minimal_job(**spec))


def test_plan_prints_the_breakdown_and_the_verdict():
    result = finetune("plan", "--offline", str(REPO / "examples/03-aks-qlora-spot.yaml"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for line in ("weights", "gradients", "optimizer states", "activations",
                 "temporary buffers", "CUDA context", "total"):
        assert f"  {line}" in out
    assert "verdict: fits" in out and "recommendation: cheapest" in out
    assert "built-in table: mistralai/Mistral-7B-v0.3" in out


def test_plan_json_for_a_job_that_cannot_fit_exits_1():
    job = manifest(model={"uri": "hf://meta-llama/Llama-3.1-70B"}, method={"type": "full"},
                   strategy={"type": "ddp"}, resources={"gpusPerNode": 1})
    result = finetune("plan", "-", "--offline", "--gpu-type", "A100-80GB", "-o", "json",
                      stdin=job)
    assert result.returncode == 1, result.stderr
    data = json.loads(result.stdout)
    assert data["fits"] is False and data["verdict"] == "does-not-fit"
    assert data["perGpuBytes"] == sum(data["breakdown"].values())
    assert data["perGpuBytes"] > 80 * 1024**3
    assert data["recommendation"]["best"]["strategy"] in ("fsdp", "zero3")
    assert data["gpuType"] == "Standard_NC24ads_A100_v4"


def test_plan_reads_a_local_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
        "num_key_value_heads": 4}))
    path = tmp_path / "job.yaml"
    path.write_text(manifest(model={"uri": "./"}, resources={"gpusPerNode": 1, "gpuType": "T4"},
                             strategy={"precision": "fp16"}))
    result = finetune("plan", str(path), "-o", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["modelSource"] == f"path:{tmp_path / 'config.json'}"
    assert data["totalParams"] == 1_100_048_384  # TinyLlama-1.1B's shape
    assert data["fits"] is True


def test_plan_says_when_the_hub_did_not_answer_as_offline_does(tmp_path):
    """Without the hub (no network: huggingface.co's name does not resolve here, and a
    refused port stands for it anywhere) the plan had less and said nothing of it; now it
    says so, with the reason, where `--offline` says the hub was not asked."""
    no_hub = {**OFFLINE, "HF_ENDPOINT": "http://127.0.0.1:1"}
    del no_hub["HF_HUB_OFFLINE"]

    def plan(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*FINETUNE, "plan", *args], input=stdin, capture_output=True,
                              text=True, cwd=REPO, timeout=waits.seconds_left(), env=no_hub)

    known = plan(str(REPO / "examples/03-aks-qlora-spot.yaml"))
    assert known.returncode == 0, known.stderr
    assert ("note: the hub did not answer (127.0.0.1:1: Connection refused) for "
            "hf://mistralai/Mistral-7B-v0.3; its config.json came from the built-in table: "
            "mistralai/Mistral-7B-v0.3") in known.stdout, known.stdout
    unknown = plan("-", stdin=manifest(model={"uri": "hf://me/custom"},
                                       resources={"gpusPerNode": 1, "gpuType": "H100"}))
    assert unknown.returncode == 0, unknown.stderr
    assert ("verdict: unknown — no config.json for hf://me/custom: the hub did not answer "
            "(127.0.0.1:1: Connection refused), and the planner's built-in table does not "
            "know it") in unknown.stdout, unknown.stdout
    model = plan("--model", "me/custom")
    assert model.returncode == 2
    assert model.stderr.startswith("--model me/custom: not in the planner's built-in table, "
                                   "and the hub did not answer (127.0.0.1:1: Connection "
                                   "refused)"), model.stderr


def test_plan_before_make_demo_names_what_builds_the_examples_model(tmp_path):
    from finetune_trainer import layout
    from tests.cli.demo_tree import examples_in

    example = next(p for p in examples_in(tmp_path, demo_built=False)
                   if p.name == "01-tiny-cpu-lora.yaml")
    result = finetune("plan", str(example))
    assert result.returncode == 0, result.stderr
    assert ("verdict: unknown — no config.json for ../build/demo/tiny-llama: the path holds "
            "no config.json here that reads as JSON — run `make demo` first: it builds the "
            f"tiny model these examples use ({layout.DEMO_MODEL})") in result.stdout, (
        result.stdout)


def test_plan_without_a_config_is_unknown_not_an_error():
    result = finetune("plan", "-", "--offline", stdin=manifest(
        model={"uri": "pvc://models/mine"}, resources={"gpusPerNode": 1, "gpuType": "H100"}))
    assert result.returncode == 0
    assert "verdict: unknown — no config.json for pvc://models/mine" in result.stdout


def test_plan_refuses_an_invalid_manifest_like_validate():
    result = finetune("plan", "-", stdin=manifest(resources={"nodes": 0}))
    assert result.returncode == 2
    assert "spec.resources.nodes: is 0" in result.stderr


def test_a_gpu_type_typed_on_the_command_line_is_one_the_planner_knows():
    """`--gpu-type H1000` planned as `verdict: unknown`, exit 0, and `--gpu-type` on a job
    of CPU workers was ignored; both are refused, exit 2, saying what to type."""
    example = str(REPO / "examples/02-aks-fsdp-full-8b.yaml")
    typo = finetune("plan", "--offline", example, "--gpu-type", "H1000")
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr.startswith("--gpu-type H1000: not in the planner's catalog — did you "
                                  "mean H100 or "), typo.stderr
    cpu = finetune("plan", "--offline", str(REPO / "examples/01-tiny-cpu-lora.yaml"),
                   "--gpu-type", "H100")
    assert cpu.returncode == 2
    assert cpu.stderr.strip() == ("--gpu-type H100: the job's workers are CPU processes "
                                  "(spec.resources.gpusPerNode: 0) — set gpusPerNode to plan "
                                  "it on GPUs")
    assert finetune("plan", "--offline", example, "--gpu-type", "h100").returncode == 0


# --- #51 item 7 -------------------------------------------------------------------------

def test_a_gpu_type_option_plans_for_that_gpu_not_the_specs():
    """`--gpu-type A100` on a job of `gpuType: H100` warned that 'H100' could be two GPUs:
    the plan is made for A100, so the warnings are A100's (it could be three) and the
    spec's own are left out; A100-80GB, one memory size, has none."""
    job = manifest(model={"uri": "hf://meta-llama/Llama-3.1-8B"},
                   resources={"gpusPerNode": 4, "gpuType": "H100"})
    own = finetune("plan", "-", "--offline", stdin=job)
    assert "'H100' could be" in own.stderr
    other = finetune("plan", "-", "--offline", "--gpu-type", "A100", stdin=job)
    assert other.returncode == 0, other.stderr
    assert "H100" not in other.stderr
    assert other.stderr.startswith("--gpu-type A100: warning: spec.resources.gpuType: 'A100' "
                                   "could be A100-40GB, A100-80GB, A100-80GB-PCIe: planned as "
                                   "Standard_NC96ads_A100_v4"), other.stderr
    one_size = finetune("plan", "-", "--offline", "--gpu-type", "A100-80GB", stdin=job)
    assert one_size.returncode == 0 and one_size.stderr == ""


def test_the_recommendation_says_which_settings_differ_from_the_plan():
    """The plan (66.6 GiB, ~10,383 tokens/s) and its cheapest option on the same VM size
    and strategy (22.0 GiB, ~6,922 tokens/s) differed without a word: the option is sized
    from the spec as written (checkpointing on, micro-batch batchSizePerDevice), the plan
    with the settings chosen for the GPU. Each differing field is named, in the table and
    in the JSON."""
    job = manifest(model={"uri": "hf://meta-llama/Llama-3.1-8B"},
                   resources={"gpusPerNode": 1, "gpuType": "Standard_NC40ads_H100_v5"})
    data = json.loads(finetune("plan", "-", "--offline", "-o", "json", stdin=job).stdout)
    best = data["recommendation"]["best"]
    assert (best["vmSize"], best["strategy"]) == (data["gpuType"], data["strategy"])
    assert best["changes"] == [
        {"field": "spec.strategy.gradientCheckpointing", "from": False, "to": True},
        {"field": "spec.hyperparameters.microBatchSize", "from": 2, "to": 4}]
    table = finetune("plan", "-", "--offline", stdin=job).stdout.splitlines()
    at = next(i for i, line in enumerate(table) if line.startswith("recommendation: "))
    assert table[at + 1] == ("  differs from this plan in: spec.strategy.gradientCheckpointing"
                             ": false → true, spec.hyperparameters.microBatchSize: 2 → 4")


def test_offline_says_the_hub_was_not_asked_and_what_the_plan_used_instead():
    unknown = manifest(model={"uri": "hf://acme/unknown-7b"},
                       resources={"gpusPerNode": 1, "gpuType": "H100"})
    for args, why in ((["--offline"], "--offline"), ([], "HF_HUB_OFFLINE=1")):
        out = finetune("plan", "-", *args, stdin=unknown).stdout
        assert "could not be reached" not in out
        assert (f"verdict: unknown — no config.json for hf://acme/unknown-7b: the hub was not "
                f"asked (offline: {why}), and the planner's built-in table does not know it"
                ) in out, out
    known = finetune("plan", "--offline", str(REPO / "examples/03-aks-qlora-spot.yaml")).stdout
    assert ("note: offline (--offline): the hub was not asked for hf://mistralai/Mistral-7B-v0.3;"
            " its config.json came from the built-in table: mistralai/Mistral-7B-v0.3") in known


def test_the_known_gpus_and_models_are_listed():
    from finetune_operator import gpu_catalog as catalog
    from finetune_operator.planner.known_models import KNOWN_MODELS

    gpus = finetune("plan", "--list-gpus")
    assert gpus.returncode == 0, gpus.stderr
    for name in [gpu.name for gpu in catalog.GPUS] + [vm.name for vm in catalog.VM_SIZES]:
        assert f"\n{name} " in gpus.stdout, name
    assert "H100-NVL-94GB   H100-NVL, H100    93.6 GiB  yes" in gpus.stdout
    models = finetune("plan", "--list-models")
    assert models.returncode == 0, models.stderr
    assert all(f"\n{name} " in models.stdout for name in KNOWN_MODELS)
    assert any(line.startswith("meta-llama/Llama-3.1-8B ") and " 8.03B " in line
               for line in models.stdout.splitlines())
    data = json.loads(finetune("plan", "--list-gpus", "--list-models", "-o", "json").stdout)
    assert [g["name"] for g in data["gpus"]] == [gpu.name for gpu in catalog.GPUS]
    assert [v["name"] for v in data["vmSizes"]] == [vm.name for vm in catalog.VM_SIZES]
    eight = next(m for m in data["models"] if m["name"] == "meta-llama/Llama-3.1-8B")
    assert eight["totalParams"] == 8_030_261_248
    with_file = finetune("plan", "--list-gpus", str(REPO / "examples/03-aks-qlora-spot.yaml"))
    assert with_file.returncode == 2 and "take no FILE" in with_file.stderr


def test_a_model_is_planned_by_name_without_a_manifest(tmp_path):
    result = finetune("plan", "--model", "meta-llama/Llama-3.1-8B", "--method", "full",
                      "--gpus-per-node", "8", "--gpu-type", "H100-80GB", "--seq-len", "4096",
                      "--offline", "-o", "json")
    assert result.returncode in (0, 1) and result.stderr == "", result.stderr
    data = json.loads(result.stdout)
    assert data["totalParams"] == data["trainableParams"] == 8_030_261_248  # full
    assert (data["worldSize"], data["gpuType"]) == (8, "Standard_ND96isr_H100_v5")
    table = finetune("plan", "--model", "Qwen/Qwen2.5-0.5B", "--offline").stdout
    assert table.startswith("default/qwen2-5-0-5b: lora, ddp, bf16, 1 node x 1 GPU process, "
                            "micro-batch 4 x 2048 tokens"), table  # a manifest's defaults
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
        "num_key_value_heads": 4}))
    local = finetune("plan", "--model", str(tmp_path), "--gpu-type", "T4", "-o", "json")
    assert json.loads(local.stdout)["modelSource"] == f"path:{tmp_path / 'config.json'}"


def test_a_model_name_found_nowhere_and_a_plan_of_nothing_are_refused():
    typo = finetune("plan", "--model", "meta-llama/Llama-3.1-8b-instruc", "--offline")
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr.startswith("--model meta-llama/Llama-3.1-8b-instruc: not in the "
                                  "planner's built-in table, and the hub was not asked "
                                  "(offline: --offline) — did you mean "
                                  "meta-llama/Llama-3.1-8B-Instruct or "), typo.stderr
    nothing = finetune("plan")
    assert nothing.returncode == 2 and "Error: Missing argument 'FILE'." in nothing.stderr
    both = finetune("plan", str(REPO / "examples/03-aks-qlora-spot.yaml"), "--method", "full")
    assert both.returncode == 2 and "--method: only with --model" in both.stderr
    helped = finetune("plan", "--help").stdout
    assert all(option in helped for option in ("--model NAME", "--method", "--seq-len",
                                               "--gpus-per-node", "--list-gpus",
                                               "--list-models", "[FILE]"))


def test_every_key_of_the_plan_json_is_camel_case():
    """The `throughput` block's keys were snake_case (`step_seconds`) among camelCase."""
    data = json.loads(finetune("plan", "--offline", "-o", "json",
                               str(REPO / "examples/02-aks-fsdp-full-8b.yaml")).stdout)
    assert data["throughput"]["stepSeconds"] > 0 and data["recommendation"]["best"]["changes"]

    def keys(value) -> list[str]:
        if isinstance(value, dict):
            return [*value, *(k for v in value.values() for k in keys(v))]
        return [k for v in value for k in keys(v)] if isinstance(value, list) else []

    assert [k for k in keys(data) if not re.fullmatch(r"[a-z][a-zA-Z0-9]*", k)] == []


# --- a new user's findings ----------------------------------------------------------------

def test_a_job_no_gpu_of_the_catalog_holds_does_not_fit_without_a_gpu_type():
    """`--model …70B --method full` without a gpuType answered `verdict: unknown — 1315.2
    GiB per GPU`, exit 0: no GPU holds that, which is said, exit 1."""
    result = finetune("plan", "--model", "meta-llama/Llama-3.1-70B", "--method", "full",
                      "--offline")
    assert result.returncode == 1, result.stderr
    assert ("verdict: DOES NOT FIT — needs 1315.2 GiB per GPU with ddp on 1 GPU, more than any "
            "GPU in the planner's catalog (the largest: H200-141GB, 140.4 GiB): ") in result.stdout
    data = json.loads(finetune("plan", "--model", "meta-llama/Llama-3.1-70B", "--method",
                               "full", "--offline", "-o", "json").stdout)
    assert (data["fits"], data["verdict"], data["gpuType"]) == (False, "does-not-fit", None)


def test_a_sweep_is_planned_as_its_largest_trial():
    """`finetune plan` of example 07 said `skipped FineTuneSweep … no FineTuneJob found`,
    exit 2, the code of an invalid manifest: it plans the template with the largest of
    each searched number (LoRA rank 32 of 8, 16, 32), and says so."""
    sweep = finetune("plan", "--offline", str(REPO / "examples/07-sweep-lora-lr.yaml"))
    assert sweep.returncode == 0 and sweep.stderr == "", sweep.stderr
    assert sweep.stdout.startswith("ml-team/lr-rank: lora, ddp, bf16, 1 node x 1 GPU process")
    assert ("note: FineTuneSweep ml-team/lr-rank: planned as its largest trial, spec.template "
            "with hyperparameters.learningRate: 0.0005, method.lora.r: 32 (each searched "
            "number at its largest)") in sweep.stdout, sweep.stdout
    text = yaml.safe_load((REPO / "examples/07-sweep-lora-lr.yaml").read_text())
    text["spec"]["searchSpace"]["strategy.type"] = {"type": "choice", "values": ["ddp", "fsdp"]}
    unranked = finetune("plan", "-", "--offline", stdin=yaml.safe_dump(text))
    assert ("; strategy.type as the template has it: a trial with another value may need "
            "more memory") in unranked.stdout, unranked.stdout
    text["spec"]["searchSpace"]["method.lora.r"] = {"type": "choice", "values": [0, 8]}
    invalid = finetune("plan", "-", "--offline", stdin=yaml.safe_dump(text))
    assert invalid.returncode == 2 and invalid.stdout == ""
    assert "<stdin>: spec.searchSpace" in invalid.stderr and "skipped" not in invalid.stderr


def test_a_refusal_in_json_is_json_as_validates_is():
    """`plan X -o json` of a file that is not there printed nothing on standard output."""
    for args in (["/no/such/job.yaml"], ["--model", "acme/nothing-7b"],
                 [str(REPO / "examples/02-aks-fsdp-full-8b.yaml"), "--gpu-type", "H1000"]):
        result = finetune("plan", "--offline", "-o", "json", *args)
        assert result.returncode == 2 and result.stderr == "", result.stderr
        data = json.loads(result.stdout)
        assert data["valid"] is False and data["problems"][0]["severity"] == "error"
        assert set(data["problems"][0]) == {"source", "field", "message", "fix", "severity"}
    missing = finetune("plan", "--offline", "-o", "json", "/no/such/job.yaml")
    said = finetune("validate", "-o", "json", "/no/such/job.yaml")
    assert json.loads(missing.stdout)["problems"] == json.loads(said.stdout)["problems"]


def test_a_gpu_type_the_catalog_does_not_know_gets_the_same_few_names_in_a_manifest():
    """In the manifest, `gpuType: X100` was `unknown` with the catalog's ~35 names; as
    `--gpu-type X100`, the three it likely meant. Both say those three now; the manifest's
    is still a warning (as `finetune validate`'s), exit 0."""
    job = manifest(model={"uri": "hf://meta-llama/Llama-3.1-8B"},
                   resources={"gpusPerNode": 1, "gpuType": "X100"})
    result = finetune("plan", "-", "--offline", stdin=job)
    assert result.returncode == 0, result.stderr
    assert ("verdict: unknown — 22.3 GiB per GPU; spec.resources.gpuType 'X100': not in the "
            "planner's catalog — did you mean V100 or H100 or A100? (`finetune plan "
            "--list-gpus` lists the catalog)\n") in result.stdout, result.stdout
    typed = finetune("plan", "-", "--offline", "--gpu-type", "X100", stdin=job)
    assert typed.stderr.strip() == ("--gpu-type X100: not in the planner's catalog — did you "
                                    "mean V100 or H100 or A100? (`finetune plan --list-gpus` "
                                    "lists the catalog)")


def test_a_cpu_plan_shows_what_cpu_workers_hold_and_no_recomputation(tmp_path):
    """A CPU plan showed `CUDA context 0 MiB`, and `optimizer states 0 MiB` for 128 KiB;
    an unset gradientCheckpointing became full checkpointing, which only slows a CPU run."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}))
    path = tmp_path / "job.yaml"
    path.write_text(manifest(model={"uri": "./"}, resources={"gpusPerNode": 0},
                             dataset={"uri": "./data.jsonl", "maxSeqLength": 128}))
    result = finetune("plan", str(path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "CUDA context" not in out
    assert re.search(r"\n  optimizer states +\d+ KiB\n", out), out
    assert "checkpointing off" in out.splitlines()[0]
    assert ("note: gradientCheckpointing unset → off: CPU workers (recomputing activations "
            "only slows a CPU run)") in out
