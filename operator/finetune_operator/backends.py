"""Backend plugins: discovered through the `finetune_operator.backends` entry points."""

from __future__ import annotations

from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "finetune_operator.backends"

# The two backends this distribution ships. Their implementations land with the
# operator and Azure ML work; until then validation knows their names.
BUILTIN_BACKENDS = ("kubernetes", "azureml")


def installed_names() -> set[str]:
    """Names a manifest may use in `spec.backend`."""
    return set(BUILTIN_BACKENDS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
