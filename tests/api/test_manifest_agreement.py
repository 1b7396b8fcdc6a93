"""`finetune validate` accepts only what `finetune render` (and the operator) accepts for the
same backend, and validate, render and plan answer generated manifests with one line per
problem that names a field or a file position, never a traceback (#25, item 7 and the
property test). tests/support/fuzz_manifests.py runs the same checks on thousands."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from finetune_operator.admission import admit, offline_backends
from finetune_operator.cli import main
from finetune_operator.local.paths import local_path_problems
from finetune_operator.manifests import read_documents
from finetune_operator.validation import parse_job
from tests.cli.demo_tree import examples_in
from tests.conftest import REPO, minimal_job
from tests.support import waits
from tests.support.fuzz_manifests import check
from tests.support.manifest_generator import AZUREML, example_jobs, manifests

SEED = 25
COUNT = 250  # ~20 s on 2 cores; tests/support/fuzz_manifests.py runs thousands
CONSOLE_SCRIPT = Path(sys.executable).with_name("finetune")


def finetune(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        result.exc_info)
    return result.exit_code, result.stdout, result.stderr


def test_generated_manifests_get_one_line_answers_and_validate_agrees_with_render(tmp_path):
    found = []
    for index, generated in enumerate(manifests(SEED, COUNT)):
        for finding in check(generated, tmp_path).findings:
            found.append(f"#{index} {finding.kind} in {finding.command} "
                         f"({'; '.join(generated.mutations)}): {finding.detail[-600:]}")
    assert not found, "\n".join(found[:10])


def _aml(spec: dict) -> dict:
    return {**spec, "backend": "azureml", "azureml": dict(AZUREML),
            "output": {"uri": "azureml://datastores/workspaceblobstore/paths/out"}}


REFUSED_BY_THE_BACKEND = {
    "azureml-model-on-kubernetes": (
        {"model": {"uri": "azureml://registries/azureml/models/m/versions/1"}},
        "spec.model.uri: azureml locations cannot be reached from pods"),
    "azureml-output-on-kubernetes": (
        {"output": {"uri": "azureml://datastores/workspaceblobstore/paths/out"}},
        "spec.output.uri: azureml locations cannot be reached from pods"),
    "pvc-dataset-on-azureml": (
        _aml({"dataset": {"uri": "pvc://data/train.jsonl"}}),
        "spec.dataset.uri: pvc locations cannot be reached from Azure ML"),
    "output-not-a-datastore-folder-on-azureml": (
        {**_aml({}), "output": {"uri": "/outputs/run"}},
        "spec.output.uri: must be an Azure ML datastore folder for backend azureml"),
    "token-secret-on-azureml": (
        _aml({"model": {"uri": "hf://Qwen/Qwen2.5-0.5B",
                        "tokenSecretRef": {"name": "hf", "key": "token"}}}),
        "spec.model.tokenSecretRef: Kubernetes Secrets do not reach Azure ML workers"),
}


@pytest.mark.parametrize(("spec", "line"), REFUSED_BY_THE_BACKEND.values(),
                         ids=REFUSED_BY_THE_BACKEND.keys())
def test_validate_refuses_what_the_backend_refuses(tmp_path, spec, line):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(minimal_job(**spec)))
    for command in ("validate", "render"):
        code, _, stderr = finetune(command, str(path))
        assert code == 2, (command, stderr)
        assert f"{path}: {line}" in stderr, (command, stderr)


def test_relative_paths_are_one_warning_for_validate_and_refused_by_render(tmp_path):
    # the example as `make demo` left it: its model built (before, that path is an error)
    example = str(next(p for p in examples_in(tmp_path) if p.name == "01-tiny-cpu-lora.yaml"))
    code, _, stderr = finetune("validate", example)
    assert code == 0, stderr
    # one warning for all three relative locations
    assert stderr.count("only work with `finetune run`") == 1, stderr
    assert "warning: spec.model.uri: relative paths" in stderr
    code, _, stderr = finetune("render", example)
    assert code == 2
    assert "spec.output.uri: relative locations cannot be reached from pods" in stderr


EXAMPLE_JOBS = example_jobs()


@pytest.mark.parametrize("backend", ["kubernetes", "azureml"])
@pytest.mark.parametrize("example", range(len(EXAMPLE_JOBS)),
                         ids=[name for name, _ in EXAMPLE_JOBS])
def test_validate_and_render_agree_on_every_example_on_either_backend(tmp_path, example,
                                                                      backend):
    doc = copy.deepcopy(EXAMPLE_JOBS[example][1])
    doc["spec"]["backend"] = backend
    if backend == "azureml":
        doc["spec"].setdefault("azureml", dict(AZUREML))
    checked = check(yaml.safe_dump(doc), tmp_path)
    assert not checked.findings, checked.findings


def test_the_check_is_the_operators_for_a_job_the_api_accepts(monkeypatch):
    """What admission adds to `check_document`: the backend's refusals, and whether the
    backend is there at all, beside the API's own problems."""
    # the operator's trainer image, as the chart sets it (the default one is a warning)
    monkeypatch.setenv("FINETUNE_TRAINER_IMAGE", "registry.example/finetune-trainer:1.2.3")
    doc = minimal_job(model={"uri": "azureml://registries/azureml/models/m/versions/1"})
    admission = admit(doc, offline_backends())
    assert admission.job is not None and admission.backend is not None
    assert [(p.path, p.severity, p.cluster_only) for p in admission.problems] == [
        ("spec.model.uri", "error", False)]
    relative = minimal_job(output={"uri": "./out"})
    problems = admit(relative, offline_backends()).problems
    assert {(p.path, p.severity, p.cluster_only) for p in problems} == {
        ("spec.output.uri", "warning", True), ("spec.output.uri", "error", True)}
    # on one machine the backend's rules and the cluster's do not apply
    assert admit(relative, offline_backends(), "here").problems == []
    unknown = admit(minimal_job(backend="slurm", hyperparameters={"epochs": 1, "maxSteps": 5}),
                    offline_backends())
    assert {p.path for p in unknown.errors} == {"spec.backend", "spec.hyperparameters.maxSteps"}
    served = admit(minimal_job(backend="azureml", azureml=dict(AZUREML)),
                   {"kubernetes": offline_backends()["kubernetes"]})
    assert [str(p) for p in served.errors] == [
        "spec.backend: 'azureml' is not served by this operator — use one of: kubernetes"]


@pytest.mark.process
@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason="the finetune console script is not "
                    "installed beside this Python (pip install -e .)")
def test_the_console_script_answers_as_the_command_in_this_process(tmp_path):
    """A few of the generated manifests as a user runs them: `finetune` from the venv."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for index, generated in enumerate(manifests(SEED + 1, 3)):
        folder = tmp_path / str(index)
        folder.mkdir()
        path = folder / "job.yaml"
        here = check(generated, folder).outcomes
        for command, args in (("validate", ["validate"]), ("render", ["render"]),
                              ("plan", ["plan", "--offline"])):
            result = subprocess.run([str(CONSOLE_SCRIPT), *args, str(path)], env=env,
                                    capture_output=True, text=True,
                                    timeout=waits.seconds_left(), cwd=REPO)
            assert "Traceback" not in result.stderr, result.stderr
            assert result.returncode == here[command].code, (generated.mutations, command,
                                                             result.stderr)
            assert result.stderr == here[command].stderr


# --- review mends -------------------------------------------------------------------------

def test_a_manifests_folder_is_its_own_or_the_working_directory_for_stdin(tmp_path,
                                                                          monkeypatch):
    folder = tmp_path / "a#b"  # a '#' in a folder name is not a document number
    folder.mkdir()
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump_all([minimal_job(), minimal_job()]))
    assert [d.folder for d in read_documents(str(path))] == [folder, folder]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", open(path))  # noqa: SIM115 - closed by monkeypatch
    assert {d.folder for d in read_documents("-")} == {tmp_path}
    sys.stdin.close()


def test_validate_reads_relative_paths_from_the_manifests_folder(tmp_path):
    folder = tmp_path / "a#b"
    (folder / "data").mkdir(parents=True)
    (folder / "data/train.jsonl").write_text("{}\n")
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(minimal_job(dataset={"uri": "./data/train.jsonl"})))
    code, _, stderr = finetune("validate", str(path))
    assert code == 0
    assert "does not exist" not in stderr


def test_a_path_this_machine_cannot_look_at_is_a_warning_not_a_crash(tmp_path):
    job = parse_job(minimal_job(model={"uri": "/" + "a" * 3000}))
    [warning] = local_path_problems(job, tmp_path)
    assert warning.severity == "warning" and warning.path == "spec.model.uri"
    assert "cannot be looked at on this machine (File name too long)" in warning.message
    assert len(str(warning)) < 400


def test_the_planner_reads_no_config_from_a_path_it_cannot_look_at(tmp_path):
    from finetune_operator.planner.sources import ModelConfigs

    assert ModelConfigs(base_dir=tmp_path).resolve("/" + "a" * 3000) is None


def test_the_run_notes_come_from_the_trainer_configs_own_decision(tmp_path):
    from finetune_operator import planner
    from finetune_operator.local.config import local_config
    from finetune_operator.planner.sources import from_table

    job = parse_job(minimal_job(model={"uri": "hf://meta-llama/Llama-3.1-8B"},
                                dataset={"uri": "./data.jsonl"},
                                output={"uri": "./out"},
                                resources={"gpusPerNode": 8,
                                           "gpuType": "Standard_ND96isr_H100_v5"}))
    model = from_table(job.spec.model.uri)
    config, settings = local_config(job, tmp_path, model)
    assert settings.notes and settings.notes == planner.choose_step_settings(
        job, model, config.strategy.type).notes
    assert config.strategy.gradient_checkpointing == settings.gradient_checkpointing
    assert config.strategy.compile == settings.compile


def test_the_planner_asks_the_validator_only_about_options_that_fit(monkeypatch):
    from finetune_operator import gpu_catalog as catalog
    from finetune_operator.api import FineTuneJob
    from finetune_operator.planner import plan
    from finetune_operator.planner.memory import estimate_memory

    asked = []
    real = plan.refused

    def refused(job):
        asked.append(job)
        return real(job)

    monkeypatch.setattr(plan, "refused", refused)
    job = FineTuneJob.model_validate(minimal_job(
        model={"uri": "hf://meta-llama/Llama-3.1-8B"}, method={"type": "full"},
        strategy={"type": "auto"}, resources={"nodes": 2, "gpusPerNode": 4,
                                              "gpuType": "Standard_NC64as_T4_v3"}))
    shape, _ = plan.shape_of(plan.from_table(job.spec.model.uri))
    vm = catalog.find("Standard_NC64as_T4_v3", 4)
    options = plan.options_on(shape, job, vm)
    assert options and asked
    for recommended in asked:
        r = recommended.spec.resources
        setup = plan.setup_for(job, recommended.spec.strategy.type, r.gpus_per_node * r.nodes,
                               recommended.spec.strategy.precision)
        estimate = estimate_memory(shape, setup.model_copy(update={"device": "cuda"}))
        assert plan._fits(estimate, catalog.find(r.gpu_type), plan.HEADROOM), r
    # fp16 on T4s: FSDP fits but is refused, so it is never offered
    assert "fsdp" not in {o.strategy for o in options}
