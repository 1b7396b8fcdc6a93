"""The output folder's layout: the export, the progress records, the checkpoints (and which
of them are complete), the copy of a hub model. Torch-free: `finetune run` and the
operator read it as well as the trainer."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote

FINAL_DIR = "final"
"""The export: a peft adapter, or the whole model's safetensors weights."""
MERGED_DIR = "merged"
"""With mergeAdapter: the base model with the adapter merged in."""
PROGRESS_FILE = "progress.json"
"""The latest progress record (finetune_trainer.record), replaced atomically."""
HISTORY_FILE = "progress.jsonl"
"""One progress record per log step."""
EXPORT_SECRETS = "/var/run/secrets/finetune/export"
"""In a worker: where each `output.export[].secretName` Secret is mounted, one folder each."""
RUN_LOG = "logs/run.log"
"""`finetune run`: every line torchrun and the workers wrote (what `finetune logs` reads)."""
RUN_LOCK = "logs/run.lock"
"""`finetune run`: locked (flock) by the run writing this folder while it and its torchrun
live; it names their pid and start. The kernel lets go when they end, kill -9 included."""
LOCAL_CONFIG = ".finetune/trainer.yaml"
"""`finetune run`: the trainer config it wrote and the workers read (the job's name in it)."""
TENSORBOARD_DIR = "tensorboard"
"""Rank 0's TensorBoard event files (`tensorboard --logdir <output>`)."""
REFERENCE_FILE = "reference-logps.pt"
"""DPO with full weights: every pair's reference log-probabilities, taken before step 1."""
SAVED_WEIGHTS = ("*.safetensors", "*.bin")
"""The weight files of a folder save_pretrained wrote (sharded ones too)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "*.tiktoken")
"""What a saved tokenizer leaves in a model folder, one at least: a fast tokenizer's
tokenizer.json, a SentencePiece model, BPE or WordPiece vocabularies, tiktoken ranks."""
NO_TOKENIZER = "holds no tokenizer (tokenizer.json, tokenizer.model or vocabulary files)"
"""What `finetune run` and the trainer say of a model folder without TOKENIZER_FILES."""
LORA_ADAPTER = (
    "is a LoRA adapter (adapter_config.json, no config.json), not a whole model to train",
    "train the job that made it with `spec.output.mergeAdapter: true` and point "
    f"spec.model.uri at its {MERGED_DIR}/ folder (the base model with the adapter merged in)")
"""What `finetune run` and the trainer say of a model folder holding only a peft adapter
(a LoRA job's final/, e.g. SFT's before DPO), and the fix."""
DEMO_MODEL = "build/demo/tiny-llama"
"""Where `make demo` builds the tiny model examples 01 and 08 train, from the repository's
root (`python -m finetune_trainer.tiny`): `finetune validate` and `run` name what builds it
when it is missing."""


def holds_any(folder: Path, patterns: tuple[str, ...]) -> bool:
    """`folder` has a file matching one of `patterns` (SAVED_WEIGHTS, TOKENIZER_FILES)."""
    return any(any(folder.glob(pattern)) for pattern in patterns)


CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
"""Written last into a checkpoint: a folder without it is not complete."""
_NAME = re.compile(r"^step-(\d{8})$")
MODEL_CACHE = "model-cache"
"""Hub models fetched once for every node and every restart (`finetune_trainer.fetch`)."""
FETCHED_FILE = "fetched.json"
"""Written last into a model copy: a folder without it is not complete."""


def resolve_output(uri: str, base_dir: Path) -> Path:
    """The output folder of a local or mounted `output.uri` (relative to `base_dir`)."""
    path = Path(uri)
    return path if path.is_absolute() else (base_dir / path).resolve()


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / CHECKPOINTS


def step_of(checkpoint: Path) -> int:
    return int(_NAME.match(checkpoint.name).group(1))


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=step_of)


def latest_checkpoint(output_dir: Path) -> Path | None:
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None


def model_copy_dir(output_dir: Path, repo: str, revision: str | None) -> Path:
    """The folder holding hub repo `repo` at `revision` (None: the default branch), one per
    pair: `model-cache/org--name@main`. The revision is quoted (`refs/pr/1` →
    `refs%2Fpr%2F1`), so no two revisions share a folder."""
    pinned = quote(revision, safe="") if revision else "default"
    return output_dir / MODEL_CACHE / f"{repo.replace('/', '--')}@{pinned}"


def export_secret_dir(secret_name: str) -> Path:
    """Where the workers have an export target's Secret mounted (the kubernetes backend's
    render mounts it there)."""
    return Path(EXPORT_SECRETS) / secret_name


def export_credentials(secret_name: str, key: str) -> Path:
    """Key `key` of an export target's Secret (its Docker config, or a hub token)."""
    return export_secret_dir(secret_name) / key
