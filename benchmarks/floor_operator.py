"""The floor for benchmarks/operator_load.py: a kopf operator that does nothing but give each
new FineTuneJob a phase. Whatever our operator costs beyond this is ours to justify.

    KUBECONFIG=... python -m kopf run --standalone --all-namespaces benchmarks/floor_operator.py
"""

from __future__ import annotations

from typing import Any

import kopf


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_via_client(**kwargs)


@kopf.on.create("finetune.dev", "v1alpha1", "finetunejobs")
def phase(patch: kopf.Patch, **_: Any) -> None:
    patch.status["phase"] = "Launching"
