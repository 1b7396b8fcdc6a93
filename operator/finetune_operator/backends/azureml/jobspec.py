"""FineTuneJob → Azure ML command job: pure and offline (no workspace, no credential).

One command job per attempt: `command()` with a PyTorch distribution of `gpusPerNode`
processes on each of `nodes` instances. Azure ML starts the processes and sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, which the trainer reads directly: no
second torchrun. The trainer config travels as a literal job input (base64 JSON, so no
upload to a datastore is needed); azureml:// model and data become mounted inputs, the
output a read-write mounted folder, and the config names them by Azure ML's placeholders
(`${{inputs.model}}`), bound to the mount paths on the command line.

azure-ai-ml is an optional extra: it is imported inside the functions that need it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune_operator.api import FineTuneJob
from finetune_operator.settings import OperatorSettings
from finetune_operator.trainer_config import build_trainer_config, unreachable_locations
from finetune_operator.validation import PUSH_THE_TRAINER_IMAGE, Problem, placeholder_image
from finetune_trainer.config import WORKSPACE_MODEL, TrainerConfig
from finetune_trainer.layout import FINAL_DIR, MERGED_DIR
from finetune_trainer.uris import Location, Unreachable, data_file_builder, job_placeholder

if TYPE_CHECKING:
    from azure.ai.ml.entities import Command

INSTALL_HINT = "pip install 'finetune-operator[azure]'"
CONFIG_INPUT = "trainer_config"
OUTPUT_NAME = "output"
TAG_JOB = "finetune.dev/job"
TAG_UID = "finetune.dev/uid"
REFUSED_FILES = (".txt", ".arrow")
"""Files the trainer does not read, mounted as the files they are all the same, so its
refusal names the file and the kinds it reads, where a folder mount would fail on Azure's
side."""
DATASTORE_PATH = re.compile(r"azureml://(subscriptions/[^/]+/resourcegroups/[^/]+/workspaces/"
                            r"[^/]+/)?datastores/[^/]+/paths/\S+", re.IGNORECASE)
MODEL_ASSET = re.compile(r"azureml://(registries/[^/]+|subscriptions/[^/]+/resourcegroups/[^/]+/"
                         r"workspaces/[^/]+|locations/[^/]+/workspaces/[^/]+)/models/[^/]+/"
                         r"(versions|labels)/[^/]+/?", re.IGNORECASE)
"""A registered model (in a registry or a workspace), as opposed to a datastore folder."""
COMMAND_JOB_SCHEMA = "https://azuremlschemas.azureedge.net/latest/commandJob.schema.json"
ANONYMOUS_ENVIRONMENT = "CliV2AnonymousEnvironment"
# Azure ML job names: letters, digits, '-' and '_', at most 255 characters.
JOB_NAME_LIMIT = 255


class AzureSdkMissing(ImportError):
    """azure-ai-ml is not installed (the `azure` extra)."""


def require_sdk() -> Any:
    """The azure.ai.ml module, or an error saying how to install it."""
    # "This is an experimental class" on every import and use of queue settings: noise
    logging.getLogger("azure.ai.ml._utils._experimental").setLevel(logging.ERROR)
    try:
        import azure.ai.ml as sdk  # azure-ai-ml: the optional `azure` extra
    except ImportError as error:
        raise AzureSdkMissing(f"the azureml backend needs the Azure ML SDK (azure-ai-ml), "
                              f"which is not installed — {INSTALL_HINT}") from error
    return sdk


# --- names: one per attempt, derived from the FineTuneJob's uid --------------------------

def base_name(job: FineTuneJob) -> str:
    """The first attempt's name: stable for the job's life, unique across re-creations of a
    job with the same name (the uid changes), readable in Studio."""
    uid = (job.metadata.uid or "").replace("-", "")
    return f"{job.name}-{uid[:12]}" if uid else job.name


def attempt_name(job: FineTuneJob, attempt: int) -> str:
    """Attempt 1 is the base name; a resume or restart submits `<base>-<attempt>`."""
    return base_name(job) if attempt <= 1 else f"{base_name(job)}-{attempt}"


def attempt_of(job: FineTuneJob, name: str | None) -> int | None:
    """Which attempt of `job` an Azure ML job name is, or None when it is not one."""
    base = base_name(job)
    if name == base:
        return 1
    if name and name.startswith(base + "-") and name[len(base) + 1:].isdigit():
        return int(name[len(base) + 1:])
    return None


# --- where the trainer finds its model, data and output -----------------------------------

def input_type(location: Location) -> str | None:
    """The Azure ML input type of an azureml:// model or dataset (None: not an input).

    A registered model is a `custom_model` input: Azure ML delivers model assets through
    the `*_model` types (the SDK reads `uri_*` inputs as data and resolves an asset name
    as a model only for those), and `custom_model` delivers the folder as it is, whether
    it holds a save_pretrained model or an MLflow-packaged one (the trainer reads both;
    the registered type is not known offline). A datastore path is a folder or a file."""
    if location.scheme != "azureml" or location.section == "output":
        return None
    if MODEL_ASSET.fullmatch(location.raw):
        return "custom_model"
    raw = location.raw.rstrip("/")
    if location.section == "dataset" and (
            data_file_builder(raw) or raw.lower().endswith(REFUSED_FILES)):
        return "uri_file"
    return "uri_folder"


def mount(location: Location) -> str:
    """Where an Azure ML job opens a location: azureml:// inputs and the output become
    placeholders the trainer binds to their mount paths; hub, https and image paths stay
    as they are."""
    if location.section == "output":
        if not DATASTORE_PATH.fullmatch(location.raw):
            raise Unreachable(
                "must be an Azure ML datastore folder for backend azureml (an Azure ML job's "
                "own disks are gone when it ends)", "use azureml://datastores/<store>/paths/"
                "<path>, e.g. azureml://datastores/workspaceblobstore/paths/finetune/<job>")
        return job_placeholder(f"outputs.{OUTPUT_NAME}")
    if location.scheme in ("pvc", "relative"):
        raise Unreachable(
            f"{location.scheme} locations cannot be reached from Azure ML",
            "use azureml://datastores/<store>/paths/<path>, an Azure ML asset "
            "(azureml://registries/... or azureml://subscriptions/...), an hf:// or "
            "https:// location, or a path inside the environment's image")
    if location.scheme == "azureml":
        return job_placeholder(f"inputs.{location.section}")
    return location.raw


def trainer_config(job: FineTuneJob) -> TrainerConfig:
    return build_trainer_config(job, mount)


def encode_config(config: TrainerConfig) -> str:
    """Base64 JSON: a literal input that survives Azure ML's command-line substitution."""
    return base64.b64encode(config.model_dump_json(by_alias=True, exclude_none=True)
                            .encode()).decode()


def data_inputs(job: FineTuneJob) -> dict[str, tuple[str, str]]:
    """name → (input type, azureml:// path) for the locations Azure ML mounts."""
    return {location.section: (kind, location.raw) for location in job.spec.locations
            if (kind := input_type(location)) is not None}


def command_line(job: FineTuneJob) -> str:
    """What every process runs: the trainer, its config, and where its locations are."""
    parts = ["finetune-train", "--config-base64", job_placeholder(f"inputs.{CONFIG_INPUT}")]
    for name in data_inputs(job):
        parts += ["--location", f"inputs.{name}={job_placeholder(f'inputs.{name}')}"]
    parts += ["--location",
              f"outputs.{OUTPUT_NAME}={job_placeholder(f'outputs.{OUTPUT_NAME}')}"]
    return " ".join(parts)


def docker_size(quantity: str) -> str:
    """A Kubernetes quantity (`64Gi`, `2G`, `512Mi`) in Docker's `<n><b|k|m|g>` form."""
    match = re.fullmatch(r"(\d+)([KMGTPE]i?|k)?", quantity)
    if match is None:
        raise ValueError(f"{quantity!r} is not a whole size such as 64Gi or 512Mi")
    number, unit = int(match.group(1)), match.group(2) or ""
    powers = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
              "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
              "Pi": 2**50, "Ei": 2**60}
    size = number * powers[unit]
    for suffix, scale in (("g", 2**30), ("m", 2**20), ("k", 2**10)):
        if size % scale == 0:
            return f"{size // scale}{suffix}"
    return f"{size}b"


def environment_reference(name: str) -> str:
    """`name@latest`, `name:version` or an azureml:// URI, as the SDK wants them."""
    return name if name.startswith(("azureml:", "azureml://")) else f"azureml:{name}"


def _versioned(environment: str) -> bool:
    """Whether an environment reference names its version, as Azure ML requires (the SDK
    refuses `my-env` only as it submits, in a message of several coloured lines)."""
    if environment.startswith(("azureml://", "azureml:/")):  # a registry URI or an ARM id
        return True
    name = environment.removeprefix("azureml:")
    return ":" in name or name.endswith("@latest")


def job_environment(job: FineTuneJob, settings: OperatorSettings) -> Any:
    """A named Azure ML environment, or an anonymous one built on the trainer image."""
    from azure.ai.ml.entities import Environment  # azure-ai-ml: the optional `azure` extra

    aml = job.spec.azureml
    if aml is not None and aml.environment:
        return environment_reference(aml.environment)
    return Environment(image=settings.trainer_image)


# --- the job ------------------------------------------------------------------------------

SDK_EXPERIMENTAL_LOGGERS = ("azure.ai.ml._utils._experimental",
                            "azure.ai.ml._schema.core.fields")


@contextlib.contextmanager
def experimental_fields_set_on_purpose():
    """The SDK warns "This is an experimental field" when it builds or reads back
    queue_settings; we set it on purpose (spec.azureml.jobTier), so users never see it."""
    loggers = [logging.getLogger(name) for name in SDK_EXPERIMENTAL_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def build_command_job(job: FineTuneJob, settings: OperatorSettings, attempt: int = 1
                      ) -> Command:
    """The azure-ai-ml command job for one attempt of `job`."""
    sdk = require_sdk()
    from azure.ai.ml import Input, Output  # azure-ai-ml: the optional `azure` extra
    from azure.ai.ml.entities import JobResourceConfiguration, QueueSettings

    spec, aml = job.spec, job.spec.azureml
    if aml is None:
        raise ValueError("spec.azureml is required by backend azureml")
    inputs: dict[str, Any] = {CONFIG_INPUT: encode_config(trainer_config(job))}
    for name, (kind, uri) in data_inputs(job).items():
        inputs[name] = Input(type=kind, path=uri, mode="ro_mount")
    outputs = {OUTPUT_NAME: Output(type="uri_folder", path=spec.output.uri, mode="rw_mount")}
    processes = spec.resources.processes()
    resources = JobResourceConfiguration(
        instance_count=spec.resources.nodes, instance_type=aml.instance_type,
        shm_size=docker_size(aml.shm_size) if aml.shm_size else None)
    environment_variables = {
        "FINETUNE_JOB": f"{job.namespace}/{job.name}",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "NCCL_DEBUG": "WARN",
        # Azure ML sets RANK, LOCAL_RANK, WORLD_SIZE and NODE_RANK but not this, which
        # torchrun sets: the background checkpoint write sizes its host memory by it
        "LOCAL_WORLD_SIZE": str(processes),
    }
    if not spec.resources.on_gpus:  # CPU workers on a GPU instance: none takes a GPU
        environment_variables["CUDA_VISIBLE_DEVICES"] = ""
    command_job = sdk.command(
        name=attempt_name(job, attempt),
        display_name=job.name if attempt <= 1 else f"{job.name} (attempt {attempt})",
        description=f"FineTuneJob {job.namespace}/{job.name}: {spec.method.type} fine-tune "
                    f"of {spec.model.uri}",
        experiment_name=aml.experiment_name or job.namespace,
        tags={TAG_JOB: f"{job.namespace}/{job.name}",
              **({TAG_UID: job.metadata.uid} if job.metadata.uid else {})},
        command=command_line(job),
        environment=job_environment(job, settings),
        environment_variables=environment_variables,
        inputs=inputs,
        outputs=outputs,
        compute=aml.compute,
        distribution=sdk.PyTorchDistribution(process_count_per_instance=processes),
        timeout=spec.run_policy.active_deadline_seconds,
    )
    command_job.resources = resources
    if aml.job_tier:
        with experimental_fields_set_on_purpose():
            command_job.queue_settings = QueueSettings(job_tier=aml.job_tier.lower())
    return command_job


def render(job: FineTuneJob, settings: OperatorSettings) -> dict[str, Any]:
    """The job as the YAML `az ml job create --file` takes (and `load_job` reads back)."""
    with experimental_fields_set_on_purpose():
        document = json.loads(json.dumps(build_command_job(job, settings)._to_job()._to_dict()))
    environment = document.get("environment")
    if isinstance(environment, dict) and environment.get("name") == ANONYMOUS_ENVIRONMENT:
        document["environment"] = {"image": environment["image"]}  # the CLI names it itself
    return {"$schema": COMMAND_JOB_SCHEMA, **document}


# --- what this backend cannot run -----------------------------------------------------------

def validate(job: FineTuneJob, settings: OperatorSettings | None = None) -> list[Problem]:
    """What Azure ML cannot run, beyond the API's own rules (the SDK's validation last, of
    a job with no error before it), and a warning where the job's environment would be
    built on the placeholder trainer image. `settings`: the operator's (None: from the
    environment, where `finetune render` and the operator read them)."""
    aml = job.spec.azureml
    image = None if aml is None or aml.environment else placeholder_image(job, settings)
    return _refusals(job) + ([] if image is None else [Problem(
        "spec.azureml.environment", "is not set, so the job's environment is built on the "
        f"trainer image of the operator's settings, here {image}: a placeholder that no "
        "registry serves",
        f"{PUSH_THE_TRAINER_IMAGE}, or name a registered environment (name@latest)",
        "warning", cluster_only=True)])


def _refusals(job: FineTuneJob) -> list[Problem]:
    """The errors: what this backend's rules refuse, else what the SDK's validation does."""
    spec = job.spec
    problems = unreachable_locations(job, mount)
    if spec.model.token_secret_ref is not None:
        problems.append(Problem(
            "spec.model.tokenSecretRef", "Kubernetes Secrets do not reach Azure ML workers",
            "register the model in Azure ML and use its azureml:// URI, or remove "
            "tokenSecretRef for a public hub model"))
    for index, target in enumerate(spec.output.export):
        if target.pushed_by_trainer:
            problems.append(Problem(
                f"spec.output.export[{index}].uri", "is pushed from the workers, which no "
                "Kubernetes Secret reaches on Azure ML", "register the model in the workspace "
                "instead (uri: azureml://models/NAME), or push the output once the job has "
                f"ended: finetune export <output> {target.uri}"))
    aml = spec.azureml
    if aml is not None and aml.shm_size is not None:
        try:
            docker_size(aml.shm_size)
        except ValueError as error:
            problems.append(Problem("spec.azureml.shmSize", str(error),
                                    "write a whole size, e.g. 64Gi"))
    if aml is not None and aml.environment and not _versioned(aml.environment):
        problems.append(Problem(
            "spec.azureml.environment", f"{aml.environment!r} names no version",
            f"write {aml.environment.removeprefix('azureml:')}@latest, or "
            f"{aml.environment.removeprefix('azureml:')}:<version>"))
    if job.metadata.uid and len(attempt_name(job, 1000)) > JOB_NAME_LIMIT:
        problems.append(Problem("metadata.name", "is too long for Azure ML job names",
                                "use a shorter name"))
    if problems or aml is None:
        return problems
    try:
        require_sdk()
    except AzureSdkMissing as error:
        return [Problem("spec.backend", "the operator has no Azure ML SDK", str(error)
                        .split(" — ")[-1])]
    return sdk_problems(job)


def sdk_problems(job: FineTuneJob) -> list[Problem]:
    """The SDK's own validation of the built job (schema, inputs, distribution)."""
    command_job = build_command_job(job, OperatorSettings())
    with experimental_fields_set_on_purpose():
        result = command_job._validate()
    # error_messages: yaml path → message, the validation result's public view
    return [Problem(f"spec.azureml ({path})", " ".join(str(message).split()),
                    "see the Azure ML command job schema")
            for path, message in result.error_messages.items()]


@dataclass(frozen=True)
class WorkspaceModel:
    """An `azureml://models/NAME` export target: what the operator registers once the job
    has succeeded, from the output datastore (nothing uploaded)."""

    uri: str
    name: str
    path: str

    def by_hand(self) -> str:
        return (f"register it by hand: az ml model create --name {self.name} --path "
                f"{self.path} --type custom_model")


def workspace_models(job: FineTuneJob) -> list[WorkspaceModel]:
    """The job's Azure ML model registrations, each with the output folder it registers
    (`final/`, or `merged/` for a `merged` target)."""
    output = job.spec.output.uri.rstrip("/")
    return [WorkspaceModel(target.uri, re.match(WORKSPACE_MODEL, target.uri)["name"],
                           f"{output}/{MERGED_DIR if target.merged else FINAL_DIR}")
            for target in job.spec.output.export
            if not target.pushed_by_trainer and re.match(WORKSPACE_MODEL, target.uri)]


def model_description(job: FineTuneJob) -> tuple[str, dict[str, str]]:
    """A registered model's description and tags: the job that trained it, from what."""
    spec = job.spec
    return (f"{spec.method.type} {spec.objective.type} fine-tune of {spec.model.uri} by "
            f"FineTuneJob {job.namespace}/{job.name}",
            {"finetune.dev/job": f"{job.namespace}/{job.name}",
             "finetune.dev/base-model": spec.model.uri,
             "finetune.dev/method": spec.method.type,
             "finetune.dev/objective": spec.objective.type})
