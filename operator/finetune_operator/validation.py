"""Validation of FineTuneJob manifests: every problem at once, each naming its field.

Two layers, run in order:
1. Structure (types, enums, ranges, unknown fields) by the pydantic models in `api`,
   with pydantic's messages rewritten into `path: what is wrong — how to fix`.
2. Cross-field rules, below. A rule that the API server can enforce by itself also
   carries a CEL expression; the CRD generator copies it into `x-kubernetes-validations`
   so `kubectl apply` refuses the same manifest, and a test checks both agree.
"""

from __future__ import annotations

import difflib
import re
import reprlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_origin

from pydantic import BaseModel, ValidationError

from finetune_operator import gpu_catalog as catalog
from finetune_operator.api import (
    API_VERSION,
    DNS_1035_LABEL,
    DNS_1123_LABEL,
    GUID_PATTERN,
    KIND,
    MAX_NAME_LENGTH,
    QUANTITY_PATTERN,
    SHORT_NAMES,
    SWEEP_SHORT_NAMES,
    FineTuneJob,
    FineTuneJobSpec,
)
from finetune_operator.settings import OperatorSettings
from finetune_trainer import objectives
from finetune_trainer.config import EXPORT_TARGET_PATTERN, WORKSPACE_MODEL, ObjectiveConfig
from finetune_trainer.uris import ONE_DATA_FILE, Location, UriError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest: where, what, and how to fix it."""

    path: str
    message: str
    fix: str
    severity: Literal["error", "warning"] = "error"
    cluster_only: bool = False
    """True when the problem does not apply to `finetune run` on one machine."""

    def __post_init__(self) -> None:
        # a problem is one line wherever it is read (a terminal, an event, the status),
        # whatever the user's value it quotes holds: a line break would start a forged one
        for name in ("path", "message", "fix"):
            object.__setattr__(self, name, one_line(getattr(self, name)))

    def __str__(self) -> str:
        return f"{self.path}: {self.message} — {self.fix}"


def one_line(text: str) -> str:
    """`text` with control characters (line breaks among them) and lone surrogates escaped
    as Python writes them (`\\n`)."""
    if text.isprintable():
        return text
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode()
                   for c in text)


class InvalidJobError(ValueError):
    """A manifest with at least one error; `problems` lists them all."""

    def __init__(self, problems: list[Problem]):
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


@dataclass(frozen=True)
class CelRule:
    """A rule the API server checks itself (`x-kubernetes-validations`).

    `scope` is the schema location the rule is attached to, as a dotted path where `[*]`
    means "each list item"; `self` in `rule` is the object at that location, after the
    API server applied the CRD's defaults.
    """

    scope: str
    rule: str
    message: str
    field_path: str | None = None


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[FineTuneJob], Iterable[Problem]]
    cel: tuple[CelRule, ...] = field(default_factory=tuple)


RULES: list[Rule] = []


def rule(*cel: CelRule) -> Callable[[Callable[[FineTuneJob], Iterable[Problem]]], Any]:
    def register(check: Callable[[FineTuneJob], Iterable[Problem]]) -> Any:
        RULES.append(Rule(check.__name__, check, cel))
        return check
    return register


def cel_rules() -> list[CelRule]:
    """Every CEL rule, for the CRD generator."""
    return [c for r in RULES for c in r.cel]


# --- cross-field rules -----------------------------------------------------------------

_NAME_FIX = (f"use at most {MAX_NAME_LENGTH} lowercase letters, digits and '-', starting "
             "with a letter (child objects and pod hostnames are derived from it)")


@rule(
    CelRule("", f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
            f"metadata.name: too long — {_NAME_FIX}"),
    CelRule("", f"self.metadata.name.matches('{DNS_1035_LABEL}')",
            f"metadata.name: not a DNS-1035 label — {_NAME_FIX}"),
)
def name_fits_derived_objects(job: FineTuneJob) -> Iterator[Problem]:
    name = job.metadata.name
    if len(name) > MAX_NAME_LENGTH:
        yield Problem("metadata.name", f"is {len(name)} characters, the limit is "
                      f"{MAX_NAME_LENGTH}", _NAME_FIX)
    if not re.fullmatch(DNS_1035_LABEL, name):
        yield Problem("metadata.name", f"{name!r} is not a DNS-1035 label", _NAME_FIX)


@rule(CelRule("spec.hyperparameters", "has(self.epochs) != has(self.maxSteps)",
              "set exactly one of spec.hyperparameters.epochs or "
              "spec.hyperparameters.maxSteps"))
def epochs_or_max_steps(job: FineTuneJob) -> Iterator[Problem]:
    hp = job.spec.hyperparameters
    if hp.epochs is None and hp.max_steps is None:
        yield Problem("spec.hyperparameters", "neither epochs nor maxSteps is set",
                      "set `epochs: 1` (passes over the data) or `maxSteps: N` (optimizer steps)")
    elif hp.epochs is not None and hp.max_steps is not None:
        yield Problem("spec.hyperparameters.maxSteps", "is set together with epochs",
                      "keep one: remove `epochs` or `maxSteps`")


@rule(CelRule("spec.hyperparameters",
              "!has(self.microBatchSize) || "
              "(self.batchSizePerDevice * self.gradientAccumulationSteps) % self.microBatchSize"
              " == 0",
              "spec.hyperparameters.microBatchSize must divide batchSizePerDevice x "
              "gradientAccumulationSteps (the sequences a device trains on per optimizer step)"
              " — pick a divisor, or remove it and let the planner choose",
              ".microBatchSize"))
def micro_batch_divides_the_step(job: FineTuneJob) -> Iterator[Problem]:
    hp = job.spec.hyperparameters
    per_device = hp.batch_size_per_device * hp.gradient_accumulation_steps
    if hp.micro_batch_size is not None and per_device % hp.micro_batch_size:
        choices = hp.micro_batch_choices()
        below = max(d for d in choices if d < hp.micro_batch_size)
        above = [d for d in choices if d > hp.micro_batch_size][:1]
        nearest = " or ".join(str(d) for d in (below, *above))
        yield Problem("spec.hyperparameters.microBatchSize",
                      f"{hp.micro_batch_size} does not divide the {per_device} sequences a "
                      f"device trains on per optimizer step (batchSizePerDevice "
                      f"{hp.batch_size_per_device} x gradientAccumulationSteps "
                      f"{hp.gradient_accumulation_steps})",
                      f"use a divisor ({nearest}), or remove it and let the planner choose")


@rule(
    CelRule("spec", "self.method.type != 'qlora' || self.resources.gpusPerNode > 0",
            "qlora needs GPUs (bitsandbytes 4-bit kernels) — set spec.resources.gpusPerNode "
            ">= 1, or use method lora on CPU workers", ".method.type"),
    CelRule("spec", "self.method.type != 'qlora' || self.strategy.precision != 'fp32'",
            "qlora computes in bf16 or fp16 — set spec.strategy.precision to bf16 (Ampere and "
            "newer) or fp16 (V100/T4)", ".strategy.precision"),
)
def qlora_needs_gpus_and_half_precision(job: FineTuneJob) -> Iterator[Problem]:
    spec = job.spec
    if spec.method.type != "qlora":
        return
    if not spec.resources.on_gpus:
        yield Problem("spec.method.type", "qlora needs GPUs (bitsandbytes 4-bit kernels), and "
                      "CPU workers (gpusPerNode: 0) have none",
                      "set spec.resources.gpusPerNode >= 1, or use `method.type: lora` on CPU")
    if spec.strategy.precision == "fp32":
        yield Problem("spec.strategy.precision", "qlora cannot compute in fp32",
                      "use bf16 (A100, H100 and newer) or fp16 (V100, T4)")


@rule(CelRule("spec", "!(self.method.type == 'full' && self.strategy.type == 'fsdp' && "
              "self.strategy.precision == 'fp16')",
              "fp16 full fine-tuning under FSDP is numerically unstable — use bf16, fp32, or "
              "strategy zero3 (DeepSpeed's fp16 loss scaler)", ".strategy.precision"))
def no_fp16_full_fsdp(job: FineTuneJob) -> Iterator[Problem]:
    s = job.spec.strategy
    if job.spec.method.type == "full" and s.type == "fsdp" and s.precision == "fp16":
        yield Problem("spec.strategy.precision", "fp16 full fine-tuning under FSDP is "
                      "numerically unstable (sharded fp16 gradients overflow without a "
                      "global loss scaler)",
                      "use bf16 (A100/H100), fp32, or `strategy.type: zero3` for fp16 GPUs")


@rule(CelRule("spec", "self.resources.gpusPerNode > 0 || self.strategy.precision != 'fp16' "
              "|| !(self.strategy.type in ['zero1', 'zero2', 'zero3'])",
              "fp16 under DeepSpeed needs GPUs (its CPU accelerator has no fp16) — use bf16 or "
              "fp32 on CPU workers, or strategy ddp or fsdp", ".strategy.precision"))
def deepspeed_fp16_needs_gpus(job: FineTuneJob) -> Iterator[Problem]:
    spec = job.spec
    if (not spec.resources.on_gpus and spec.strategy.precision == "fp16"
            and spec.strategy.type in ("zero1", "zero2", "zero3")):
        yield Problem("spec.strategy.precision", f"fp16 under DeepSpeed ({spec.strategy.type}) "
                      "needs GPUs: its CPU accelerator has no fp16, and CPU workers "
                      "(gpusPerNode: 0) have no GPU",
                      "use bf16 or fp32 on CPU workers, or `strategy.type: ddp` or `fsdp`")


@rule(
    CelRule("spec.strategy", "self.offload != 'cpu' || self.type in "
            "['auto', 'fsdp', 'zero2', 'zero3']",
            "offload cpu needs strategy fsdp, zero2 or zero3", ".offload"),
    CelRule("spec.strategy", "self.offload != 'nvme' || self.type in ['auto', 'zero3']",
            "offload nvme needs strategy zero3", ".offload"),
    CelRule("spec.strategy", "self.offload != 'nvme' || has(self.nvmePath)",
            "offload nvme needs spec.strategy.nvmePath (a local NVMe folder)", ".nvmePath"),
)
def offload_needs_sharding(job: FineTuneJob) -> Iterator[Problem]:
    s = job.spec.strategy
    if s.offload == "cpu" and s.type not in ("auto", "fsdp", "zero2", "zero3"):
        yield Problem("spec.strategy.offload", f"cpu offload does not work with {s.type}",
                      "use `strategy.type: zero2`, `zero3` or `fsdp`, or `offload: none`")
    if s.offload == "nvme":
        if s.type not in ("auto", "zero3"):
            yield Problem("spec.strategy.offload", f"nvme offload does not work with {s.type}",
                          "use `strategy.type: zero3` (ZeRO-Infinity), or `offload: cpu`")
        if s.nvme_path is None:
            yield Problem("spec.strategy.nvmePath", "is required with `offload: nvme`",
                          "set it to a folder on the node's local NVMe, e.g. /mnt/nvme")
    elif s.nvme_path is not None:
        yield Problem("spec.strategy.nvmePath", "is only used with `offload: nvme`",
                      "remove it, or set `offload: nvme`")


@rule(CelRule("spec.method", "!has(self.lora) || self.type != 'full'",
              "spec.method.lora is only used with lora and qlora — remove it, or choose "
              "type lora", ".lora"))
def lora_settings_need_lora(job: FineTuneJob) -> Iterator[Problem]:
    if job.spec.method.type == "full" and job.spec.method.lora is not None:
        yield Problem("spec.method.lora", "is set but method.type is full",
                      "remove `lora`, or set `method.type: lora`")


def _objective_cel() -> Iterator[CelRule]:
    """The API server's side of `objective_matches_data`, from the objectives' registry."""
    for name, spec in objectives.registry().items():
        formats = ", ".join(f"'{f}'" for f in ("auto", *spec.formats))
        others = ", ".join(f"{other} ({of.formats_said()} data)"
                           for other, of in objectives.registry().items() if other != name)
        yield CelRule("spec", f"self.objective.type != '{name}' || self.dataset.format in "
                      f"[{formats}]", f"spec.dataset.format: objective {name} trains on "
                      f"{spec.formats_said()} data — set spec.dataset.format to "
                      f"{'one of them' if len(spec.formats) > 1 else spec.formats[0]} (or "
                      f"auto), or spec.objective.type to your data's: {others}",
                      ".dataset.format")
        if name in ObjectiveConfig.model_fields:
            yield CelRule("spec.objective", f"!has(self.{name}) || self.type == '{name}'",
                          f"spec.objective.{name} is only used with objective {name} — remove "
                          f"it, or set spec.objective.type to {name}", f".{name}")
        for settings in spec.rules:
            yield CelRule("spec.objective", settings.cel, f"spec.objective.{settings.field} "
                          f"{settings.says} — {settings.fix}", f".{settings.field}")


@rule(*_objective_cel())
def objective_matches_data(job: FineTuneJob) -> Iterator[Problem]:
    """The data's format is one the objective trains on, its settings section is its own,
    and its settings' own rules hold (`ObjectiveSpec.rules`)."""
    objective, data_format = job.spec.objective, job.spec.dataset.format
    known = objectives.registry()
    spec = known[objective.type]
    if data_format != "auto" and data_format not in spec.formats:
        others = [n for n in objectives.trains_on(data_format) if n != objective.type]
        yield Problem("spec.dataset.format", f"is {data_format}, and objective "
                      f"{objective.type} trains on {spec.formats_said()} data",
                      f"set `dataset.format` to {spec.formats_said()} (or auto) with such "
                      "records" + (f", or `objective.type: {' or '.join(others)}` for "
                                   f"{data_format} data" if others else ""))
    for name in known:
        if name != objective.type and getattr(objective, name, None) is not None:
            yield Problem(f"spec.objective.{name}", f"is set but objective.type is "
                          f"{objective.type}", f"remove `{name}`, or set `objective.type: "
                          f"{name}`")
    for settings in spec.rules:
        if not settings.holds(objective):
            yield Problem(f"spec.objective.{settings.field}", settings.says, settings.fix)
    workers = job.spec.resources.nodes * job.spec.resources.processes()
    for across in spec.job_rules:
        if (problem := across.problem(job.spec, workers)) is not None:
            yield Problem(across.field, problem, across.fix)


@rule(CelRule("spec.output", "!has(self.export) || !self.export.exists(e, e.merged) || "
              "self.mergeAdapter", "spec.output.export[].merged pushes merged/, which only "
              "spec.output.mergeAdapter writes — set mergeAdapter: true, or remove merged",
              ".export"))
def exports_can_be_pushed(job: FineTuneJob) -> Iterator[Problem]:
    """Each target a registry or the hub would take (checked now, not after hours of
    training), its folder one the run writes."""
    from finetune_trainer.export import ExportError  # requests, ~17 ms: only a job that exports
    from finetune_trainer.export.hub import HubRepo
    from finetune_trainer.export.oci import Reference

    output, seen = job.spec.output, set()
    for index, target in enumerate(output.export):
        where = f"spec.output.export[{index}]"
        if not target.pushed_by_trainer:  # the backend registers it (its own rules)
            if not re.match(WORKSPACE_MODEL, target.uri):
                yield Problem(f"{where}.uri", "is not an Azure ML model name", "write "
                              "azureml://models/NAME (letters, digits, '-', '_' and '.')")
            continue
        hub = target.uri.startswith("hf://")
        try:
            reference = HubRepo.parse(target.uri) if hub else Reference.parse(target.uri)
        except ExportError as error:
            yield Problem(f"{where}.uri", error.problem, error.fix)
            continue
        if hub and target.plain_http:
            yield Problem(f"{where}.plainHttp", "is for an OCI registry; the hub is reached "
                          "at HF_ENDPOINT", "remove `plainHttp`")
        if target.merged and not output.merge_adapter:
            yield Problem(f"{where}.merged", "pushes merged/, which only "
                          "spec.output.mergeAdapter writes", "set `mergeAdapter: true`, or "
                          "remove `merged` (final/ is pushed)")
        if (str(reference), target.merged) in seen:
            yield Problem(f"{where}.uri", f"pushes to {reference} a second time",
                          "remove one of the two", "warning")
        seen.add((str(reference), target.merged))


@rule(CelRule("spec", "!self.output.mergeAdapter || self.method.type != 'full'",
              "spec.output.mergeAdapter needs method lora or qlora — remove it for full "
              "fine-tuning", ".output.mergeAdapter"))
def merge_needs_adapter(job: FineTuneJob) -> Iterator[Problem]:
    if job.spec.output.merge_adapter and job.spec.method.type == "full":
        yield Problem("spec.output.mergeAdapter", "there is no adapter to merge in a full "
                      "fine-tune", "remove `mergeAdapter` (the full weights are exported)")


@rule(CelRule("spec", "!has(self.hyperparameters) || "
              "!has(self.hyperparameters.evalEverySteps) || self.dataset.evalFraction > 0.0 "
              "|| has(self.dataset.evalSplit)",
              "spec.hyperparameters.evalEverySteps needs an eval split — set "
              "spec.dataset.evalSplit (e.g. validation) or spec.dataset.evalFraction (e.g. "
              "0.05)", ".hyperparameters.evalEverySteps"))
def eval_needs_split(job: FineTuneJob) -> Iterator[Problem]:
    if job.spec.hyperparameters.eval_every_steps and not job.spec.dataset.evaluated:
        yield Problem("spec.hyperparameters.evalEverySteps", "is set but there is no eval split",
                      "set `spec.dataset.evalSplit` (e.g. validation) or "
                      "`spec.dataset.evalFraction` (e.g. 0.05), or remove evalEverySteps")


@rule(CelRule("spec", "!has(self.hyperparameters) || "
              "!has(self.hyperparameters.earlyStoppingPatience) || "
              "has(self.hyperparameters.evalEverySteps)",
              "spec.hyperparameters.earlyStoppingPatience counts evaluations, and none is "
              "made during training — set spec.hyperparameters.evalEverySteps (e.g. 100)",
              ".hyperparameters.earlyStoppingPatience"))
def early_stopping_needs_evaluations(job: FineTuneJob) -> Iterator[Problem]:
    hp = job.spec.hyperparameters
    if hp.early_stopping_patience and not hp.eval_every_steps:
        yield Problem("spec.hyperparameters.earlyStoppingPatience", "counts evaluations, and "
                      "without evalEverySteps there is only the one at the end",
                      "set `spec.hyperparameters.evalEverySteps` (e.g. 100) and an eval split, "
                      "or remove earlyStoppingPatience")


@rule(CelRule("spec.dataset", "!has(self.evalSplit) || self.evalFraction == 0.0",
              "spec.dataset.evalSplit and evalFraction both name an eval split — keep one",
              ".evalSplit"))
def one_eval_split(job: FineTuneJob) -> Iterator[Problem]:
    data = job.spec.dataset
    if data.eval_split is not None and data.eval_fraction > 0:
        yield Problem("spec.dataset.evalSplit", f"is set, and evalFraction: "
                      f"{data.eval_fraction} too: a job has one eval split",
                      f"remove evalFraction to evaluate on the {data.eval_split} split, or "
                      "remove evalSplit to hold out that fraction of the training split")


@rule(CelRule("spec.dataset", "!has(self.evalSplit) || self.evalSplit != self.split",
              "spec.dataset.evalSplit is the split trained on — name another (e.g. "
              "validation), or use evalFraction", ".evalSplit"))
def eval_split_is_not_trained_on(job: FineTuneJob) -> Iterator[Problem]:
    data = job.spec.dataset
    if data.eval_split is not None and data.eval_split == data.split:
        yield Problem("spec.dataset.evalSplit", f"is {data.split}, the split trained on: its "
                      "loss would not tell how the model does on data it has not seen",
                      "name another split (e.g. validation), or use evalFraction to hold out "
                      "part of the training split")


@rule(CelRule("spec.dataset", "!has(self.evalSplit) || self.evalSplit.startsWith('train[') "
              f"|| !(self.uri.startsWith('https://') || self.uri.matches('{ONE_DATA_FILE}'))",
              "spec.dataset.evalSplit names a split, and spec.dataset.uri one file (split "
              "train) — point uri at a folder of train and validation files, evaluate on a "
              "slice (split: train[:95%], evalSplit: train[95%:]), or use evalFraction",
              ".evalSplit"))
def eval_split_needs_splits(job: FineTuneJob) -> Iterator[Problem]:
    data = job.spec.dataset
    one_file = data.uri.startswith("https://") or re.search(ONE_DATA_FILE, data.uri)
    if data.eval_split is not None and not data.eval_split.startswith("train[") and one_file:
        yield Problem("spec.dataset.evalSplit", f"is {data.eval_split}, and spec.dataset.uri "
                      f"names one file ({data.uri}), whose one split is train",
                      f"point uri at a folder of train and {data.eval_split} files (e.g. "
                      f"train.jsonl, {data.eval_split}.jsonl) or a hub dataset, evaluate on "
                      "a slice of that file (split: train[:95%], evalSplit: train[95%:]), or "
                      "use evalFraction")


@rule(CelRule("spec.resources", "!has(self.processesPerNode) || self.gpusPerNode == 0",
              "spec.resources.processesPerNode is for CPU workers — with GPUs there is one "
              "process per GPU; remove it", ".processesPerNode"))
def processes_only_for_cpu(job: FineTuneJob) -> Iterator[Problem]:
    r = job.spec.resources
    if r.processes_per_node is not None and r.on_gpus:
        yield Problem("spec.resources.processesPerNode",
                      f"is set with gpusPerNode: {r.gpus_per_node}",
                      "remove it: with GPUs there is one training process per GPU")


def gpu_type_is_known(job: FineTuneJob) -> Iterator[Problem]:
    """A gpuType the planner knows, with the GPUs per node it has: a warning otherwise (the
    job may still run on nodes the catalog does not list)."""
    resources = job.spec.resources
    gpu_type, wanted = resources.gpu_type, resources.gpus_per_node
    if not gpu_type:
        return
    vm = catalog.find(gpu_type, wanted)
    if vm is None:
        close = catalog.close_names(gpu_type)
        yield Problem("spec.resources.gpuType", f"{gpu_type!r} is not in the planner's GPU "
                      "catalog, so the memory check before launch is skipped",
                      f"did you mean {' or '.join(close)}? (`finetune plan --list-gpus` lists "
                      "the catalog)" if close else "use an Azure VM size (e.g. "
                      "Standard_ND96amsr_A100_v4) or a GPU model (T4, V100-32GB, A100-80GB, "
                      "H100, H200)", "warning")
        return
    if vm.gpus < wanted:
        family = vm.gpu.name.split("-")[0]
        choices = sorted((v for v in catalog.VM_SIZES if v.gpus >= wanted
                          and v.gpu.name.split("-")[0] == family),
                         key=lambda v: (v.gpu != vm.gpu,
                                        v.gpu.memory_bytes != vm.gpu.memory_bytes, v.gpus))
        choices = [v.name for v in choices]
        yield Problem("spec.resources.gpusPerNode", f"{wanted} GPUs per node, but {vm.name} "
                      f"has {vm.gpus} ({vm.gpu.name}): no node of it can hold a worker",
                      f"use gpuType {choices[0]} ({catalog.find(choices[0]).gpus} GPUs)"
                      if choices else f"set gpusPerNode to at most {vm.gpus}", "warning")
    models = {v.gpu.name for v in catalog.vm_sizes_with(gpu_type)}
    if len({(v.gpu.memory_bytes, v.gpu.bf16) for v in catalog.vm_sizes_with(gpu_type)}) > 1:
        yield Problem("spec.resources.gpuType", f"{gpu_type!r} could be {', '.join(sorted(models))}"
                      f": planned as {vm.name} ({vm.gpus} x {vm.gpu.name}) for {wanted} GPUs "
                      "per node", "name the GPU (e.g. " + sorted(models)[0] + ") or the VM "
                      "size", "warning")


RULES.append(Rule("gpu_type_is_known", gpu_type_is_known))


def parsed_locations(job: FineTuneJob) -> list[Location]:
    """The job's locations that parse (the others are `locations_are_supported`'s errors)."""
    parsed = []
    for source in (job.spec.model, job.spec.dataset, job.spec.output):
        try:
            parsed.append(source.location)
        except UriError:
            continue
    return parsed


def relative_locations(job: FineTuneJob) -> list[str]:
    """The location fields that hold a relative path (`finetune run` only)."""
    return [location.field for location in parsed_locations(job)
            if location.scheme == "relative"]


def locations_are_supported(job: FineTuneJob) -> Iterator[Problem]:
    spec = job.spec
    for source in (spec.model, spec.dataset, spec.output):
        try:
            _ = source.location
        except UriError as error:
            yield Problem(error.field or "spec", error.what, error.fix)
    relative = relative_locations(job)
    if relative:
        others = f" (also {', '.join(relative[1:])})" if relative[1:] else ""
        yield Problem(relative[0], f"relative paths{others} only work with `finetune run` on "
                      "one machine", "on a cluster use pvc://claim/path, azureml://... or an "
                      "absolute path inside the image", "warning", cluster_only=True)
    if spec.model.token_secret_ref and not spec.model.uri.startswith("hf://"):
        yield Problem("spec.model.tokenSecretRef", "is only used for hf:// models",
                      "remove it, or point spec.model.uri at the hub", "warning")


RULES.append(Rule("locations_are_supported", locations_are_supported))

# --- shared by the backends' own rules --------------------------------------------------

PUSH_THE_TRAINER_IMAGE = (
    "set FINETUNE_TRAINER_IMAGE to the image you pushed, built from trainer/Dockerfile (the "
    "chart sets it for the operator from trainer.image.repository and trainer.image.tag)")


def placeholder_image(job: FineTuneJob, settings: OperatorSettings | None = None
                      ) -> str | None:
    """The trainer image of `settings` (None: from the environment) when it is the default,
    a placeholder no registry serves (the chart requires a real one); None otherwise, and
    for a job of relative paths (for `finetune run`, which runs no image)."""
    image = (settings or OperatorSettings.from_env()).trainer_image
    default = OperatorSettings.model_fields["trainer_image"].default
    return image if image == default and not relative_locations(job) else None


# --- structure: pydantic errors as problems --------------------------------------------

_PATTERN_HINTS = {
    DNS_1035_LABEL: ("is not a DNS-1035 label",
                     "use lowercase letters, digits and '-', starting with a letter"),
    DNS_1123_LABEL: ("is not a DNS-1123 label", "use lowercase letters, digits and '-'"),
    QUANTITY_PATTERN: ("is not a Kubernetes quantity", "write e.g. 8, 500m, 64Gi"),
    r"^/\S*$": ("is not an absolute path", "start it with /"),
    GUID_PATTERN: ("is not a GUID", "copy the id from `az account show --query id`"),
    EXPORT_TARGET_PATTERN: ("is not an export target", "write oci://registry/repository[:tag] "
                            "(an OCI registry), hf://owner/name (the Hugging Face Hub) or "
                            "azureml://models/NAME (the Azure ML workspace)"),
}


def _pattern_hint(pattern: str, given: str) -> tuple[str, str]:
    """What is wrong with `given`, which `pattern` refuses, and the fix: the objectives' own
    words for their settings' patterns (a misspelt GRPO reward), else this module's."""
    theirs = dict(hint for spec in objectives.registry().values() for hint in spec.pattern_hints)
    if pattern in theirs:
        return theirs[pattern](given)
    return _PATTERN_HINTS.get(pattern, ("has the wrong form", f"match {pattern}"))


_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false",
               "string": "a string", "dict": "a mapping", "list": "a list", "model": "a mapping"}


_PLAIN_KEY = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$-]*$")


def field_path(loc: tuple[Any, ...]) -> str:
    """`spec.kubernetes.env[0].name`; a key that is empty or not a plain name is quoted
    (`spec.model[""]`, `spec["a b"]`), so the path is never blank or ambiguous."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.match(str(part)):
            out += f".{part}" if out else str(part)
        else:
            out += f"[{short_repr(str(part))}]".replace("'", '"')
    return out


def _field_names_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Wire names of the fields of the object at `loc`, for spelling suggestions."""
    current: Any = model
    keyed = False  # the part after a map's field is a key of it (`searchSpace["x"]`)
    for part in loc:
        if isinstance(part, int) or keyed or not (isinstance(current, type)
                                                  and issubclass(current, BaseModel)):
            keyed = False
            continue
        match = [f for n, f in current.model_fields.items() if (f.alias or n) == part]
        if not match:
            return []
        keyed = _is_map(match[0].annotation)
        current = _inner_model(match[0].annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or n for n, f in current.model_fields.items()]
    return []


def _is_map(annotation: Any) -> bool:
    """`dict[...]`, or `dict[...] | None`."""
    return get_origin(annotation) is dict or any(
        get_origin(arg) is dict for arg in getattr(annotation, "__args__", ()))


def _inner_model(annotation: Any) -> Any:
    """The BaseModel inside `X | None` or `list[X]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


_SHORT = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 2, 80, 40, 80
_SHORT.maxdict = _SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = 4


def short_repr(value: Any) -> str:
    """A value quoted in a message, cut short: the input may be megabytes (a list built
    with YAML aliases), and messages end up in the status and in events."""
    return _SHORT.repr(value)


def in_sweep_template(text: str) -> str:
    """A job's words about its fields (`spec.x`) as a sweep's, whose template the job's
    spec is (`spec.template.x`); `kubectl explain ftj.spec.x` as the sweep's kind's, whose
    schema holds the template's (`ftj` has no spec.template)."""
    return _JOB_FIELD.sub(lambda m: f"{SWEEP_SHORT_NAMES[0]}.spec.template." if m[1]
                          else "spec.template.", text)


_JOB_FIELD = re.compile(rf"(\b{SHORT_NAMES[0]}\.)?\bspec\.")


def structural_problem(error: Any, root: type[BaseModel]) -> Problem:
    loc = tuple(error["loc"])
    path = field_path(loc)
    kind = error["type"]
    ctx = error.get("ctx", {})
    given = error.get("input")
    short = {"FineTuneSweep": SWEEP_SHORT_NAMES[0]}.get(root.__name__, SHORT_NAMES[0])
    # kubectl explain takes field names only: a map's key (searchSpace["..."]) is cut off
    explain = f"see `kubectl explain {short}.{path.split('[')[0]}`" if path.startswith(
        "spec") else f"see the {root.__name__} reference, docs/api-reference.md"
    if kind == "missing":
        return Problem(path, "is required", f"add `{loc[-1]}`; {explain}")
    if kind == "extra_forbidden":
        known = _field_names_at(root, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        fix = (f"did you mean `{close[0]}`?" if close
               else "remove it; known fields: " + ", ".join(known))
        return Problem(path, "is not a known field", fix)
    if kind == "literal_error":
        return Problem(path, f"{short_repr(given)} is not allowed",
                       f"use one of {ctx.get('expected')}")
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = next(iter(ctx.values()))
        word = {"greater_than_equal": "at least", "greater_than": "greater than",
                "less_than_equal": "at most", "less_than": "less than"}[kind]
        return Problem(path, f"is {short_repr(given)}, must be {word} {bound}",
                       f"set a value {word} {bound}")
    if kind == "string_pattern_mismatch":
        what, fix = _pattern_hint(ctx.get("pattern"), given)
        return Problem(path, f"{short_repr(given)} {what}", fix)
    if kind in ("string_too_long", "too_long"):
        return Problem(path, f"is longer than {ctx.get('max_length')}", "shorten it")
    if kind in ("string_too_short", "too_short"):
        return Problem(path, "is empty", f"set a value; {explain}")
    base = kind.split("_")[0]
    if base in _TYPE_NAMES:
        return Problem(path, f"must be {_TYPE_NAMES[base]}, got {short_repr(given)}", explain)
    message = error["msg"]
    if kind == "value_error":  # a validator's own words, without pydantic's prefix
        message = message.removeprefix("Value error, ")
    return Problem(path, message, explain)


def _mistyped(spec: dict) -> list[Problem]:
    """The spec's values of the wrong JSON type that pydantic's lax parsing took anyway
    (`maxSteps: "4"`, `gradientCheckpointing: 0`) and the CRD's schema, so `kubectl
    apply`, refuses. A whole number written as a float (4.0) passes, as there."""
    try:
        FineTuneJobSpec.model_validate(spec, strict=True, by_alias=True, by_name=False)
    except ValidationError as error:
        return [structural_problem({**e, "loc": ("spec", *e["loc"])}, FineTuneJob)
                for e in error.errors() if e["type"].endswith("_type") and not (
                    e["type"] == "int_type" and isinstance(e.get("input"), float)
                    and e["input"].is_integer())]
    return []


# --- entry points ----------------------------------------------------------------------

def check_document(doc: Any) -> tuple[FineTuneJob | None, list[Problem]]:
    """Every problem with one manifest (errors and warnings), and the job if it parsed."""
    if not isinstance(doc, dict):
        return None, [Problem("(document)", f"is {type(doc).__name__}, not a mapping",
                              "write a FineTuneJob manifest (apiVersion, kind, metadata, spec)")]
    problems: list[Problem] = []
    if doc.get("apiVersion") != API_VERSION:
        problems.append(Problem("apiVersion", "is missing" if doc.get("apiVersion") is None
                                else f"{short_repr(doc.get('apiVersion'))} is not served by "
                                "this operator", f"use `apiVersion: {API_VERSION}`"))
    if doc.get("kind") != KIND:
        problems.append(Problem("kind", "is missing" if doc.get("kind") is None else
                                f"{short_repr(doc.get('kind'))} is not {KIND}",
                                f"use `kind: {KIND}`"))
    if problems:  # another kind, or another version: nothing below applies
        return None, problems
    namespace = (doc.get("metadata") or {}).get("namespace") if isinstance(
        doc.get("metadata"), dict) else None
    if isinstance(namespace, str) and (len(namespace) > 63
                                       or not re.fullmatch(DNS_1123_LABEL, namespace)):
        # the API server's own check (the request's path): no CEL rule sees it, and it
        # refuses the request before it reads the spec; said here with the spec's problems,
        # every problem at once
        problems.append(Problem("metadata.namespace", f"{short_repr(namespace)} is not a "
                                "DNS-1123 label", "use at most 63 lowercase letters, digits "
                                "and '-', starting and ending with a letter or digit"))
    try:
        # field names as the API server decodes them, strictly: camelCase only (the models
        # also take Python's names, for code; a manifest's `max_seq_length` is unknown there)
        job = FineTuneJob.model_validate(doc, by_alias=True, by_name=False)
    except ValidationError as error:
        return None, [*problems, *(structural_problem(e, FineTuneJob) for e in error.errors())]
    if mistyped := _mistyped(doc["spec"]):
        return None, [*problems, *mistyped]
    for r in RULES:
        problems.extend(r.check(job))
    return job, problems


def setting_errors(job: FineTuneJob) -> list[Problem]:
    """The errors of the cross-field rules the API server also checks (CEL): what a
    recommendation must pass before the planner makes it."""
    return [p for r in RULES if r.cel for p in r.check(job) if p.severity == "error"]


def parse_job(doc: Any) -> FineTuneJob:
    """The FineTuneJob in `doc`, or InvalidJobError listing every error (warnings pass)."""
    job, problems = check_document(doc)
    errors = [p for p in problems if p.severity == "error"]
    if errors or job is None:
        raise InvalidJobError(errors)
    return job
