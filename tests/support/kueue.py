"""Kueue as a test meets it: the real Kueue v0.17 of the session's control plane
(cluster/kueue_manager.py, what `make cluster` runs). Admission, preemption, eviction and the
messages are Kueue's own; a test acts as a platform engineer does: it gives its namespace a
ClusterQueue of its own (quotas do not mix between tests), sets quotas and priorities, and
reads the Workload Kueue made for a Job.
"""

from __future__ import annotations

import json
from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
GPU = "nvidia.com/gpu"


class Queues:
    """ClusterQueues for one test namespace (named after it), each with a LocalQueue there,
    over the flavors of cluster/kueue-queues.yaml (a100: 4 GPUs, ndasrv4: 16)."""

    def __init__(self, kubectl: Any, namespace: str) -> None:
        self.kubectl, self.namespace = kubectl, namespace
        self.made: list[str] = []

    def cluster_queue(self, local: str) -> str:
        return f"{self.namespace}-{local}"

    def make(self, local: str = "team-a", cohort: str | None = None,
             reclaim: bool = False, **gpus: int | tuple[int, int]) -> None:
        """A ClusterQueue with `gpus` per flavor (a nominal quota, or (nominal, borrowing
        limit) in a cohort) that preempts lower priorities, and LocalQueue `local`."""
        name = self.cluster_queue(local)
        flavors = []
        for flavor, quota in gpus.items():
            nominal, borrowing = quota if isinstance(quota, tuple) else (quota, None)
            resource: dict[str, Any] = {"name": GPU, "nominalQuota": nominal}
            if borrowing is not None:
                resource["borrowingLimit"] = borrowing
            flavors.append({"name": flavor, "resources": [resource]})
        preemption: dict[str, Any] = {"withinClusterQueue": "LowerPriority"}
        if reclaim:
            preemption["reclaimWithinCohort"] = "Any"
        spec: dict[str, Any] = {
            "namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": self.namespace}},
            "preemption": preemption,
            "resourceGroups": [{"coveredResources": [GPU], "flavors": flavors}]}
        if cohort:
            spec["cohortName"] = f"{self.namespace}-{cohort}"
        self._apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
                     "metadata": {"name": name}, "spec": spec},
                    {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                     "metadata": {"name": local, "namespace": self.namespace},
                     "spec": {"clusterQueue": name}})
        self.made.append(name)

    def quota(self, flavor: str, gpus: int, local: str = "team-a") -> None:
        """Set `flavor`'s GPU quota of the ClusterQueue behind `local`."""
        name = self.cluster_queue(local)
        queue = json.loads(self.kubectl("get", "clusterqueue", name, "-o", "json").stdout)
        for group in queue["spec"]["resourceGroups"]:
            for entry in group["flavors"]:
                if entry["name"] == flavor:
                    entry["resources"][0]["nominalQuota"] = gpus
        self.kubectl("patch", "clusterqueue", name, "--type=merge", "-p", json.dumps(
            {"spec": {"resourceGroups": queue["spec"]["resourceGroups"]}}))

    def workload(self, job: str) -> dict[str, Any] | None:
        """The Workload Kueue made for Job `job` (None before it has)."""
        found = self.kubectl("get", "job", job, "-n", self.namespace, "-o", "json",
                             check=False)
        if found.returncode != 0:
            return None
        uid = json.loads(found.stdout)["metadata"]["uid"]
        listed = self.kubectl("get", "workloads.kueue.x-k8s.io", "-n", self.namespace, "-l",
                              f"{JOB_UID_LABEL}={uid}", "-o", "json")
        items = json.loads(listed.stdout)["items"]
        return items[0] if items else None

    def clean(self) -> None:
        """The ClusterQueues go (the namespace takes the LocalQueues and Workloads)."""
        if self.made:
            self.kubectl("delete", "clusterqueue", "--wait=false", "--ignore-not-found",
                         *self.made)

    def _apply(self, *objects: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    """`obj`'s condition of `type_` ({} when it has none)."""
    return next((c for c in (obj or {}).get("status", {}).get("conditions") or []
                 if c.get("type") == type_), {})
