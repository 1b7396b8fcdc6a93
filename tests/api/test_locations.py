"""A job's locations are parsed once (`spec.locations`) and each backend says where its
workers open them (`mount`): the trainer config, the volumes and the refusals all follow."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune_operator.api import FineTuneJob
from finetune_operator.backends import BackendContext
from finetune_operator.backends.azureml import jobspec
from finetune_operator.backends.kubernetes.backend import KubernetesBackend
from finetune_operator.local.config import local_mount
from finetune_operator.settings import OperatorSettings
from finetune_operator.trainer_config import build_trainer_config, unreachable_locations
from finetune_operator.validation import parse_job, relative_locations
from finetune_trainer.config import ModelSource
from finetune_trainer.uris import Unreachable, UriError, parse_location
from tests.conftest import minimal_job

KUBERNETES = KubernetesBackend(BackendContext(settings=OperatorSettings()))


def test_each_section_parses_with_its_own_forms_and_names_its_field():
    assert parse_location("dataset", "https://example.com/d.jsonl").scheme == "https"
    with pytest.raises(UriError) as refused:
        parse_location("output", "hf://org/name")
    assert refused.value.field == "spec.output.uri"
    assert "use pvc://claim/path" in refused.value.fix
    assert ModelSource(uri="pvc://models/llama").location.uri.pvc_claim == "models"


def test_the_spec_parses_model_dataset_and_output_in_that_order():
    job = parse_job(minimal_job(dataset={"uri": "./data.jsonl"}))
    assert [(loc.field, loc.scheme) for loc in job.spec.locations] == [
        ("spec.model.uri", "hf"), ("spec.dataset.uri", "relative"),
        ("spec.output.uri", "pvc")]
    assert relative_locations(job) == ["spec.dataset.uri"]


def test_pods_open_claims_where_the_pod_mounts_them_and_the_rest_as_written():
    job = parse_job(minimal_job(dataset={"uri": "pvc://data/train.jsonl"}))
    model, dataset, output = (KUBERNETES.mount(loc) for loc in job.spec.locations)
    assert model == job.spec.model.uri  # the hub: fetched by the worker
    assert dataset == "/mnt/pvc/data/train.jsonl"
    config = build_trainer_config(job, KUBERNETES.mount)
    assert (config.dataset.uri, config.output.uri) == (dataset, output)


def test_azure_ml_binds_its_own_inputs_and_output_and_refuses_claims():
    job = FineTuneJob.model_validate(minimal_job(
        backend="azureml",
        model={"uri": "azureml://registries/azureml/models/llama/versions/1"},
        dataset={"uri": "https://example.com/train.jsonl"},
        output={"uri": "azureml://datastores/blob/paths/out"}))
    model, dataset, output = (jobspec.mount(loc) for loc in job.spec.locations)
    assert (model, dataset, output) == (
        "${{inputs.model}}", job.spec.dataset.uri, "${{outputs.output}}")
    assert jobspec.data_inputs(job) == {"model": ("custom_model", job.spec.model.uri)}
    claim = FineTuneJob.model_validate(minimal_job()).spec.output.location
    with pytest.raises(Unreachable, match="must be an Azure ML datastore folder"):
        jobspec.mount(claim)


def test_finetune_run_resolves_relative_paths_and_refuses_cluster_locations(tmp_path: Path):
    mount = local_mount(tmp_path)
    job = parse_job(minimal_job(dataset={"uri": "./data/train.jsonl"}))
    assert mount(job.spec.dataset.location) == str(tmp_path / "data" / "train.jsonl")
    problems = unreachable_locations(job, mount)
    assert [p.path for p in problems] == ["spec.output.uri"]  # pvc://
    assert "exist only on the cluster" in problems[0].message
    assert problems[0].fix.startswith("use a local path")
