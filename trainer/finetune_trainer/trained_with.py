"""What a checkpoint was trained with, so a run with other settings never resumes from it.

Every checkpoint carries `trained_with.json`: the settings its state depends on, named as
in the FineTuneJob spec. Its tensors' shapes (the model, the adapter's rank and targets, the
strategy's layout, the precision; under ZeRO, the worker count) and the meaning of its
data position (sequence length, packing, global batch, seed). A run whose settings differ
would fail loading it (a size mismatch, on every restart) or silently resume somewhere else
in the data; instead it is refused before anything starts, in one line naming the fields
and the fix. Changing anything else (learning rate, steps, epochs, checkpoint interval,
...) resumes as before, and so does a ddp or fsdp job on other workers with the same
global batch.

Torch-free: `finetune run` and the operator's image read it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune_trainer.config import LoraConfig, TrainerConfig
from finetune_trainer.layout import latest_checkpoint

FILE = "trained_with.json"


def record(config: TrainerConfig) -> dict[str, Any]:
    """The settings a checkpoint's state depends on, keyed by their spec path."""
    lora = (config.method.lora or LoraConfig()) if config.method.type != "full" else None
    hp, data = config.hyperparameters, config.dataset
    model = config.model_fetched_from or config.model  # the spec's, not the copy's folder
    return {
        "model.uri": model.uri,
        "model.revision": model.revision,
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


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`path: before → now` for every recorded setting that changed (keys a newer version
    added, absent from an older checkpoint, are not held against it)."""
    return [f"{key}: {_show(recorded[key])} → {_show(current.get(key))}"
            for key in sorted(recorded) if key in current and recorded[key] != current[key]]


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def read(checkpoint: Path) -> dict[str, Any] | None:
    """A checkpoint's record; None for one written before records existed."""
    path = checkpoint / FILE
    return json.loads(path.read_text()) if path.is_file() else None


def refusal(output_dir: Path, config: TrainerConfig, fix: str) -> str | None:
    """One line saying why `config` must not resume from `output_dir`'s checkpoints, or
    None when it may (no checkpoint, or the same settings)."""
    checkpoint = latest_checkpoint(output_dir)  # the one a run would resume from
    recorded = read(checkpoint) if checkpoint is not None else None
    if recorded is None:
        return None
    if GLOBAL_BATCH not in recorded:  # recorded each worker's batch: compared as such
        config = config.model_copy(update={"workers": None})
    changed = differences(recorded, record(config))
    if not changed:
        return None
    if any(line.startswith(f"{WORKERS}:") for line in changed):
        fix = (f"ZeRO checkpoints resume only on as many workers as wrote them: run it on "
               f"{recorded[WORKERS]} workers again, or {fix}")
    return (f"{output_dir} holds checkpoints trained with other settings "
            f"({'; '.join(changed)}; newest {checkpoint.name}), which this job cannot resume "
            f"from — {fix}")
