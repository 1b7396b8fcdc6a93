"""The second floor for benchmarks/operator_load.py: a kopf operator that launches each new
FineTuneJob the least a launch can cost — it creates the job's three children (the same
ConfigMap, Service and Job ours renders, through the same client) and sets a phase, and
watches nothing else. The cluster then does for it what it does for ours (the Job
controller, the scheduler, KWOK's pods), so ours minus this is what our watches, status and
rules cost.

    KUBECONFIG=... python -m kopf run --standalone --all-namespaces \\
        benchmarks/floor_children_operator.py
"""

from __future__ import annotations

from typing import Any

import kopf

from finetune_operator.backends.kubernetes.workers import render
from finetune_operator.kube import Kube
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import parse_job

SETTINGS = OperatorSettings()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_via_client(**kwargs)


@kopf.on.startup()
def connected(memo: kopf.Memo, **_: Any) -> None:
    memo.kube = Kube()


@kopf.on.create("finetune.dev", "v1alpha1", "finetunejobs")
async def launch(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    for child in render(parse_job(dict(body)), SETTINGS):
        await memo.kube.create(child)
    patch.status["phase"] = "Launching"
