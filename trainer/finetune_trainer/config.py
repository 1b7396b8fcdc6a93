"""The trainer config: the contract between the operator and the trainer.

The sections here (model, dataset, method, strategy, hyperparameters, output) are the
trainer's part of the `FineTuneJob` spec: the operator's API composes them, so a field
is described once and means the same thing in a manifest and in the file every worker
reads. `TrainerConfig` adds what the operator resolves (job identity, a concrete
strategy) and is what `finetune-train --config FILE` reads.

This module must stay importable without torch: the operator image has no training stack.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, WithJsonSchema, create_model, model_validator

from finetune_trainer import objectives
from finetune_trainer.api_model import ApiModel, section
from finetune_trainer.uris import (
    DATASET_SCHEMES,
    MODEL_SCHEMES,
    OUTPUT_SCHEMES,
    Location,
    parse_location,
    uri_pattern,
)

API_GROUP = "finetune.dev"
API_VERSION = f"{API_GROUP}/v1alpha1"
TRAINER_CONFIG_KIND = "TrainerConfig"

MethodType = Literal["lora", "qlora", "full"]
StrategyType = Literal["auto", "ddp", "fsdp", "zero1", "zero2", "zero3"]
ConcreteStrategy = Literal["ddp", "fsdp", "zero1", "zero2", "zero3"]
Offload = Literal["none", "cpu", "nvme"]
Precision = Literal["bf16", "fp16", "fp32"]
CheckpointPolicy = Literal["full", "selective"]
AsyncCheckpoints = Literal["auto", "on", "off"]
DatasetFormat = Literal["auto", "chat", "instruction", "text", "preference", "prompt"]
Scheduler = Literal["cosine", "linear", "constant"]


def _uri(schemes: tuple) -> Any:
    # The pattern is enforced by the API server; Python checks the same regex in a
    # validation rule so the message can say which forms are accepted.
    return WithJsonSchema({"type": "string", "pattern": uri_pattern(schemes), "maxLength": 2048})


ModelUri = Annotated[str, _uri(MODEL_SCHEMES)]
DatasetUri = Annotated[str, _uri(DATASET_SCHEMES)]
OutputUri = Annotated[str, _uri(OUTPUT_SCHEMES)]


class SecretKeyRef(ApiModel):
    """A key of a Kubernetes Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the Secret."""
    key: str = Field(default="token", min_length=1, max_length=253)
    """Key within the Secret."""


class ModelSource(ApiModel):
    """The base model to fine-tune: a Hugging Face causal language model."""

    uri: ModelUri
    """Where the model is: `hf://org/name` (Hugging Face Hub), `pvc://claim/path` (a
    PersistentVolumeClaim), `azureml://registries/...` or `azureml://datastores/...`
    (Azure ML), an absolute path inside the worker image, or `./path` (relative to the
    manifest; `finetune run` only)."""
    revision: str | None = Field(default=None, max_length=255)
    """Hub revision to pin: a branch, tag or commit hash. Pin a commit for reproducible runs."""
    token_secret_ref: SecretKeyRef | None = None
    """Secret holding a Hugging Face token for gated or private models. The token is
    passed to workers as the HF_TOKEN environment variable, never stored in the spec."""
    trust_remote_code: bool = False
    """Run modelling code shipped with the model repository. Only for repositories you trust."""

    @property
    def location(self) -> Location:
        """`uri` parsed (UriError naming the field where it is no model location)."""
        return parse_location("model", self.uri)


class DatasetSource(ApiModel):
    """The training data."""

    uri: DatasetUri
    """Where the data is: a jsonl/json/parquet/csv file or folder (`pvc://`, `azureml://`,
    `https://`, an absolute or `./relative` path), or a hub dataset (`hf://org/name`)."""
    format: DatasetFormat = "auto"
    """How samples are laid out. `chat`: a `messages` list with roles, rendered through
    the tokenizer's chat template. `instruction`: `prompt`/`response`,
    `instruction`/`input`/`output`, or TRL's `prompt`/`completion` columns (as text, or
    both as chat messages: the completion's assistant turns are trained on). `text`: a
    `text` column. `preference` (for
    `objective.type: dpo`): `prompt`, `chosen` and `rejected`, as text or as chat messages
    (the answers' assistant turns after the prompt's conversation). `prompt` (for
    `objective.type: grpo`): a `prompt` as text or chat messages, the model writing the
    answer; any other column (`answer`) goes to the reward functions. `auto` detects from
    the columns. Loss counts only response tokens where the format has a prompt."""
    split: str = Field(default="train", min_length=1, max_length=128)
    """Split to train on: a hub dataset's, or a folder's, whose files are named by split
    as Hugging Face datasets names them (`train.jsonl`, `validation.jsonl`, `test.jsonl`,
    `train-00001.parquet`, or folders `train/`, `dev/`, ...). A folder whose files name no
    split, and a single file, are split `train`. Slices select part of one
    (`train[:95%]`)."""
    eval_fraction: float = Field(default=0.0, ge=0.0, le=0.5)
    """Fraction of the training samples held out for evaluation (0: none; see `evalSplit`)."""
    eval_split: str | None = Field(default=None, min_length=1, max_length=128)
    """Evaluate on this split of the same dataset (e.g. `validation`), instead of holding
    out `evalFraction` of the training split: the hub dataset's split, the folder's files
    named by it, or a slice of a single file (`train[95%:]`, with `split: train[:95%]`)."""
    max_seq_length: int = Field(default=2048, ge=16, le=1_048_576)
    """Tokens per training sequence; longer samples are truncated. With preference data,
    each of prompt + chosen and prompt + rejected (a packed row then holds up to twice
    this); truncation keeps the answers and the end of the prompt."""
    packing: bool = True
    """Pack several samples into each sequence, without attention or positions leaking
    between them. Faster on variable-length data; the loss is unchanged."""

    @property
    def location(self) -> Location:
        """`uri` parsed (UriError naming the field where it is no dataset location)."""
        return parse_location("dataset", self.uri)

    @property
    def evaluated(self) -> bool:
        """Whether there is an eval split: held out (`evalFraction`) or named (`evalSplit`)."""
        return self.eval_fraction > 0 or self.eval_split is not None


class LoraConfig(ApiModel):
    """LoRA adapter settings (also used by QLoRA)."""

    r: int = Field(default=16, ge=1, le=1024)
    """Rank of the adapter matrices."""
    alpha: float = Field(default=32, gt=0)
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Dropout on the adapter input."""
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128,
                                              description="A module name.")]] = Field(
        default_factory=lambda: ["all-linear"], min_length=1, max_length=64
    )
    """Module names to adapt (e.g. `q_proj`, `v_proj`), or `all-linear` for every linear
    layer except the output head."""


class MethodConfig(ApiModel):
    """What is trained."""

    type: MethodType = "lora"
    """`lora`: low-rank adapters on frozen weights. `qlora`: LoRA on a 4-bit quantised
    base model (GPU only, bf16 or fp16). `full`: every weight."""
    lora: LoraConfig | None = None
    """Adapter settings for `lora` and `qlora`; defaults apply when left out."""


class _Objective(ApiModel):
    """What the training optimises, whatever the method trains (LoRA, QLoRA or full)."""

    def settings(self) -> ApiModel | None:
        """The chosen objective's settings section, its defaults where it was left out;
        None for an objective without one."""
        spec = objectives.spec_of(self.type)  # type: ignore[attr-defined]
        if spec.settings is None:
            return None
        return getattr(self, self.type) or spec.settings()  # type: ignore[attr-defined]


def _objective_config() -> type[ApiModel]:
    """`spec.objective` from the registered objectives (finetune_trainer.objectives): its
    `type` names one, and each objective with settings has its section, named after it.
    A new objective needs no line here."""
    known = objectives.registry()
    about = " ".join(f"`{name}`: {spec.about}" for name, spec in known.items())
    fields: dict[str, Any] = {"type": (Literal[tuple(known)], Field(  # type: ignore[valid-type]
        default="sft", description=about))}
    for name, spec in known.items():
        if spec.settings is not None:
            fields[name] = (spec.settings | None, Field(
                default=None, description=f"{spec.settings.__doc__.strip()} For `type: "
                f"{name}`; defaults apply when left out."))
    return create_model("ObjectiveConfig", __base__=_Objective, __module__=__name__,
                        __doc__=_Objective.__doc__, **fields)


ObjectiveConfig = _objective_config()


class StrategyConfig(ApiModel):
    """How the work is spread over GPUs and how numbers are represented."""

    type: StrategyType = "auto"
    """`ddp`: every rank holds the whole model. `fsdp`: PyTorch FSDP2, parameters,
    gradients and optimizer state sharded. `zero1`/`zero2`/`zero3`: DeepSpeed ZeRO
    stages. `auto`: chosen from the model size, method and GPUs."""
    offload: Offload = "none"
    """Move optimizer state (and, with zero3 or fsdp, parameters) to `cpu` or `nvme`.
    Saves GPU memory at the cost of speed. `cpu` needs zero2, zero3 or fsdp; `nvme`
    needs zero3."""
    nvme_path: str | None = Field(default=None, pattern=r"^/\S*$", max_length=1024)
    """Local NVMe folder used by `offload: nvme`."""
    precision: Precision = "bf16"
    """`bf16` (Ampere GPUs and newer), `fp16` (with loss scaling; for V100/T4), or `fp32`."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in the backward pass: much less memory, about 20-30% slower.
    Unset (the default): chosen from the planner's memory estimate on `gpuType` with 10%
    headroom — off when the activations fit, else `selective`, else `full` — on (`full`)
    where the planner cannot tell (no `gpuType`, unknown model), and off on CPU workers
    (recomputing only slows them; host memory holds the activations). `finetune plan` and
    `finetune run` print the choice and why."""
    gradient_checkpointing_policy: CheckpointPolicy = "full"
    """What gradient checkpointing recomputes. `full`: whole decoder layers (least
    memory). `selective`: keeps the outputs of matmuls and attention and recomputes only
    the element-wise ops (norms, activations, rotary): no matmul is run twice, and the
    memory kept lies between `full` and no checkpointing."""
    compile: bool | None = None
    """Compile each decoder layer with `torch.compile` (torchtitan's per-block
    compilation): element-wise ops fused into fewer kernels (1.22x on a 1B full fine-tune
    on one H100). Costs a compile of a minute or more at start (packed rows are then padded
    to `maxSeqLength`, so a shorter batch does not recompile). Unset (the default): on for
    GPU runs the planner expects to last 20 minutes or more (ddp or fsdp, not qlora), off
    otherwise."""
    packed_attention: bool = True
    """On CUDA, attend within each packed sample through flash attention's variable-length
    kernel (the samples' bounds, no mask): no work on pairs of different samples. Models
    it does not fit (sliding windows, soft-capping) and CPUs use SDPA with the mask."""
    fused_loss: bool = True
    """Compute the output layer and the cross-entropy together, a chunk of tokens at a
    time and over trained tokens only, never holding the whole batch x length x vocabulary
    logits. Less memory (GiBs for large vocabularies) and no work on prompt or padding
    positions. Models that change the logits after the output layer (Gemma 2/3, Cohere,
    Granite) use the plain path whatever this says."""


class Hyperparameters(ApiModel):
    """Optimisation settings. Set exactly one of `epochs` and `maxSteps`."""

    epochs: float | None = Field(default=None, gt=0, le=1000)
    """Passes over the training data (fractions allowed)."""
    max_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps to run, whatever the data size."""
    learning_rate: float | None = Field(default=None, gt=0, le=1)
    """Peak learning rate. Defaults to 2e-4 for lora/qlora and 2e-5 for full."""
    batch_size_per_device: int = Field(default=4, ge=1, le=4096)
    """Sequences per device (GPU or CPU worker process) per accumulation step. How many
    go through one forward pass is `microBatchSize`."""
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=4096)
    """Accumulation steps per optimizer step. Global batch = batchSizePerDevice x
    gradientAccumulationSteps x devices."""
    micro_batch_size: int | None = Field(default=None, ge=1, le=4096 * 4096)
    """Sequences per forward and backward pass on each device. A device's
    batchSizePerDevice x gradientAccumulationSteps sequences of an optimizer step run as
    passes of this size (it must divide that product), so the global batch, the loss and
    the data order do not depend on it. Unset (the default): chosen by the planner with
    gradient checkpointing, from its memory estimate for the `gpuType` — smaller passes
    (down to 4,096 tokens) rather than recomputing activations, larger ones up to 4,096
    tokens (packed data), the smallest where nothing else fits; batchSizePerDevice where
    the planner cannot tell (CPU workers, no gpuType, unknown model). `finetune plan` and
    `finetune run` print the choice and why."""
    warmup_ratio: float = Field(default=0.03, ge=0.0, lt=1.0)
    """Fraction of steps over which the learning rate rises linearly from 0."""
    scheduler: Scheduler = "cosine"
    """Learning-rate decay after warmup."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    max_grad_norm: float = Field(default=1.0, ge=0.0)
    """Gradient clipping threshold (0 disables clipping)."""
    seed: int = Field(default=42, ge=0, le=2**32 - 1)
    """Seed for shuffling, initialisation and dropout."""
    eval_every_steps: int | None = Field(default=None, ge=1)
    """Evaluate every N steps (needs `dataset.evalFraction` > 0 or `dataset.evalSplit`); by
    default once at the end."""
    early_stopping_patience: int | None = Field(default=None, ge=1, le=10000)
    """Stop training once this many evaluations in a row (every `evalEverySteps`) have not
    brought the eval loss more than `earlyStoppingThreshold` below its best so far. The run
    then ends at that step as at its last: checkpoint, export, Succeeded. With it set, each
    evaluation that is the best so far is checkpointed, and the export holds the best
    evaluation's weights, whether the run stops early or reaches its last step (as
    transformers' load_best_model_at_end). Unset (the default): train to the end."""
    early_stopping_threshold: float = Field(default=0.0, ge=0.0)
    """How far below the best eval loss so far an evaluation must come to count as better
    (with `earlyStoppingPatience`)."""
    log_every_steps: int = Field(default=10, ge=1)
    """Log and publish metrics every N steps."""

    def micro_steps(self) -> tuple[int, int]:
        """(sequences per pass, passes per optimizer step) on each device."""
        micro = self.micro_batch_size or self.batch_size_per_device
        return micro, self.batch_size_per_device * self.gradient_accumulation_steps // micro

    def micro_batch_choices(self) -> list[int]:
        """Every `microBatchSize` that keeps the step's batch, ascending: the divisors of
        batchSizePerDevice x gradientAccumulationSteps."""
        per_device = self.batch_size_per_device * self.gradient_accumulation_steps
        small = [d for d in range(1, math.isqrt(per_device) + 1) if per_device % d == 0]
        return sorted({*small, *(per_device // d for d in small)})

    def resolved_learning_rate(self, method: MethodType) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 2e-5 if method == "full" else 2e-4


EXPORT_TARGET_PATTERN = r"^(oci://[^/]+/.+|hf://[^/]+(/[^/]+)?|azureml://models/[^/]+)$"
"""What `output.export[].uri` must look like to the API server (the rest: oci.Reference,
hub.HubRepo, WORKSPACE_MODEL)."""
WORKSPACE_MODEL = r"^azureml://models/(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,254})$"
"""A model name in the job's Azure ML workspace, as Azure ML names assets."""

DOCKER_CONFIG_KEY = ".dockerconfigjson"
"""The key of a `kubernetes.io/dockerconfigjson` Secret: an OCI target's credentials."""
HUB_TOKEN_KEY = "token"
"""The key of the Secret holding a Hugging Face token: an hf:// target's credentials (the
same key `spec.model.tokenSecretRef` reads by default)."""


class ExportTarget(ApiModel):
    """Where the trained model is pushed once training has ended (`output.export`)."""

    uri: str = Field(min_length=5, max_length=512, pattern=EXPORT_TARGET_PATTERN)
    """`oci://registry/repository[:tag]` (the tag defaults to `latest`): the model folder as
    one OCI image that KAITO's adapters and `oras pull` read; `hf://owner/name`: a commit to
    that Hugging Face Hub model repository, created private when it does not exist;
    `azureml://models/NAME` (backend azureml): the next version of model NAME registered in
    the job's workspace, by the operator, from the output datastore (guides/serving.md)."""
    secret_name: str | None = Field(default=None, min_length=1, max_length=253)
    """A Secret in the job's namespace holding the target's credentials, mounted read-only
    into the workers: for oci://, a `kubernetes.io/dockerconfigjson` one (`kubectl create
    secret docker-registry`); for hf://, a hub token with write access under the key `token`
    (`kubectl create secret generic NAME --from-literal=token=hf_...`). Unset: the registry
    takes the push without credentials; under `finetune run`, your own login is used
    (`docker login` or `oras login`; `HF_TOKEN` or `hf auth login`)."""
    merged: bool = False
    """Push `merged/` (the base with the adapter merged in; needs `mergeAdapter`) rather than
    `final/`."""
    plain_http: bool = False
    """Talk plain HTTP to the registry (one inside the cluster without TLS; oci:// only)."""

    @property
    def pushed_by_trainer(self) -> bool:
        """Rank 0 pushes it after training; an Azure ML registration is the operator's."""
        return not self.uri.startswith("azureml://")

    @property
    def secret_key(self) -> str:
        """The key of `secret_name` this target's credentials are under."""
        return HUB_TOKEN_KEY if self.uri.startswith("hf://") else DOCKER_CONFIG_KEY


class OutputConfig(ApiModel):
    """Where checkpoints and the final model go."""

    uri: OutputUri
    """Folder for checkpoints and the final export: `pvc://claim/path`,
    `azureml://datastores/<store>/paths/<path>`, an absolute or `./relative` path."""
    checkpoint_every_steps: int | None = Field(default=500, ge=1)
    """Write a checkpoint every N steps (always also at the end and on SIGTERM)."""
    keep_last: int = Field(default=2, ge=1, le=1000)
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    merge_adapter: bool = False
    """Also export the base model with the LoRA adapter merged in (lora and qlora)."""
    async_checkpoints: AsyncCheckpoints = "auto"
    """Write periodic checkpoints behind training (ddp, fsdp and DeepSpeed): `auto` where the
    host has memory for the staged copy of the state, `on` always, `off` never. The last
    step's checkpoint and the one taken on SIGTERM are always written at once, with no
    staged copy, and are complete before the run goes on or the process exits."""
    resume_with_changed_data: bool = False
    """Resume from this folder's checkpoints although the dataset changed since they were
    written (its files' content, `uri`, `split`, `evalSplit`, `evalFraction` or `format`):
    for training on from a checkpoint with records added or edited, on purpose. The run goes
    on at its step, in the new data's order. Off (the default): such a run is refused before
    any step, naming what changed. A changed objective, method or model is always refused."""
    export: list[ExportTarget] = Field(default_factory=list, max_length=8)
    """Where rank 0 pushes the model after the last checkpoint and `final/` are written, in
    order, each tried again on transient faults. A failed push does not fail the job: the
    output folder keeps the model, the job's `Exported` condition says which target failed
    and why, and `finetune export` pushes it by hand."""
    tensorboard: bool = True
    """Rank 0 writes TensorBoard event files (loss, learning rate, grad norm, tokens/s, eval
    loss) under `tensorboard/` in this folder: `tensorboard --logdir <folder>` locally or on
    the volume; Azure ML Studio shows them with the job's outputs."""

    @property
    def location(self) -> Location:
        """`uri` parsed (UriError naming the field where it is no output location)."""
        return parse_location("output", self.uri)


class JobIdentity(ApiModel):
    """Which FineTuneJob this run belongs to (metric labels, log lines, MLflow run name)."""

    name: str
    namespace: str = "default"
    uid: str | None = None
    manifest: str | None = None
    """`finetune run`: the manifest's path (a cluster's job is known by its uid)."""


class MetricsConfig(ApiModel):
    """Prometheus endpoint served by every rank."""

    enabled: bool = True
    port: int = Field(default=9108, ge=1, le=65535)
    """Port of local rank 0; local rank k serves on port + k."""
    host: str = "0.0.0.0"
    """The address the endpoints listen on: every interface in a pod (Prometheus and the
    operator reach it there); `finetune run` listens on 127.0.0.1 only."""
    reuse_port: bool = False
    """Listen with SO_REUSEPORT, beside the socket by which `finetune run` holds the ports
    it named from then until the run ends, so that nothing takes them while the workers
    start (`local.PortHold`). Off in a pod: its ports are its own."""


class PreflightConfig(ApiModel):
    """An all-reduce bandwidth check across every rank before step 0."""

    enabled: bool = True
    """Measure the all-reduce bus bandwidth (as nccl-tests defines it) of all ranks, of
    each node's ranks and of node pairs; nodes below 0.8x the median are named in the
    log, the metrics and the job's `CollectivePreflight` condition. A few seconds."""
    min_bus_bandwidth_gbps: float | None = Field(default=None, gt=0, alias="minBusBandwidthGBps")
    """Fail the job before training when the all-ranks bus bandwidth at the largest size
    is below this many GB/s. Unset: measure and report only."""


class TrainerPreflight(PreflightConfig):
    """The preflight a worker runs: the job's settings plus what the operator knows."""

    require_infiniband: bool = False
    """Fail unless NCCL picked the InfiniBand transport between nodes
    (`spec.kubernetes.infiniband`)."""
    planned_peak_bytes: int | None = Field(default=None, ge=0)
    """The planner's peak GPU memory per process at the job's step settings (None: not
    known); each rank holds it against its GPU's free memory before loading the model
    (gpu_memory.py)."""


class BenchmarkSwitches(ApiModel):
    """The other side of a speed-up, there for benchmarks/changes.py to measure it against:
    set by a benchmark's trainer config only (not a FineTuneJob field; neither the operator
    nor `finetune run` writes it)."""

    prefetch: bool | None = None
    """Collate the next steps' batches on a thread during this step. None: where the device
    computes asynchronously (a GPU); on CPU workers such a thread only competes for the
    cores (0.92-0.94x in benchmarks/changes.py)."""
    packer: Literal["best-fit", "next-fit"] = "best-fit"
    """How packing fills sequences: best-fit decreasing, or consecutive samples (next-fit,
    the packing before best-fit)."""


class TrainerConfig(ApiModel):
    """Everything a worker needs, resolved by the operator (or `finetune run`)."""

    api_version: Literal["finetune.dev/v1alpha1"] = API_VERSION
    kind: Literal["TrainerConfig"] = TRAINER_CONFIG_KIND
    job: JobIdentity
    model: ModelSource
    dataset: DatasetSource
    method: MethodConfig = section(MethodConfig)
    objective: ObjectiveConfig = section(ObjectiveConfig)
    strategy: StrategyConfig = section(StrategyConfig)
    hyperparameters: Hyperparameters
    output: OutputConfig
    metrics: MetricsConfig = section(MetricsConfig)
    preflight: TrainerPreflight = section(TrainerPreflight)
    benchmark: BenchmarkSwitches = section(BenchmarkSwitches)
    workers: int | None = Field(default=None, ge=1)
    """The processes the job runs (nodes x processes per node), set by the operator and
    `finetune run`; the workers put their own WORLD_SIZE here. A checkpoint records it
    (`trained_with`): its global batch is per worker, and a ZeRO checkpoint is partitioned
    by worker. None: a config written before it was (each worker's batch is recorded)."""
    model_fetched_from: ModelSource | None = None
    """Set by the trainer itself, never by the operator: the spec's hub model when `model`
    points at its copy in the output folder (`finetune_trainer.fetch`). Checkpoints record
    this one, so a run that read the copy and one that read the hub resume each other."""
    placeholders: dict[str, str] | None = None
    """Set by the trainer itself, never by the operator: the Azure ML placeholders
    (`${{inputs.model}}`) it bound to mount paths, by section. Checkpoints record these: the
    mount paths differ from one Azure ML job to the next, a restart's included."""

    @model_validator(mode="after")
    def _strategy_is_resolved(self) -> TrainerConfig:
        if self.strategy.type == "auto":
            raise ValueError("strategy.type must be resolved (ddp, fsdp, zero1-3) before "
                             "the trainer runs; the operator or `finetune run` does this")
        return self

    @classmethod
    def load(cls, path: str | Path) -> TrainerConfig:
        """Read a trainer config from a JSON or YAML file."""
        with open(path, encoding="utf-8") as handle:
            return cls.model_validate(yaml.safe_load(handle))
