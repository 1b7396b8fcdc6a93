"""What a checkpoint was trained with, so a run with other settings never resumes from it.

An output folder belongs to one training. Every checkpoint carries `trained_with.json`: what
its state depends on, named as in the FineTuneJob spec. What is trained (the objective and
its settings, the method, the model by its URI and revision), on what (the dataset by the
digest of its files, `fingerprints`, or by its URI where it has none; its format and split),
the tensors' shapes (the adapter's rank and targets, the strategy's layout, the precision;
under ZeRO, the worker count) and the meaning of its data position (sequence length,
packing, global batch, seed); and which job wrote it, recorded but not compared (a job
applied again under a new uid resumes its own folder). A run whose settings differ would
fail loading it (a size mismatch, on every restart), or worse, train on from another
training's weights and replace its export; instead it is refused before anything starts, in
one line naming the fields and the fix. A dataset changed on purpose resumes where
`output.resumeWithChangedData` says so. A folder holding an export (`final/`) and no
checkpoint is refused too: a run there would start at step 0 and replace that model.
Changing anything else (learning rate, steps, epochs, checkpoint interval, ...) resumes as
before, and so does a ddp or fsdp job on other workers with the same global batch.

Torch-free: `finetune run` and the operator's image read it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune_trainer import fingerprints, objectives
from finetune_trainer.config import LoraConfig, TrainerConfig
from finetune_trainer.layout import FINAL_DIR, MERGED_DIR, latest_checkpoint

FILE = "trained_with.json"


DATA_CONTENT = "dataset content"
"""The digest of the dataset's files (`fingerprints.dataset`); None for hub and https data."""
JOB = "job"
"""Which job wrote the checkpoint: recorded, named in a refusal, never compared."""
CHANGED_DATA = ("dataset.uri", DATA_CONTENT, "dataset.format", "dataset.split",
                "dataset.evalSplit", "dataset.evalFraction")
"""What `output.resumeWithChangedData` lets differ: the data itself, not how it is cut into
sequences (maxSeqLength, packing) nor anything of the model's."""


def _objective_settings(config: TrainerConfig) -> dict[str, Any]:
    """`objective.<name>.<field>` of every registered objective's settings: the chosen one's
    values (its defaults included), None for the others; not those a settings section
    names `not_trained_with` (how DPO's reference is taken, not what it is)."""
    chosen = config.objective.settings()
    values = chosen.model_dump(mode="json") if chosen is not None else {}  # JSON: the record
    return {f"objective.{name}.{info.alias}": (values[field] if name ==
                                               config.objective.type else None)
            for name, spec in objectives.registry().items() if spec.settings is not None
            for field, info in spec.settings.model_fields.items()
            if field not in getattr(spec.settings, "not_trained_with", ())}


def record(config: TrainerConfig, data_content: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    """The settings a checkpoint's state depends on, keyed by their spec path;
    `data_content`: the dataset's digest (`fingerprints.dataset`), where it has one."""
    lora = (config.method.lora or LoraConfig()) if config.method.type != "full" else None
    hp, data = config.hyperparameters, config.dataset
    model = config.model_fetched_from or config.model  # the spec's, not the copy's folder
    given = config.placeholders or {}  # Azure ML's names, not this job's mount paths
    return {
        JOB: _job(config),
        "objective.type": config.objective.type,
        **_objective_settings(config),
        "model.uri": given.get("model", model.uri),
        "model.revision": model.revision,
        "dataset.uri": given.get("dataset", data.uri),
        DATA_CONTENT: data_content,
        "dataset.format": data.format,
        "dataset.split": data.split,
        "dataset.evalSplit": data.eval_split,
        "dataset.evalFraction": data.eval_fraction,
        "method.type": config.method.type,
        "method.lora.r": lora.r if lora else None,
        "method.lora.alpha": lora.alpha if lora else None,
        "method.lora.targetModules": sorted(lora.target_modules) if lora else None,
        "strategy.type": config.strategy.type,
        "strategy.precision": config.strategy.precision,
        "dataset.maxSeqLength": data.max_seq_length,
        "dataset.packing": data.packing,
        "hyperparameters.seed": hp.seed,
        **_batch(config),
    }


GLOBAL_BATCH = ("global batch (hyperparameters.batchSizePerDevice x "
                "gradientAccumulationSteps x workers)")
WORKERS = "workers (resources.nodes x processes per node)"


def _batch(config: TrainerConfig) -> dict[str, Any]:
    """The data position's meaning: a step is one global batch, however the workers split
    it (`data.GlobalBatches`). So a ddp or fsdp job may resume on other workers that keep
    the global batch (DCP reshards its checkpoint; `finetune run --nproc` scales
    gradientAccumulationSteps to keep it); a ZeRO checkpoint is partitioned by worker and
    resumes only on as many. Each worker's batch where the worker count is unknown."""
    hp = config.hyperparameters
    if config.workers is None:
        return {"hyperparameters.batchSizePerDevice": hp.batch_size_per_device,
                "hyperparameters.gradientAccumulationSteps": hp.gradient_accumulation_steps}
    kept = {GLOBAL_BATCH: hp.batch_size_per_device * hp.gradient_accumulation_steps
            * config.workers}
    if config.strategy.type.startswith("zero"):
        kept[WORKERS] = config.workers
    return kept


def _job(config: TrainerConfig) -> dict[str, Any]:
    job = config.job
    return {"namespace": job.namespace, "name": job.name, "uid": job.uid,
            "manifest": job.manifest}


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`path: before → now` for every recorded setting that changed (keys a newer version
    added, absent from an older checkpoint, are not held against it). Data that both sides
    know by content is compared by content alone: the same files under another name (a copy,
    a mount path) are the same data; data only one side has a digest of, by its URI."""
    ignored = {JOB}
    if recorded.get(DATA_CONTENT) and current.get(DATA_CONTENT):
        ignored.add("dataset.uri")
    else:
        ignored.add(DATA_CONTENT)
    if recorded.get("objective.type") != current.get("objective.type"):
        ignored |= {key for key in recorded if key.startswith("objective.")} - {
            "objective.type"}  # another objective's settings differ as a matter of course
    return [f"{key}: {_show(key, recorded)} → {_show(key, current)}"
            for key in recorded if key in current and key not in ignored
            and recorded[key] != current[key]]


def _show(key: str, settings: dict[str, Any]) -> str:
    value = settings.get(key)
    if key == DATA_CONTENT:  # the files by name too: the digest alone says nothing to people
        return f"{settings.get('dataset.uri')} ({fingerprints.describe(value)})"
    return json.dumps(value) if not isinstance(value, str) else value


def _written_by(recorded: dict[str, Any], config: TrainerConfig) -> str:
    """`, written by FineTuneJob ns/name` (and its manifest under `finetune run`), where
    another job than `config`'s wrote it."""
    job = recorded.get(JOB)
    if not isinstance(job, dict) or not job.get("name") or job == _job(config):
        return ""
    where = f" from {job['manifest']}" if job.get("manifest") else ""
    return f", written by FineTuneJob {job.get('namespace') or 'default'}/{job['name']}{where}"


def read(checkpoint: Path) -> dict[str, Any] | None:
    """A checkpoint's record; None for one written before records existed."""
    path = checkpoint / FILE
    return json.loads(path.read_text()) if path.is_file() else None


def refusal(output_dir: Path, config: TrainerConfig, fix: str,
            base_dir: Path | None = None) -> str | None:
    """One line saying why `config` must not train in `output_dir`, or None when it may:
    nothing there yet, or its newest checkpoint was trained with the same settings (a
    changed dataset too, where `output.resumeWithChangedData` allows it). `base_dir`:
    where relative dataset paths start."""
    checkpoint = latest_checkpoint(output_dir)  # the one a run would resume from
    if checkpoint is None:
        return _export_without_checkpoint(output_dir, fix)
    recorded = read(checkpoint)
    if recorded is None:
        return None
    content = (fingerprints.dataset(config.dataset, base_dir, output_dir)
               if recorded.get(DATA_CONTENT) else None)
    changed = _changes(recorded, config, content)
    if config.output.resume_with_changed_data:
        changed = [line for line in changed if not line.startswith(CHANGED_DATA)]
    if not changed:
        return None
    if any(line.startswith(f"{WORKERS}:") for line in changed):
        fix = (f"ZeRO checkpoints resume only on as many workers as wrote them: run it on "
               f"{recorded[WORKERS]} workers again, or {fix}")
    if all(line.startswith(CHANGED_DATA) for line in changed):
        fix += ("; or, if the data changed on purpose, set spec.output.resumeWithChangedData: "
                "true to train on from the checkpoint")
    newest = f"newest {checkpoint.name}{_written_by(recorded, config)}"
    return (f"{output_dir} holds checkpoints trained with other settings "
            f"({'; '.join(changed)}; {newest}), which this job cannot resume from — {fix}")


def changed_data(output_dir: Path, config: TrainerConfig, content: dict[str, Any] | None
                 ) -> list[str]:
    """The dataset's differences from the newest checkpoint's record that
    `output.resumeWithChangedData` let through (for the line saying the run resumes anyway)."""
    checkpoint = latest_checkpoint(output_dir)
    recorded = read(checkpoint) if checkpoint is not None else None
    if recorded is None or not config.output.resume_with_changed_data:
        return []
    return [line for line in _changes(recorded, config, content)
            if line.startswith(CHANGED_DATA)]


def _changes(recorded: dict[str, Any], config: TrainerConfig,
             content: dict[str, Any] | None) -> list[str]:
    """`differences` between a checkpoint's record and `config` run on data of `content`."""
    if GLOBAL_BATCH not in recorded:  # recorded each worker's batch: compared as such
        config = config.model_copy(update={"workers": None})
    return differences(recorded, record(config, content))


def _export_without_checkpoint(output_dir: Path, fix: str) -> str | None:
    """A model exported there with no checkpoint left to resume: this run would start at
    step 0 and, at its end, replace it."""
    exports = [name for name in (FINAL_DIR, MERGED_DIR) if (output_dir / name).is_dir()]
    if not exports:
        return None
    return (f"{output_dir} holds an exported model ({', '.join(f'{n}/' for n in exports)}) "
            "and no checkpoint it could resume from: this run would start at step 0 and "
            f"replace it — {fix}")
