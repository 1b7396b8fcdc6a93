"""The Azure ML command job a FineTuneJob becomes: the SDK's own validation, the YAML that
`az ml job create --file` takes read back with `load_job`, and field by field."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
import yaml

from finetune_operator.backends.azureml import jobspec
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import parse_job
from finetune_trainer.__main__ import bind_locations
from finetune_trainer.config import TrainerConfig
from tests.conftest import REPO, load_yaml, minimal_job
from tests.support import waits

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:azure"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:marshmallow")]
UID = "0b5e6c7e-1234-4abc-9def-001122334455"
SETTINGS = OperatorSettings(trainer_image="registry.example/finetune-trainer:1.2.3")
AML = {"subscriptionId": "00000000-0000-0000-0000-000000000000", "resourceGroup": "rg",
       "workspace": "ws", "compute": "gpu-cluster"}
DATASTORE = "azureml://datastores/workspaceblobstore/paths"


def example(**azureml) -> object:
    doc = load_yaml(REPO / "examples/04-azureml-zero3.yaml")
    doc["metadata"]["uid"] = UID
    doc["spec"]["azureml"].update(azureml)
    return parse_job(doc)


def aml_job(uid: str | None = UID, **spec) -> object:
    doc = minimal_job(**{"backend": "azureml", "azureml": AML,
                         "dataset": {"uri": f"{DATASTORE}/data/train.jsonl"},
                         "output": {"uri": f"{DATASTORE}/out/demo"}, **spec})
    doc["metadata"]["uid"] = uid
    return parse_job(doc)


def round_trip(job, tmp_path):
    """render → YAML file → azure.ai.ml.load_job, as `az ml job create --file` reads it."""
    from azure.ai.ml import load_job

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(jobspec.render(job, SETTINGS), sort_keys=False))
    return load_job(path)


def decoded_config(loaded) -> TrainerConfig:
    data = loaded.inputs[jobspec.CONFIG_INPUT]._data  # a literal input: the value itself
    assert isinstance(data, str)
    return TrainerConfig.model_validate_json(base64.b64decode(data))


def test_the_example_passes_the_sdks_validation():
    built = jobspec.build_command_job(example(shmSize="64Gi"), SETTINGS)
    result = built._validate()
    assert result.passed, result.error_messages
    assert jobspec.validate(example(), SETTINGS) == []


def test_example_round_trips_through_load_job_field_by_field(tmp_path):
    loaded = round_trip(example(shmSize="64Gi"), tmp_path)
    assert loaded.type == "command"
    assert loaded.name == f"mistral-zero3-aml-{UID.replace('-', '')[:12]}"
    assert loaded.display_name == "mistral-zero3-aml" and loaded.experiment_name == "ml-team"
    assert loaded.compute == "nd-a100-cluster"
    # distribution: Azure ML starts 8 processes per node and sets the rank env itself
    assert type(loaded.distribution).__name__ == "PyTorchDistribution"
    assert loaded.distribution.process_count_per_instance == 8
    assert "torchrun" not in loaded.command
    assert loaded.resources.instance_count == 2 and loaded.resources.shm_size == "64g"
    assert loaded.resources.instance_type is None
    assert loaded.queue_settings.job_tier == "standard"
    assert loaded.limits.timeout == 86400
    assert loaded.environment.image == SETTINGS.trainer_image
    model, dataset = loaded.inputs["model"], loaded.inputs["dataset"]
    assert (model.type, model.mode, model.path) == (
        "custom_model", "ro_mount",
        "azureml://registries/azureml/models/mistralai-Mistral-7B-v01/versions/19")
    assert (dataset.type, dataset.mode, dataset.path) == (
        "uri_file", "ro_mount",
        "azureml://datastores/workspaceblobstore/paths/finetune/support-chats/train.jsonl")
    output = loaded.outputs["output"]
    assert (output.type, output.mode, output.path) == (
        "uri_folder", "rw_mount",
        "azureml://datastores/workspaceblobstore/paths/finetune/outputs/mistral-zero3")
    assert loaded.tags == {"finetune.dev/job": "ml-team/mistral-zero3-aml",
                           "finetune.dev/uid": UID}
    assert loaded.command == (
        "finetune-train --config-base64 ${{inputs.trainer_config}} "
        "--location inputs.model=${{inputs.model}} "
        "--location inputs.dataset=${{inputs.dataset}} "
        "--location outputs.output=${{outputs.output}}")


def test_the_trainer_config_input_names_the_mounts_and_binds_to_their_paths(tmp_path):
    config = decoded_config(round_trip(example(), tmp_path))
    assert config.strategy.type == "zero3" and config.method.type == "full"
    assert (config.model.uri, config.dataset.uri, config.output.uri) == (
        "${{inputs.model}}", "${{inputs.dataset}}", "${{outputs.output}}")
    assert config.job.uid == UID
    bound = bind_locations(config, ["inputs.model=/mnt/azureml/cr/j/1/cap/model",
                                    "inputs.dataset=/mnt/azureml/cr/j/1/cap/train.jsonl",
                                    "outputs.output=/mnt/azureml/cr/j/1/cap/out"])
    assert (bound.model.uri, bound.dataset.uri, bound.output.uri) == (
        "/mnt/azureml/cr/j/1/cap/model", "/mnt/azureml/cr/j/1/cap/train.jsonl",
        "/mnt/azureml/cr/j/1/cap/out")
    with pytest.raises(ValueError, match=r"model.uri '\$\{\{inputs.model\}\}' needs "
                                         r"--location inputs.model=PATH"):
        bind_locations(config, ["outputs.output=/out"])
    with pytest.raises(ValueError, match="is not KEY=PATH"):
        bind_locations(config, ["inputs.model"])


def test_attached_kubernetes_compute_named_environment_and_cpu_workers(tmp_path):
    job = aml_job(azureml={**AML, "instanceType": "gpu-a100", "environment": "trainer-env@latest",
                           "jobTier": "Spot", "experimentName": "sweeps"},
                  model={"uri": "hf://Qwen/Qwen2.5-0.5B"},
                  dataset={"uri": "https://example.com/train.jsonl"},
                  resources={"nodes": 3, "gpusPerNode": 0, "processesPerNode": 4},
                  runPolicy={"activeDeadlineSeconds": 3600})
    loaded = round_trip(job, tmp_path)
    assert loaded.resources.instance_type == "gpu-a100" and loaded.resources.instance_count == 3
    assert loaded.distribution.process_count_per_instance == 4
    assert loaded.environment in ("azureml:trainer-env@latest", "trainer-env@latest")
    assert loaded.queue_settings.job_tier == "spot" and loaded.experiment_name == "sweeps"
    assert set(loaded.inputs) == {jobspec.CONFIG_INPUT}  # hub and https stay with the trainer
    # CPU workers on a GPU instance: the trainer takes any GPU it sees, rank by rank
    assert loaded.environment_variables["CUDA_VISIBLE_DEVICES"] == ""
    (tmp_path / "gpus").mkdir()
    gpus = round_trip(aml_job(resources={"gpusPerNode": 8}), tmp_path / "gpus")
    assert "CUDA_VISIBLE_DEVICES" not in gpus.environment_variables
    # torchrun sets it, Azure ML does not: the checkpoint writer sizes host memory by it
    assert (loaded.environment_variables["LOCAL_WORLD_SIZE"],
            gpus.environment_variables["LOCAL_WORLD_SIZE"]) == ("4", "8")
    assert "inputs.model" not in loaded.command
    config = decoded_config(loaded)
    assert config.model.uri == "hf://Qwen/Qwen2.5-0.5B"
    assert config.dataset.uri == "https://example.com/train.jsonl"


def test_a_dataset_folder_is_a_uri_folder_input():
    built = jobspec.build_command_job(aml_job(dataset={"uri": f"{DATASTORE}/data/chats/"}),
                                      SETTINGS)
    assert built.inputs["dataset"].type == "uri_folder"


@pytest.mark.parametrize(("uri", "kind"), [
    ("azureml://registries/azureml/models/mistralai-Mistral-7B-v01/versions/19",
     "custom_model"),
    ("azureml://subscriptions/00000000-0000-0000-0000-000000000000/resourcegroups/rg/"
     "workspaces/ws/models/llama/versions/3", "custom_model"),
    ("azureml://registries/azureml/models/llama/labels/latest", "custom_model"),
    (f"{DATASTORE}/models/llama/", "uri_folder"),
    (f"{DATASTORE}/models/llama", "uri_folder"),
], ids=["registry-model", "workspace-model", "registry-model-label", "datastore-folder",
        "datastore-folder-no-slash"])
def test_a_model_asset_is_a_model_input_and_a_datastore_folder_a_folder_input(
        uri, kind, tmp_path):
    """Azure ML delivers a registered model through a model input: the SDK's YAML schema
    reads `uri_file` / `uri_folder` inputs as data (DataInputSchema) and only the `*_model`
    types as models (ModelInputSchema), and resolves an asset name as a model only for
    those. `custom_model` (a folder delivered as it is) rather than `mlflow_model`: the
    trainer reads a save_pretrained folder and an MLflow-packaged one alike, and the type
    of a registered model is not known offline."""
    from azure.ai.ml._schema.job.input_output_entry import DataInputSchema, ModelInputSchema

    built = jobspec.build_command_job(aml_job(model={"uri": uri}), SETTINGS)
    result = built._validate()
    assert result.passed, result.error_messages
    sent = built._to_job()._to_rest_object().as_dict()["properties"]["inputs"]["model"]
    assert sent == {"uri": uri, "mode": "ReadOnlyMount", "jobInputType": kind}
    loaded = round_trip(aml_job(model={"uri": uri}), tmp_path).inputs["model"]
    assert (loaded.type, loaded.mode, loaded.path) == (kind, "ro_mount", uri)
    schema = ModelInputSchema if kind == "custom_model" else DataInputSchema
    assert kind in schema._declared_fields["type"].allowed_values


@pytest.mark.parametrize(("spec", "path", "words"), [
    ({"dataset": {"uri": "pvc://data/train.jsonl"}}, "spec.dataset.uri",
     "pvc locations cannot be reached from Azure ML"),
    ({"model": {"uri": "./model"}}, "spec.model.uri",
     "relative locations cannot be reached from Azure ML"),
    ({"output": {"uri": "pvc://ckpt/out"}}, "spec.output.uri",
     "must be an Azure ML datastore folder"),
    ({"output": {"uri": "azureml://registries/r/models/m/versions/1"}}, "spec.output.uri",
     "must be an Azure ML datastore folder"),
    ({"model": {"uri": "hf://meta-llama/Llama-3.1-8B", "tokenSecretRef": {"name": "hf"}}},
     "spec.model.tokenSecretRef", "Kubernetes Secrets do not reach Azure ML workers"),
    ({"azureml": {**AML, "shmSize": "1.5Gi"}}, "spec.azureml.shmSize", "not a whole size"),
    ({"azureml": {**AML, "environment": "azureml:trainer-env"}}, "spec.azureml.environment",
     "'azureml:trainer-env' names no version"),
], ids=["pvc-dataset", "relative-model", "pvc-output", "asset-output", "hf-token",
        "fractional-shm", "unversioned-environment"])
def test_what_azure_ml_cannot_run_is_refused_with_a_fix(spec, path, words):
    problems = jobspec.validate(aml_job(**spec), SETTINGS)
    assert [p.path for p in problems] == [path]
    assert words in problems[0].message and problems[0].fix


def test_a_value_with_a_line_break_is_quoted_on_one_line():
    """The value is quoted escaped in the message and in the fix alike: one problem, one
    line (#49)."""
    problems = jobspec.validate(aml_job(azureml={**AML, "environment": "/a\nb\x1b[2J"}),
                                SETTINGS)
    [problem] = problems
    assert str(problem) == ("spec.azureml.environment: '/a\\nb\\x1b[2J' names no version — "
                            "write /a\\nb\\x1b[2J@latest, or /a\\nb\\x1b[2J:<version>")


def test_names_are_derived_from_the_uid_and_the_attempt():
    job = aml_job()
    assert jobspec.attempt_name(job, 1) == "demo-0b5e6c7e1234"
    assert jobspec.attempt_name(job, 3) == "demo-0b5e6c7e1234-3"
    assert [jobspec.attempt_of(job, n) for n in (
        "demo-0b5e6c7e1234", "demo-0b5e6c7e1234-3", "demo-ffffffffffff", "demo-0b5e6c7e1234-x",
        None)] == [1, 3, None, None, None]
    recreated = aml_job(uid="99999999-1234-4abc-9def-001122334455")
    assert jobspec.attempt_name(recreated, 1) != jobspec.attempt_name(job, 1)
    assert jobspec.attempt_name(aml_job(uid=None), 1) == "demo"  # offline render


@pytest.mark.parametrize(("quantity", "docker"), [
    ("64Gi", "64g"), ("512Mi", "512m"), ("2G", "1953125k"), ("1000", "1000b"),
    ("1024", "1k"), ("3", "3b"), ("8192Mi", "8g")])
def test_shm_sizes_in_docker_form(quantity, docker):
    assert jobspec.docker_size(quantity) == docker


def test_without_the_sdk_the_backend_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "azure.ai.ml", None)  # as if the extra were missing
    with pytest.raises(jobspec.AzureSdkMissing, match=r"pip install 'finetune-operator\[azure\]'"):
        jobspec.require_sdk()
    problems = jobspec.validate(aml_job(), SETTINGS)
    assert [(p.path, p.fix) for p in problems] == [
        ("spec.backend", "pip install 'finetune-operator[azure]'")]


@pytest.mark.process
def test_render_backend_azureml_prints_yaml_that_load_job_accepts(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "finetune_operator.cli", "render", "--backend", "azureml",
         str(REPO / "examples/04-azureml-zero3.yaml")],
        capture_output=True, text=True, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr
    document = yaml.safe_load(result.stdout)
    assert document["$schema"].endswith("commandJob.schema.json")
    assert document["type"] == "command" and document["environment"] == {
        "image": OperatorSettings().trainer_image}
    path = tmp_path / "job.yaml"
    path.write_text(result.stdout)
    from azure.ai.ml import load_job

    loaded = load_job(path)
    assert loaded.distribution.process_count_per_instance == 8
    as_json = subprocess.run(
        [sys.executable, "-m", "finetune_operator.cli", "render", "-o", "json",
         str(REPO / "examples/04-azureml-zero3.yaml")],
        capture_output=True, text=True, check=False, cwd=REPO)
    assert json.loads(as_json.stdout)["outputs"]["output"]["mode"] == "rw_mount"
    kubernetes_job = subprocess.run(
        [sys.executable, "-m", "finetune_operator.cli", "render", "--backend", "azureml",
         str(REPO / "examples/02-aks-fsdp-full-8b.yaml")],
        capture_output=True, text=True, check=False, cwd=REPO)
    assert kubernetes_job.returncode == 2
    assert "spec.azureml: is required by backend azureml" in kubernetes_job.stderr


@pytest.mark.process
def test_a_job_the_sdk_refuses_is_refused_in_one_line_per_problem(tmp_path):
    """#25, item 1: the SDK's own validation (an environment it cannot parse) reached an
    attribute the validation result does not have; `render` crashed, the operator raised
    on every reconcile. Now both get Problems naming the field."""
    import subprocess
    import sys

    import yaml

    from finetune_operator.api import FineTuneJob
    from finetune_operator.backends.azureml import jobspec
    from tests.conftest import REPO

    manifest = yaml.safe_load((REPO / "examples/04-azureml-zero3.yaml").read_text())
    manifest["spec"]["azureml"]["environment"] = "hf://a/b"
    problems = jobspec.validate(FineTuneJob.model_validate(manifest))
    assert problems and all(p.path.startswith("spec.azureml (") for p in problems)
    assert any("Could not parse hf://a/b" in p.message for p in problems)

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "render", str(path)],
                            capture_output=True, text=True, timeout=waits.seconds_left())
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"{path}: spec.azureml (environment): " in result.stderr
    assert all(line.startswith(f"{path}: ") for line in result.stderr.splitlines())


@pytest.mark.parametrize(("uri", "kind"), [
    ("azureml://datastores/d/paths/chats/train.jsonl", "uri_file"),
    ("azureml://datastores/d/paths/chats/TRAIN.JSONL", "uri_file"),  # read in any case
    ("azureml://datastores/d/paths/chats/notes.txt", "uri_file"),  # refused by name, as a file
    ("azureml://datastores/d/paths/chats/", "uri_folder"),
    ("azureml://datastores/d/paths/chats/v1.2", "uri_folder"),
])
def test_a_dataset_is_mounted_as_a_file_where_it_names_one(uri, kind):
    """The trainer's own list of the data files it reads (finetune_trainer.uris) decides,
    as the API's one-file rule does."""
    from finetune_trainer.uris import parse_location

    assert jobspec.input_type(parse_location("dataset", uri)) == kind


def test_the_placeholder_trainer_image_is_a_warning_where_no_environment_is_named(
        monkeypatch):
    """The anonymous environment is built on the trainer image: the placeholder default
    would be rendered, and Azure ML could not pull it."""
    monkeypatch.delenv("FINETUNE_TRAINER_IMAGE", raising=False)
    (warning,) = jobspec.validate(example(), OperatorSettings())
    assert (warning.path, warning.severity) == ("spec.azureml.environment", "warning")
    assert "here finetune-trainer:0.1.0: a placeholder that no registry" in warning.message
    assert "FINETUNE_TRAINER_IMAGE" in warning.fix and "trainer.image.repository" in (
        warning.fix)
    assert jobspec.validate(example(), SETTINGS) == []
    assert jobspec.validate(example(environment="trainer-env@latest"), OperatorSettings()) == []
    assert jobspec.validate(example()) == [warning]  # the environment's settings

