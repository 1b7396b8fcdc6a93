"""The exported model's card, `final/README.md`: what it was trained from, on what data, how,
with what result, and how to load it. peft writes an empty template there ("Model Card for
Model ID ... [More Information Needed]"), which the Hugging Face Hub, vLLM's users and a
colleague opening the folder would otherwise read.

`render` is pure (the config and the final progress record in, Markdown out); `write` puts
it in place. The export's files are made readable as the rest of the folder is
(`share_like_the_folder`): safetensors writes its file 0600, which a serving pod running
as another user cannot open.
"""

from __future__ import annotations

import os
from pathlib import Path

from finetune_trainer import fetch, objectives
from finetune_trainer.config import LoraConfig, TrainerConfig
from finetune_trainer.layout import FINAL_DIR, MERGED_DIR, PROGRESS_FILE
from finetune_trainer.record import ProgressRecord, format_duration, headline

CARD = "README.md"


def hub_repo(config: TrainerConfig) -> str | None:
    """The base model's hub repo id (`org/name`), where it came from the hub (a fetched copy
    included); None for a folder, a claim or an Azure ML asset."""
    return fetch.hub_repo(config.model_fetched_from or config.model)


def base_model(config: TrainerConfig) -> str:
    """The base model as others find it: its hub repo id, else the spec's location."""
    return hub_repo(config) or (config.model_fetched_from or config.model).uri


def render(config: TrainerConfig, record: ProgressRecord | None) -> str:
    """The card's Markdown: YAML front matter the Hub reads, then what, how and how to load.

    The front matter's `base_model` is a hub repo id to the Hub (its model tree, the link
    to the base): a base from elsewhere (a folder, a PVC, Azure ML) stays out of it, named
    in the prose only, as neither its path nor its folder's name is such an id."""
    adapter = config.method.type != "full"
    base = base_model(config)
    tags = ["finetune-operator", config.method.type, config.objective.type]
    repo = hub_repo(config)
    front = ["---", *([f"base_model: {repo}"] if repo else []),
             f"library_name: {'peft' if adapter else 'transformers'}",
             "pipeline_tag: text-generation", "tags:", *(f"- {tag}" for tag in tags), "---"]
    lines = [*front, "", f"# {config.job.name}", "", _what(config, base), "",
             "## Training", "", "| | |", "|---|---|",
             *(f"| {name} | {value} |" for name, value in _settings(config)),
             *(f"| {name} | {value} |" for name, value in _results(record)), "",
             "## Loading it", "", *_loading(config, base), ""]
    return "\n".join(lines)


def _what(config: TrainerConfig, base: str) -> str:
    what = {"lora": "A LoRA adapter", "qlora": "A QLoRA adapter", "full": "Full weights"}[
        config.method.type]
    how = objectives.spec_of(config.objective.type).title
    on = " (trained on the base quantised to 4 bits)" if config.method.type == "qlora" else ""
    return (f"{what} of `{base}`{on}, trained with {how} by finetune-operator "
            f"(FineTuneJob `{config.job.namespace}/{config.job.name}`).")


def _settings(config: TrainerConfig) -> list[tuple[str, str]]:
    hp, data = config.hyperparameters, config.dataset
    rows = [("data", f"`{data.uri}` (format {data.format}, maxSeqLength {data.max_seq_length})")]
    if config.method.type != "full":
        lora = config.method.lora or LoraConfig()
        targets = ", ".join(lora.target_modules) if lora.target_modules else "auto"
        rows.append(("LoRA", f"r {lora.r}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, "
                             f"target modules {targets}"))
    if (settings := config.objective.settings()) is not None:
        rows.append((config.objective.type.upper(), _said(settings)))
    rows += [("strategy", f"{config.strategy.type}, {config.strategy.precision}"
                          + (f", {config.workers} worker{'s' if config.workers != 1 else ''}"
                             if config.workers else "")),
             ("learning rate", f"{hp.learning_rate:g}" if hp.learning_rate else "default"),
             ("batch", f"{hp.batch_size_per_device} per device x "
                       f"{hp.gradient_accumulation_steps} accumulation steps"),
             ("seed", str(hp.seed))]
    return rows


def _said(settings) -> str:
    """An objective's settings section in a line: `beta 0.2, loss sigmoid, ...`; a list of
    named entries by their names and weights (GRPO's rewards)."""
    parts = []
    for field, info in type(settings).model_fields.items():
        value = getattr(settings, field)
        if isinstance(value, list):
            value = ", ".join(f"{item.name} x {item.weight:g}" if hasattr(item, "weight")
                              else str(getattr(item, "name", item)) for item in value)
        elif isinstance(value, float):
            value = f"{value:g}"
        if value is not None:
            parts.append(f"{info.alias or field} {value}")
    return ", ".join(parts)


def _results(record: ProgressRecord | None) -> list[tuple[str, str]]:
    if record is None:
        return []
    rows = [("steps", f"{record.step}" + (f" of {record.total_steps}" if record.total_steps
                                          else ""))]
    for name, value in (("final training loss", record.loss),
                        ("evaluation loss", record.eval_loss)):
        if value is not None:
            rows.append((name, f"{value:.4f}"))
    for label, value, shown in headline(record.objective_metrics):
        rows.append((label, shown.format(value)))
    if record.stopped_early:
        rows.append(("stopped early", record.stopped_early))
    if record.step_seconds:
        rows.append(("time per step", format_duration(record.step_seconds)
                     if record.step_seconds >= 60 else f"{record.step_seconds:.2f} s"))
    if record.update_time:
        rows.append(("finished", record.update_time))
    return rows


def _loading(config: TrainerConfig, base: str) -> list[str]:
    if config.method.type == "full":
        code = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                'model = AutoModelForCausalLM.from_pretrained("path/to/final")']
        serve = "vllm serve path/to/final"
    else:
        code = ["from peft import AutoPeftModelForCausalLM",
                "from transformers import AutoTokenizer", "",
                "# reads the base model named in adapter_config.json, then this adapter",
                'model = AutoPeftModelForCausalLM.from_pretrained("path/to/final")']
        serve = f"vllm serve {base} --enable-lora --lora-modules {config.job.name}=path/to/final"
    return ["```python", *code, 'tokenizer = AutoTokenizer.from_pretrained("path/to/final")',
            "```", "", "Served by vLLM:", "", "```bash", serve, "```", "",
            "Asked a question here: `python -m finetune_trainer.generate path/to/final "
            '"your question"`.']


def write(output_dir: Path, config: TrainerConfig) -> None:
    """The card in final/ in place of peft's template, from the run's last progress record,
    and the export's files (final/, merged/) readable as a new file here is."""
    try:
        record = ProgressRecord.model_validate_json(
            (output_dir / PROGRESS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no record (progress off): the card without results
        record = None
    (output_dir / FINAL_DIR / CARD).write_text(render(config, record), encoding="utf-8")
    for folder in (FINAL_DIR, MERGED_DIR):
        if (output_dir / folder).is_dir():
            share_like_the_folder(output_dir / folder)


def share_like_the_folder(folder: Path) -> None:
    """Every file in `folder` readable as a new file is here (0644 under the usual umask):
    safetensors writes its weights 0600 through a temporary file, whatever the umask."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)
