"""A GPU box given only the training stack (scripts/gpu-wheels.sh): with this folder first on
PYTHONPATH, every Python process started, torchrun's workers too, is refused the operator's
client stack and the cluster tests' own plugins, as if they were not installed; and the
modules FINETUNE_ABSENT_MODULES names (comma-separated), where a test takes one more away."""

import os
import sys

ABSENT = {"kopf", "kubernetes", "aiohttp", "optuna", "azure", "kmock", "pytest_asyncio",
          *filter(None, os.environ.get("FINETUNE_ABSENT_MODULES", "").split(","))}


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, Absent())
