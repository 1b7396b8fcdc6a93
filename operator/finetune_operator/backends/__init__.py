"""Backend plugins: where a FineTuneJob runs.

A backend is found through the `finetune_operator.backends` entry-point group, so a
plugin package adds one without touching this code. The built-in ones are registered
by this distribution's own entry points.
"""

from __future__ import annotations

from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "finetune_operator.backends"

# Backends this distribution ships but whose implementation has not landed yet: their
# names are accepted by validation so manifests written today stay valid.
PLANNED_BACKENDS = ("azureml",)


def installed_names() -> set[str]:
    """Names a manifest may use in `spec.backend`."""
    return set(PLANNED_BACKENDS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
