"""A STAND-IN for Kueue's admission of a batch/v1 Job, used only because Kueue cannot be built
here (the Go module proxy refuses sigs.k8s.io/kueue). It does what Kueue documents for its
batch/job integration and nothing more:

- a Job labelled `kueue.x-k8s.io/queue-name` is held while `spec.suspend` is true (the
  operator creates it so; Kueue's webhook would otherwise suspend it);
- on admission, Kueue writes the node labels of the ResourceFlavor it assigned into the
  pod template's `nodeSelector` (allowed while the Job is suspended), then sets
  `spec.suspend: false`; the Job controller creates the pods;
- on preemption (eviction), Kueue sets `spec.suspend: true` again (the Job controller stops
  the pods) and, once they are gone, puts back the template's original node selector.

`make kind-e2e` runs the real Kueue where Docker is available.
"""

from __future__ import annotations

import json
from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def queued_jobs(kubectl: Any, namespace: str) -> list[dict[str, Any]]:
    listed = kubectl("get", "jobs", "-n", namespace, "-l", QUEUE_LABEL, "-o", "json")
    return [j for j in json.loads(listed.stdout)["items"] if j["spec"].get("suspend")]


def admit(kubectl: Any, namespace: str, job: str, flavor_node_labels: dict[str, str]) -> None:
    """Admit one Job the way Kueue does: the flavor's node labels, then unsuspend."""
    kubectl("patch", "job", job, "-n", namespace, "--type=merge", "-p", json.dumps(
        {"spec": {"template": {"spec": {"nodeSelector": flavor_node_labels}}}}))
    kubectl("patch", "job", job, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"suspend": False}}))


def preempt(kubectl: Any, namespace: str, job: str, original_node_selector: dict[str, str]
            ) -> None:
    """Evict one admitted Job the way Kueue does: suspend it, then restore its template."""
    kubectl("patch", "job", job, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"suspend": True}}))
    kubectl("patch", "job", job, "-n", namespace, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/template/spec/nodeSelector",
          "value": original_node_selector}]))
