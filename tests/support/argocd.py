"""The chart's Argo CD health checks (charts/finetune-operator/argocd/argocd-cm-health.yaml)
run in Lua 5.1, the language of gopher-lua, which Argo CD runs them in; `obj` handed over
as Argo CD hands it: objects and arrays as tables (arrays from 1), nulls left out."""

from __future__ import annotations

from typing import Any

import lupa.lua51
import yaml

from tests.conftest import REPO

HEALTH_PATCH = REPO / "charts/finetune-operator/argocd/argocd-cm-health.yaml"
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}
"""What Argo CD takes back from a health script."""


def argo_health(obj: dict[str, Any]) -> dict[str, str]:
    """{status, message} of the health check of `obj`'s kind (a FineTuneJob, a sweep)."""
    script = yaml.safe_load(HEALTH_PATCH.read_text())["data"][
        f"resource.customizations.health.finetune.dev_{obj['kind']}"]
    lua = lupa.lua51.LuaRuntime(unpack_returned_tuples=True)

    def table(value):
        if isinstance(value, dict):
            return lua.table_from({k: table(v) for k, v in value.items() if v is not None})
        if isinstance(value, list):
            return lua.table_from([table(v) for v in value])
        return value

    lua.globals().obj = table(obj)
    returned = lua.execute(script)
    said = {"status": returned["status"], "message": returned["message"]}
    assert said["status"] in ARGO_STATUSES and isinstance(said["message"], str), said
    return said
