"""The azureml backend's word on a manifest before anything runs: its spec section
(`spec.azureml`, required, a CEL rule in the CRD), Kueue's queue label on one of its jobs,
and where its logs are. Light on purpose: `finetune validate` and `finetune run` load it
(entry point `finetune_operator.backend_rules`) without azure-ai-ml or any client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from finetune_operator.api import FineTuneJob
from finetune_operator.backends import KUEUE_QUEUE_LABEL, BackendRules
from finetune_operator.validation import CelRule, Problem, Rule

NAME = "azureml"


def section_present(job: FineTuneJob) -> Iterator[Problem]:
    if job.spec.backend == NAME and job.spec.azureml is None:
        yield Problem("spec.azureml", f"is required by backend {NAME}",
                      "add `azureml: {subscriptionId, resourceGroup, workspace, compute}`")


def not_queued_by_kueue(job: FineTuneJob) -> Iterator[Problem]:
    """Kueue queues only the kinds it integrates; Azure ML queues the job on its compute.
    An error, as on the kubernetes backend: a job meant to wait for quota must not start
    unqueued. No CEL rule: the API server's rules cannot see metadata.labels."""
    if job.spec.backend != NAME:
        return
    for where, values in (("metadata.labels", job.metadata.labels),
                          ("metadata.annotations", job.metadata.annotations)):
        if KUEUE_QUEUE_LABEL in values:
            yield Problem(where, f"{KUEUE_QUEUE_LABEL} is Kueue's, and Kueue does not queue "
                          f"backend {NAME} jobs", "remove it: Azure ML queues the job on its "
                          "compute (spec.azureml.compute)")


def logs_hint(obj: dict[str, Any]) -> str:
    """Where an Azure ML job's logs are read (its Studio page, or the az CLI)."""
    spec = obj.get("spec", {}).get("azureml") or {}
    ref = (obj.get("status") or {}).get("backendRef") or {}
    if not ref.get("name"):
        return "the Azure ML job is not submitted yet: nothing to read"
    command = (f"az ml job stream --name {ref['name']} --resource-group "
               f"{spec.get('resourceGroup', '<group>')} --workspace-name "
               f"{spec.get('workspace', '<workspace>')}")
    return f"Azure ML job {ref['name']}: {command}" + (
        f"\n  or in Studio: {ref['url']}" if ref.get("url") else "")


RULES = (
    Rule("azureml_section_present", section_present, (
        CelRule("spec", f"self.backend != '{NAME}' || has(self.{NAME})",
                f"backend {NAME} needs spec.{NAME} (subscriptionId, resourceGroup, "
                "workspace, compute)", f".{NAME}"),)),
    Rule("not_queued_by_kueue", not_queued_by_kueue),
)

BACKEND_RULES = BackendRules(section=NAME, rules=RULES, logs_hint=logs_hint)
"""What `finetune_operator.backend_rules` names for this backend."""
