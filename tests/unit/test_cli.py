"""`finetune validate` and `finetune render` as a user runs them: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from tests.conftest import EXAMPLES, REPO, minimal_job

FINETUNE = [sys.executable, "-m", "finetune_operator.cli"]


def finetune(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*FINETUNE, *args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_validate_examples_exit_zero():
    result = finetune("validate", *map(str, EXAMPLES))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": valid FineTuneJob") == len(EXAMPLES)


def test_validate_reports_one_line_per_problem_and_exits_2():
    bad = minimal_job(method={"type": "qlora"}, resources={"gpusPerNode": 0, "nodes": 0})
    result = finetune("validate", "-", stdin=yaml.safe_dump(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["<stdin>: spec.resources.nodes: is 0, must be at least 1 — set a value at "
                     "least 1"]
    assert result.stdout == ""


def test_validate_every_rule_problem_on_its_own_line():
    bad = minimal_job(method={"type": "qlora"}, resources={"gpusPerNode": 0},
                      strategy={"precision": "fp32"})
    result = finetune("validate", "-", stdin=yaml.safe_dump(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("<stdin>: spec.method.type: qlora needs GPUs")
    assert lines[1].startswith("<stdin>: spec.strategy.precision: qlora cannot compute in fp32")
    assert all(" — " in line for line in lines)


def test_validate_multi_document_file(tmp_path):
    good = minimal_job()
    bad = minimal_job(hyperparameters={})
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"}}
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([secret, good, bad]))
    result = finetune("validate", str(path))
    assert result.returncode == 2
    assert f"{path}#2: valid FineTuneJob default/demo" in result.stdout
    assert f"{path}#1: skipped Secret" in result.stderr
    assert f"{path}#3: spec.hyperparameters: neither epochs nor maxSteps is set" in result.stderr


def test_validate_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: finetune.dev/v1alpha1\nkind: FineTuneJob\nspec:\n  model: [\n")
    result = finetune("validate", str(path))
    assert result.returncode == 2
    assert f"{path}:5:1: not valid YAML" in result.stderr


def test_validate_missing_file():
    result = finetune("validate", "does-not-exist.yaml")
    assert result.returncode == 2
    assert "does-not-exist.yaml: cannot read: No such file or directory" in result.stderr


def test_validate_file_without_jobs(tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    result = finetune("validate", str(path))
    assert result.returncode == 2
    assert "no FineTuneJob found" in result.stderr


def test_warnings_keep_exit_zero():
    result = finetune("validate", str(REPO / "examples/01-tiny-cpu-lora.yaml"))
    assert result.returncode == 0
    assert "warning: spec.model.uri: relative paths" in result.stderr


def test_render_kubernetes_job_yaml():
    result = finetune("render", str(REPO / "examples/02-aks-fsdp-full-8b.yaml"))
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    assert config_map["metadata"]["name"] == "llama-8b-full-trainer"
    trainer = yaml.safe_load(config_map["data"]["trainer.yaml"])
    assert trainer["kind"] == "TrainerConfig"
    assert trainer["dataset"]["uri"] == "/mnt/pvc/datasets/support-chats/train.jsonl"
    assert trainer["strategy"]["type"] == "fsdp"


def test_render_json_and_invalid_input():
    result = finetune("render", "-o", "json", str(REPO / "examples/04-azureml-zero3.yaml"))
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)["inputs"]["model"]  # the Azure ML command job
    assert model["path"].startswith("azureml://registries/") and model["type"] == "uri_folder"
    bad = finetune("render", "-", stdin=yaml.safe_dump(minimal_job(backend="slurm")))
    assert bad.returncode == 2
    assert "spec.backend: 'slurm' is not an installed backend" in bad.stderr


def test_help_reads_well():
    result = finetune("--help")
    assert result.returncode == 0
    assert "validate" in result.stdout and "render" in result.stdout
    sub = finetune("validate", "--help")
    assert "exits 2 when any manifest is invalid" in sub.stdout
    assert "--all-namespaces" in finetune("operator", "--help").stdout
    both = finetune("operator", "--all-namespaces", "--namespace", "ml")
    assert both.returncode == 2 and "not both" in both.stderr
