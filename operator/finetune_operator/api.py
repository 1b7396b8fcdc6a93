"""The FineTuneJob API: the types are the source of truth.

The CRD in `crds/` is generated from these models (`make crds`), so descriptions,
defaults and enums written here are what `kubectl explain ftj.spec` shows. The
trainer's sections come from `finetune_trainer.config`, the contract every worker reads.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

from finetune_trainer.config import (
    API_GROUP,
    API_VERSION,
    ApiModel,
    CheckpointPolicy,
    ConcreteStrategy,
    DatasetSource,
    Hyperparameters,
    MethodConfig,
    ModelSource,
    ObjectiveConfig,
    OutputConfig,
    PreflightConfig,
    StrategyConfig,
    section,
)
from finetune_trainer.record import ProgressRecord
from finetune_trainer.uris import Location

KIND = "FineTuneJob"
PLURAL = "finetunejobs"
SINGULAR = "finetunejob"
SHORT_NAMES = ["ftj"]
VERSION = API_VERSION.split("/", 1)[1]

# Children get the job's name plus a suffix (the longest is "-trainer"), and an Indexed
# Job's pods get "-<index>": 47 keeps every derived name a valid 63-character label.
MAX_NAME_LENGTH = 47
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

GUID_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"

# Kubernetes resource quantity (e.g. 16, "64Gi", "500m"); int or string on the wire.
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
Quantity = Annotated[
    str,
    BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v),
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN,
                    "anyOf": [{"type": "integer"}, {"type": "string"}]}),
]
StringMap = Annotated[
    dict[str, Annotated[str, Field(max_length=4096, description="Value.")]], Field(max_length=64)]

DEFAULT_BACKEND = "kubernetes"
"""`spec.backend` when a manifest leaves it out."""

BY_NAME = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}
"""A list whose items are keyed by `name` (kubebuilder's `+listType=map`, `+listMapKey=name`):
the API server refuses two items of one name by itself, and server-side apply merges by it."""

Phase = Literal[
    "Pending", "Queued", "Launching", "Running", "Restarting", "Suspended", "Succeeded", "Failed"
]
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})


class Resources(ApiModel):
    """The machines the job runs on."""

    nodes: int = Field(default=1, ge=1, le=1024)
    """Worker nodes (Kubernetes pods, or Azure ML instances). Must be at least 1."""
    gpus_per_node: int = Field(default=1, ge=0, le=16)
    """GPUs per node; one training process per GPU. 0 runs CPU workers (gloo), useful for
    smoke tests; they see no GPU, even on a machine that has some."""
    processes_per_node: int | None = Field(default=None, ge=1, le=256)
    """Training processes per CPU worker (only with `gpusPerNode: 0`; default 1)."""
    gpu_type: str | None = Field(default=None, max_length=128)
    """GPU model or Azure VM size the job expects (e.g. `A100-80GB`,
    `Standard_ND96asr_v4`), used to check the job fits before launch."""
    skip_feasibility_check: bool = False
    """Launch even when the planner predicts the job does not fit in the memory of
    `gpuType` (the Feasible condition still says so). For setups the planner cannot see,
    such as custom kernels or chunked losses."""
    cpu: Quantity | None = None
    """CPU request per node (e.g. `8`, `7500m`)."""
    memory: Quantity | None = None
    """Memory request per node (e.g. `64Gi`)."""

    @property
    def on_gpus(self) -> bool:
        """The workers are GPU processes, one per GPU; else CPU processes over gloo
        (`gpusPerNode: 0`). Decided here only: the planner, local runs, the renderers, the
        backends and the rules read it (tests/code/test_placement.py)."""
        return self.gpus_per_node > 0

    def processes(self) -> int:
        """Training processes per node."""
        return self.gpus_per_node or self.processes_per_node or 1


class RunPolicy(ApiModel):
    """Restart budget and deadlines. These may be changed while the job runs."""

    backoff_limit: int = Field(default=3, ge=0, le=1000)
    """Gang restarts allowed after worker failures before the job fails. Preemption,
    node loss and eviction do not count."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the job when it has been active this long."""
    startup_deadline_seconds: int = Field(default=1800, ge=0)
    """Fail the job when workers have not started training this long after launch
    (image pulls, scheduling, model download; under Kueue, after admission). 0 disables. A
    queued job asks Kueue (v0.20) to wait for its pods a minute longer than this (7200 s at
    most), so that this deadline, not Kueue's eviction, acts on a slow start."""
    stall_timeout_seconds: int = Field(default=1800, ge=0)
    """Mark the job Stalled, then restart it, when no step completes this long (not while
    rank 0 pushes the trained model to `output.export`, each push with its own timeouts and
    retries). 0 disables."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the FineTuneJob this long after it succeeds or fails (outputs are kept)."""
    suspend: bool = False
    """Stop the workers after a checkpoint; set back to false to resume from it."""


class Toleration(ApiModel):
    """A Kubernetes toleration added to every worker pod."""

    key: str | None = Field(default=None, max_length=317)
    """Taint key to tolerate; empty with `Exists` tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """`Equal` matches key and value; `Exists` matches the key alone."""
    value: str | None = Field(default=None, max_length=63)
    """Taint value to match with `Equal`."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches every effect."""
    toleration_seconds: int | None = None
    """With NoExecute: how long the pod stays bound after the taint appears."""


class KeyRef(ApiModel):
    """A key of a Secret or ConfigMap."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the object in the job's namespace."""
    key: str = Field(min_length=1, max_length=253)
    """Key within it."""


class EnvVarSource(ApiModel):
    """Where an environment variable's value comes from."""

    secret_key_ref: KeyRef | None = None
    """A key of a Secret: the value never appears in the spec."""
    config_map_key_ref: KeyRef | None = None
    """A key of a ConfigMap."""


class EnvVar(ApiModel):
    """An environment variable for every training process."""

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256)
    """Variable name."""
    value: str | None = Field(default=None, max_length=32768)
    """Literal value. Put credentials in a Secret and use valueFrom instead."""
    value_from: EnvVarSource | None = None
    """Take the value from a Secret or ConfigMap key."""


class PvcSource(ApiModel):
    """A PersistentVolumeClaim in the job's namespace."""

    claim_name: str = Field(min_length=1, max_length=253)
    """Name of the claim."""
    read_only: bool = False
    """Mount the claim read-only."""


class ConfigMapSource(ApiModel):
    """A ConfigMap's keys as files."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the ConfigMap."""


class SecretSource(ApiModel):
    """A Secret's keys as files."""

    secret_name: str = Field(min_length=1, max_length=253)
    """Name of the Secret."""


class EmptyDirSource(ApiModel):
    """A scratch folder that lives as long as the pod."""

    medium: Literal["", "Memory"] = ""
    """`Memory` for a tmpfs; empty for the node's disk."""
    size_limit: Quantity | None = None
    """Upper bound on the folder's size (e.g. `100Gi`)."""


class Volume(ApiModel):
    """An extra volume mounted into every worker. Set exactly one source."""

    name: str = Field(pattern=DNS_1123_LABEL, max_length=63)
    """Volume name, unique within the job."""
    mount_path: str = Field(pattern=r"^/\S*$", max_length=1024)
    """Where the volume appears in every worker."""
    read_only: bool = False
    """Mount it read-only."""
    persistent_volume_claim: PvcSource | None = None
    """A PersistentVolumeClaim (pvc:// locations are mounted automatically)."""
    config_map: ConfigMapSource | None = None
    """A ConfigMap's keys as files."""
    secret: SecretSource | None = None
    """A Secret's keys as files."""
    empty_dir: EmptyDirSource | None = None
    """Scratch space that lives as long as the pod."""

    def sources(self) -> list[str]:
        return [name for name in ("persistent_volume_claim", "config_map", "secret", "empty_dir")
                if getattr(self, name) is not None]


class KubernetesSpec(ApiModel):
    """Settings of the `kubernetes` backend (AKS GPU node pools, or any cluster)."""

    image: str | None = Field(default=None, max_length=1024)
    """Trainer image. Defaults to the image the operator was installed with; overriding it
    is a cluster-admin choice (the image runs with the job's service account)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """When the kubelet pulls the image; Kubernetes' default when left out."""
    image_pull_secrets: list[Annotated[str, Field(min_length=1, max_length=253,
                                                  description="A Secret's name.")]] | None = (
        Field(default=None, max_length=16))
    """Names of the Secrets (type kubernetes.io/dockerconfigjson, in the job's namespace)
    the kubelet pulls the image with, for a private registry. Defaults to the operator's
    setting (the chart's `trainer.imagePullSecrets`); `[]` pulls with none."""
    node_selector: StringMap = Field(default_factory=dict)
    """Node labels the workers must run on (e.g. `agentpool: gpunp`)."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Extra tolerations. The GPU taint toleration (`sku=gpu:NoSchedule` on AKS) is added
    automatically when `gpusPerNode` > 0."""
    spot: bool = False
    """Run on spot (low-priority) nodes: adds the AKS spot toleration and node affinity.
    Evictions restart the gang from the last checkpoint without using the restart budget."""
    infiniband: bool = False
    """Request the cluster's RDMA device (the resource name is an operator setting), add
    IPC_LOCK, and set NCCL's InfiniBand environment."""
    shm_size: Quantity | None = None
    """Size of /dev/shm (a memory-backed emptyDir). Defaults to no limit beyond the pod's."""
    priority_class_name: str | None = Field(default=None, max_length=253)
    """PriorityClass of the worker pods, for preemption between jobs."""
    queue_name: str | None = Field(default=None, max_length=63)
    """Kueue LocalQueue: the Job is created suspended and starts when Kueue admits it."""
    service_account_name: str | None = Field(default=None, max_length=253)
    """Service account of the worker pods (e.g. one bound to an Azure workload identity)."""
    volumes: list[Volume] = Field(default_factory=list, max_length=32, json_schema_extra=BY_NAME)
    """Extra volumes mounted into every worker."""
    env: list[EnvVar] = Field(default_factory=list, max_length=128, json_schema_extra=BY_NAME)
    """Extra environment for training processes. Rendezvous names (MASTER_ADDR, RANK,
    WORLD_SIZE, PET_*, ...) are reserved."""
    labels: StringMap = Field(default_factory=dict)
    """Extra labels on worker pods (e.g. `azure.workload.identity/use: "true"`)."""
    annotations: StringMap = Field(default_factory=dict)
    """Extra annotations on worker pods."""


class AzureMLSpec(ApiModel):
    """Settings of the `azureml` backend: where the Azure ML command job is submitted.
    Credentials come from the operator's workload identity, never from the spec."""

    subscription_id: str = Field(pattern=GUID_PATTERN)
    """Azure subscription id (a GUID)."""
    resource_group: str = Field(min_length=1, max_length=90)
    """Resource group of the workspace."""
    workspace: str = Field(min_length=1, max_length=260)
    """Azure ML workspace name."""
    compute: str = Field(min_length=1, max_length=260)
    """Compute cluster (or attached Kubernetes compute) to run on."""
    instance_type: str | None = Field(default=None, max_length=260)
    """Instance type, for attached Kubernetes compute."""
    environment: str | None = Field(default=None, max_length=1024)
    """Azure ML environment (`name@latest`, `name:version` or an `azureml://` URI). Defaults
    to an environment built from the trainer image."""
    job_tier: Literal["Spot", "Basic", "Standard", "Premium"] | None = None
    """`Spot` for low-priority capacity; Azure ML's default otherwise."""
    shm_size: Quantity | None = None
    """Size of /dev/shm in every container (e.g. `64Gi`), which NCCL uses between the GPUs
    of a node. Azure ML's default (2g) when left out."""
    experiment_name: str | None = Field(default=None, max_length=255)
    """Azure ML experiment; defaults to the FineTuneJob's namespace."""


class FineTuneJobSpec(ApiModel):
    """What to fine-tune, on what, and how."""

    backend: str = Field(default=DEFAULT_BACKEND, pattern=DNS_1035_LABEL, max_length=63)
    """Where the job runs: `kubernetes` (torchrun pods on this cluster), `azureml` (an Azure
    ML command job), or the name of an installed backend plugin."""
    model: ModelSource
    dataset: DatasetSource
    method: MethodConfig = section(MethodConfig)
    objective: ObjectiveConfig = section(ObjectiveConfig)
    strategy: StrategyConfig = section(StrategyConfig)
    hyperparameters: Hyperparameters
    resources: Resources = section(Resources)
    output: OutputConfig
    run_policy: RunPolicy = section(RunPolicy)
    preflight: PreflightConfig = section(PreflightConfig)
    kubernetes: KubernetesSpec | None = None
    """Only read by the `kubernetes` backend."""
    azureml: AzureMLSpec | None = None
    """Required by the `azureml` backend; only read by it."""

    @property
    def locations(self) -> tuple[Location, Location, Location]:
        """Model, dataset and output, parsed (UriError where one is not a location of its
        kind: the CRD's patterns and `validation` refuse those before anything else reads)."""
        return self.model.location, self.dataset.location, self.output.location


class StatusModel(BaseModel):
    """Status is written by the operator; unknown fields from newer versions are kept out
    quietly rather than refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore",
                              use_attribute_docstrings=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Condition(StatusModel):
    """A Kubernetes-style condition."""

    type: str
    """Validated, Feasible, Admitted, Running, CollectivePreflight, Stalled, Degraded,
    Suspended, SpecChangeRefused, Complete, Exported or Failed (docs/troubleshooting.md:
    each reason and its fix)."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = ""
    """CamelCase reason, for machines."""
    message: str = ""
    """What happened and what to do, for people."""
    last_transition_time: datetime | None = None
    """When `status` last changed."""
    observed_generation: int | None = None
    """The spec generation the condition was computed from."""


class Progress(StatusModel):
    """Where training is, from the trainer's metrics."""

    step: int | None = None
    """Optimizer steps completed."""
    total_steps: int | None = None
    """Optimizer steps the job will run."""
    epoch: float | None = None
    """Passes over the training data so far (fractional)."""
    loss: float | None = None
    """Training loss over the last logging window."""
    eval_loss: float | None = None
    """Loss on the eval split at the latest evaluation (`dataset.evalSplit` or
    `evalFraction`); once Succeeded, the exported model's (under early stopping, the best
    evaluation's, which a sweep's evalLoss objective then ranks)."""
    tokens_per_second: float | None = None
    """Label tokens per second, summed over all ranks."""
    objective_metrics: dict[str, Annotated[float, Field(
        description="Over the last logging window, all ranks.")]] | None = None
    """The objective's own figures over the last logging window, under TRL's names. DPO:
    `rewards/chosen` and `rewards/rejected` (the mean reward, beta x log-ratio to the
    reference, of each side), `rewards/margins` (their mean difference),
    `rewards/accuracies` (the fraction of pairs whose chosen answer has the higher reward).
    GRPO: `reward` and `reward_std` (the completions' weighted reward), `rewards/<name>/mean`
    and `/std` per reward, `completions/mean_length`, `completions/clipped_ratio`, `kl`,
    `entropy`, `clip_ratio/region_mean`, ... None for SFT."""
    mfu: float | None = None
    """Model FLOPs utilisation, 0 to 1 (GPU only): attention counted over the token pairs
    each document actually attends, DPO's reference forward included (docs/performance.md
    has the convention, and torchtitan's beside it)."""
    eta_seconds: int | None = None
    """Estimated seconds until the last step, from the recent step rate."""
    last_step_time: datetime | None = None
    """When `step` last advanced (what stallTimeoutSeconds is measured from)."""
    preflight: dict[str, Any] | None = Field(default=None, exclude=True)
    """The trainer's collective preflight record (not stored: it becomes the
    `CollectivePreflight` condition)."""
    stopped_early: str | None = Field(default=None, exclude=True)
    """Why a finished run stopped before its last step (not stored: it becomes the
    `Complete` condition, reason `StoppedEarly`, and the message)."""
    exports: list[dict[str, str]] | None = Field(default=None, exclude=True)
    """A finished run's pushes to `spec.output.export`, `{uri, pushed}` or `{uri, error}`
    (not stored: they become the `Exported` condition and an event)."""
    exporting: bool = Field(default=False, exclude=True)
    """The steps are over and rank 0 pushes the model to `spec.output.export` (not stored:
    the stall check waits meanwhile)."""

    @classmethod
    def from_record(cls, record: ProgressRecord) -> Progress:
        """Rank 0's progress record (finetune_trainer.record), as every backend reads it."""
        return cls(step=record.step, total_steps=record.total_steps, epoch=record.epoch,
                   loss=record.loss, eval_loss=record.eval_loss,
                   tokens_per_second=record.tokens_per_second,
                   objective_metrics=record.objective_metrics,
                   mfu=record.mfu, eta_seconds=record.eta_seconds, preflight=record.preflight,
                   stopped_early=record.stopped_early, exports=record.exports,
                   exporting=record.phase == "Exporting")


class CheckpointRef(StatusModel):
    """The newest complete checkpoint: where a restart resumes from."""

    uri: str
    """Location of the checkpoint folder."""
    step: int
    """Optimizer step it was taken after."""
    time: datetime | None = None
    """When it was completed."""


class LaunchPlan(StatusModel):
    """What the operator decided before the first launch where the spec leaves it open
    (`strategy: auto`, unset gradient checkpointing, micro-batch and compile). Every launch and gang
    restart renders from this record, so a planner that answers differently after an
    operator upgrade never restarts a job under another strategy, whose checkpoints it
    could not read."""

    strategy: ConcreteStrategy
    """`spec.strategy.type`, or what `auto` resolved to."""
    gradient_checkpointing: bool
    """Whether activations are recomputed in the backward pass."""
    gradient_checkpointing_policy: CheckpointPolicy
    """Which activations are recomputed, when checkpointing is on."""
    compile: bool
    """Whether the model runs under torch.compile."""
    micro_batch_size: int | None = None
    """Sequences per forward pass on each device (absent in records written before the
    operator chose it: batchSizePerDevice)."""


class BackendRef(StatusModel):
    """The backend's own object for this job."""

    kind: str
    """e.g. `Job` or `AzureMLJob`."""
    name: str
    """Its name in the backend."""
    url: str | None = None
    """Link to the job in the backend's UI (Azure ML Studio)."""


class FineTuneJobStatus(StatusModel):
    """Observed state, written by the operator."""

    phase: Phase | None = None
    """Pending, Queued, Launching, Running, Restarting, Suspended, Succeeded or Failed."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Detailed state: one entry per condition type."""
    progress: Progress | None = None
    restarts: int = 0
    """Gang restarts counted against `runPolicy.backoffLimit`."""
    last_checkpoint: CheckpointRef | None = None
    """The newest complete checkpoint."""
    backend_ref: BackendRef | None = None
    start_time: datetime | None = None
    """When the workers were first launched."""
    completion_time: datetime | None = None
    """When the job succeeded or failed."""
    observed_generation: int | None = None
    """The spec generation the operator last acted on."""
    launched_spec: dict[str, Annotated[str, Field(description="Fingerprint of the section.")]] = (
        Field(default_factory=dict))
    """A fingerprint per spec section as launched; changes other than runPolicy after
    launch are refused."""
    spec_at_launch: Annotated[dict[str, Any], WithJsonSchema({
        "type": "object", "x-kubernetes-preserve-unknown-fields": True,
        "description": "The spec as launched, runPolicy aside."})] = Field(default_factory=dict)
    """The spec as launched, runPolicy aside: while a later change is refused, the workers
    are watched, restarted and put back as launched, never from the edited spec."""
    plan: LaunchPlan | None = None
    """The strategy and step settings the workers run with, decided once before the first
    launch."""
    launch_time: datetime | None = None
    """When the current attempt's workers were created (startupDeadlineSeconds counts
    from here)."""
    message: str | None = None
    """A one-line summary of the current phase."""


class ObjectMeta(BaseModel):
    """The metadata fields the API reads; everything else is passed through untouched."""

    model_config = ConfigDict(extra="allow")

    name: str
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class Named:
    """What a namespaced object of this API answers to."""

    if TYPE_CHECKING:  # a field of each model (here it would come first in every dump)
        metadata: ObjectMeta

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace or "default"


class FineTuneJob(Named, ApiModel):
    """A distributed LLM fine-tune: one manifest, any backend."""

    api_version: Literal["finetune.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["FineTuneJob"] = KIND
    metadata: ObjectMeta
    spec: FineTuneJobSpec
    status: FineTuneJobStatus | None = None


# --- FineTuneSweep -------------------------------------------------------------------------

SWEEP_KIND = "FineTuneSweep"
SWEEP_PLURAL = "finetunesweeps"
SWEEP_SINGULAR = "finetunesweep"
SWEEP_SHORT_NAMES = ["ftsweep"]
MAX_TRIALS = 1000
MAX_SWEEP_NAME_LENGTH = MAX_NAME_LENGTH - len(f"-{MAX_TRIALS - 1}")
"""Trial n is the FineTuneJob `<sweep>-<n>`: its name must fit a FineTuneJob's."""

Scalar = Annotated[
    float | int | str | bool,
    WithJsonSchema({"x-kubernetes-preserve-unknown-fields": True,
                    "description": "A number, a string or a boolean."}),
]
SweepMetric = Literal["evalLoss", "loss"]
Goal = Literal["minimize", "maximize"]
Sampling = Literal["grid", "random", "bayesian"]


class SearchParameter(ApiModel):
    """One searched field: a choice of values, a float range (uniform or log-uniform), or
    an integer range."""

    type: Literal["choice", "uniform", "logUniform", "intRange"]
    values: list[Scalar] | None = Field(default=None, min_length=1, max_length=1000)
    """`choice`: the values to try."""
    min: float | None = None
    """`uniform`, `logUniform`, `intRange`: the smallest value."""
    max: float | None = None
    """`uniform`, `logUniform`, `intRange`: the largest value."""
    step: int = Field(default=1, ge=1)
    """`intRange`: the distance between values."""

    @model_validator(mode="after")
    def _complete(self) -> SearchParameter:
        if self.type == "choice":
            if not self.values:
                raise ValueError("choice needs values — list them, e.g. values: [8, 16, 32]")
            return self
        example = {"intRange": "min: 4, max: 64", "uniform": "min: 0.0, max: 0.1"}.get(
            self.type, "min: 1e-5, max: 1e-3")  # one the type takes
        if self.min is None or self.max is None:
            raise ValueError(f"{self.type} needs min and max — e.g. {example}")
        if not self.min < self.max:
            raise ValueError(f"{self.type} needs min < max, and min is {self.min:g}, max is "
                             f"{self.max:g} — e.g. {example}")
        if self.type == "logUniform" and self.min <= 0:
            raise ValueError(f"logUniform needs min > 0 (it samples the log), and min is "
                             f"{self.min:g} — e.g. {example}")
        if self.type == "intRange" and not (float(self.min).is_integer()
                                            and float(self.max).is_integer()):
            raise ValueError("intRange needs whole min and max — e.g. min: 4, max: 64")
        return self


class SweepObjective(ApiModel):
    """What the sweep optimises: a figure every trial reports in `status.progress`."""

    metric: SweepMetric = "evalLoss"
    """`evalLoss` (needs `template.dataset.evalSplit` or `evalFraction` > 0) or `loss`
    (training loss)."""
    goal: Goal = "minimize"


class EarlyTermination(ApiModel):
    """Stopping trials that are unlikely to win, from the progress they report."""

    policy: Literal["none", "median", "bandit"] = "none"
    """`median`: stop a trial whose best value is worse than the median of the other trials'
    running averages at the same step. `bandit`: stop one that is not within `slackFactor`
    of the best value any trial reached by then."""
    delay_steps: int = Field(default=0, ge=0)
    """No trial is stopped before it reports this step."""
    slack_factor: float = Field(default=0.1, gt=0)
    """`bandit`: how far from the best a trial may be (0.1: within 10%)."""


class FineTuneSweepSpec(ApiModel):
    """A hyperparameter search: FineTuneJobs made from one template, each with other values
    of the searched fields."""

    template: FineTuneJobSpec
    """The spec of every trial's FineTuneJob; each trial writes to
    `<template.output.uri>/<sweep>-<n>`."""
    search_space: dict[str, SearchParameter] = Field(min_length=1, max_length=32)
    """The searched fields, by their path in the template, camelCase as in a manifest
    (`hyperparameters.learningRate`, `method.lora.r`)."""
    objective: SweepObjective = section(SweepObjective)
    sampling: Sampling = "random"
    """`grid` (every combination, in order), `random`, or `bayesian` (optuna's TPE, fed the
    finished trials)."""
    seed: int = Field(default=0, ge=0)
    """Trial n's values depend only on the seed, n and the trials finished before it: the
    same sweep suggests the same values."""
    max_trials: int = Field(default=10, ge=1, le=MAX_TRIALS)
    """Trials to run at most (a grid stops at its last combination)."""
    parallel_trials: int = Field(default=1, ge=1, le=100)
    """Trials running at once."""
    early_termination: EarlyTermination = section(EarlyTermination)
    timeout_seconds: int | None = Field(default=None, ge=1)
    """The sweep's time budget: after it no trial starts, and running ones are stopped."""


TrialPhase = Literal["Creating", "Pending", "Queued", "Launching", "Running", "Restarting",
                     "Suspended", "Succeeded", "Failed", "Stopped"]


class CurvePoint(StatusModel):
    step: int
    """The trial's step."""
    value: float
    """The objective's metric at that step."""


class TrialStatus(StatusModel):
    """One trial: recorded before its FineTuneJob is created, so a restart never makes it
    twice."""

    number: int
    name: str
    """Its FineTuneJob."""
    params: dict[str, Scalar]
    """The searched fields' values."""
    phase: TrialPhase = "Creating"
    """Creating (recorded, its FineTuneJob not seen yet), the FineTuneJob's phase, or Stopped
    (early termination or the sweep's budget ended it)."""
    step: int | None = None
    """The last step its progress showed."""
    objective: float | None = None
    """The metric at that step."""
    curve: list[CurvePoint] = Field(default_factory=list)
    """The metric by step, as sampled from the trial's progress (at most 32 points)."""
    output: str
    """Where the trial writes its checkpoints and model."""
    message: str | None = None
    """Why it stopped or failed."""


class BestTrial(StatusModel):
    """The finished trial with the best objective so far."""

    number: int
    name: str
    objective: float
    params: dict[str, Scalar]
    output: str
    """Where its model is."""


class FineTuneSweepStatus(StatusModel):
    """Observed state, written by the operator."""

    phase: Literal["Running", "Succeeded", "Failed"] | None = None
    trials: list[TrialStatus] = Field(default_factory=list)
    """Every trial, in the order they were made."""
    trial_count: int = 0
    """Trials made so far."""
    running_trials: int = 0
    """Trials not finished."""
    best: BestTrial | None = None
    start_time: datetime | None = None
    completion_time: datetime | None = None
    message: str | None = None
    """A one-line summary of the current phase."""
    observed_generation: int | None = None
    """The spec generation the operator last looked at: an edit of a sweep refused as
    invalid starts it, one of an ended sweep is said to change nothing."""


class FineTuneSweep(Named, ApiModel):
    """A hyperparameter sweep over FineTuneJobs."""

    api_version: Literal["finetune.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["FineTuneSweep"] = SWEEP_KIND
    metadata: ObjectMeta
    spec: FineTuneSweepSpec
    status: FineTuneSweepStatus | None = None


__all__ = [
    "API_GROUP",
    "API_VERSION",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "VERSION",
    "Condition",
    "FineTuneJob",
    "FineTuneJobSpec",
    "FineTuneJobStatus",
    "FineTuneSweep",
    "FineTuneSweepSpec",
    "FineTuneSweepStatus",
    "Phase",
    "Progress",
]
