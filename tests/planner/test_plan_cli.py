"""`finetune plan` as a user runs it: a real subprocess, offline (the built-in table or a
local config.json), never the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, minimal_job

pytestmark = pytest.mark.process

FINETUNE = [sys.executable, "-m", "finetune_operator.cli"]
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}


def finetune(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*FINETUNE, *args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=OFFLINE)


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
