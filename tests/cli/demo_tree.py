"""The examples as a checkout holds them, before or after `make demo`, in a folder of the
test's own: examples 01 and 08 name the tiny model `make demo` builds (a relative path), so
whether they validate depends on it, and the repository's own build/ may or may not hold it."""

from __future__ import annotations

import shutil
from pathlib import Path

from finetune_trainer import layout
from tests.conftest import EXAMPLES, REPO, SWEEP_EXAMPLES


def examples_in(root: Path, demo_built: bool = True) -> list[Path]:
    """Copies of the example manifests (and their data) under `root/examples`; with
    `demo_built`, the tiny model's folder as `make demo` leaves it (the files `finetune
    validate` looks for: nothing loads them)."""
    examples = root / "examples"
    shutil.copytree(REPO / "examples" / "data", examples / "data")
    copies = []
    for path in EXAMPLES + SWEEP_EXAMPLES:
        copies.append(examples / path.name)
        shutil.copy(path, copies[-1])
    if demo_built:
        model = root / layout.DEMO_MODEL
        model.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (model / name).write_text("{}")
    return copies
