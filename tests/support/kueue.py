"""A STAND-IN for Kueue's batch/job integration, used only because Kueue cannot be built here
(the Go module proxy refuses sigs.k8s.io/kueue). It does what Kueue documents, and what a run
of the real Kueue v0.19 showed, for the parts the operator meets, and nothing more:

- it keeps one Workload (a stand-in CRD, kueue-workload-crd.yaml) per Job labelled
  `kueue.x-k8s.io/queue-name`, labelled with the Job's uid and owned by the Job;
- a Job is held while `spec.suspend` is true (the operator creates it so; Kueue's webhook
  would otherwise suspend it) and its Workload waits: `QuotaReserved=False` with the
  scheduler's message (`pend` sets one, e.g. "couldn't assign flavors ...");
- admission (`admit`) writes the ResourceFlavor's node labels into the pod template's
  `nodeSelector` (allowed while the Job is suspended), marks the Workload `QuotaReserved` and
  `Admitted`, then sets `spec.suspend: false`; the Job controller creates the pods;
- an admitted Job that anyone suspends is unsuspended again (Kueue owns the switch);
- eviction — by preemption (`preempt`) or because the Workload's `spec.active` became false —
  clears the admission (the quota is free), sets `Evicted`, suspends the Job and, once the
  Job controller has stopped it, puts back the template's original node selector. A
  deactivated Workload stays out of the queue until `spec.active` is true again.

Quota itself is the test's to decide: it calls `admit` when the real Kueue would. No test
here runs the real Kueue (`make kind-e2e` does not install it yet).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
WORKLOAD_CRD = Path(__file__).with_name("kueue-workload-crd.yaml")
SYNC_SECONDS = 0.2


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions") or []
                 if c["type"] == type_), None)


def _is_true(obj: dict[str, Any], type_: str) -> bool:
    return (_condition(obj, type_) or {}).get("status") == "True"


def _conditions(**by_type: tuple[str, str, str]) -> list[dict[str, Any]]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return [{"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": now}
            for t, (s, r, m) in by_type.items()]


class KueueStandIn:
    """Kueue's controller for one namespace, in a thread, while the `with` block runs."""

    def __init__(self, kubectl: Any, namespace: str) -> None:
        self.kubectl, self.namespace = kubectl, namespace
        self._original_selectors: dict[str, dict[str, str]] = {}
        self._restore: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kueue-stand-in", daemon=True)
        self.errors: list[str] = []

    def __enter__(self) -> KueueStandIn:
        self.kubectl("apply", "-f", str(WORKLOAD_CRD))
        self.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                     "crd/workloads.kueue.x-k8s.io")
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # --- what the test decides (Kueue's scheduler) -----------------------------------------
    def workload(self, job: str) -> dict[str, Any] | None:
        uid = self._get("job", job)["metadata"]["uid"]
        return self._workloads().get(uid)

    def pend(self, job: str, message: str) -> None:
        """The scheduler tried and could not place the Workload, and says why."""
        self._set_status(self._wait_for_workload(job), {"conditions": _conditions(
            QuotaReserved=("False", "Pending", message),
            Admitted=("False", "NoReservation", "The workload has no reservation"))})

    def admit(self, job: str, flavor_node_labels: dict[str, str]) -> None:
        workload = self._wait_for_workload(job)  # the controller thread makes it
        with self._lock:
            if job in self._restore:  # evicted: the template may change once it has stopped
                self._until(lambda: self._stopped(self._get("job", job)), f"{job} stopped")
                self._restore.discard(job)
            template = self._get("job", job)["spec"]["template"]["spec"]
            self._original_selectors.setdefault(job, template.get("nodeSelector") or {})
            self._patch("job", job, {"spec": {"template": {"spec": {
                "nodeSelector": {**self._original_selectors[job], **flavor_node_labels}}}}})
            self._set_status(workload, {"conditions": _conditions(
                QuotaReserved=("True", "QuotaReserved", "Quota reserved in ClusterQueue gpus"),
                Admitted=("True", "Admitted", "The workload is admitted"))})
            self._patch("job", job, {"spec": {"suspend": False}})

    def preempt(self, job: str) -> None:
        workload = self._wait_for_workload(job)
        with self._lock:
            self._evict(job, workload, "Preempted",
                        "Preempted to accommodate a workload of higher priority")

    # --- what Kueue's controller does by itself ---------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    self._sync()
            except Exception as error:  # reported by the test (stand_in.errors), not swallowed
                self.errors.append(repr(error))
            self._stop.wait(SYNC_SECONDS)

    def _sync(self) -> None:
        workloads = self._workloads()
        for job in self._queued_jobs():
            name, uid = job["metadata"]["name"], job["metadata"]["uid"]
            workload = workloads.get(uid) or self._create_workload(job)
            admitted = _is_true(workload, "Admitted")
            if admitted and workload["spec"].get("active") is False:
                self._evict(name, workload, "Deactivated", "The workload is deactivated")
            elif admitted and job["spec"].get("suspend"):
                self._patch("job", name, {"spec": {"suspend": False}})
            elif not admitted and workload["spec"].get("active") is not False and (
                    _condition(workload, "Evicted") or {}).get("reason") == "Deactivated":
                self._set_status(workload, {"conditions": _conditions(  # back in its queue
                    QuotaReserved=("False", "Pending", ""),
                    Admitted=("False", "NoReservation", "The workload has no reservation"))})
            elif name in self._restore and self._stopped(job):
                self._patch("job", name, {"spec": {"template": {"spec": {
                    "nodeSelector": self._original_selectors.get(name) or None}}}})
                self._restore.discard(name)

    def _evict(self, job: str, workload: dict[str, Any], reason: str, message: str) -> None:
        self._set_status(workload, {"conditions": _conditions(
            Evicted=("True", reason, message),
            QuotaReserved=("False", reason, message),
            Admitted=("False", "NoReservation", "The workload has no reservation"))})
        self._patch("job", job, {"spec": {"suspend": True}})
        self._restore.add(job)

    @staticmethod
    def _stopped(job: dict[str, Any]) -> bool:
        # the API server lets the template's scheduling fields change only on a suspended
        # Job without a start time: the Job controller clears it once the pods are stopped
        status = job.get("status", {})
        return bool(job["spec"].get("suspend")) and not status.get("startTime") \
            and not status.get("active")

    # --- API calls ---------------------------------------------------------------------------
    def _queued_jobs(self) -> list[dict[str, Any]]:
        listed = self.kubectl("get", "jobs", "-n", self.namespace, "-l", QUEUE_LABEL,
                              "-o", "json")
        return [j for j in json.loads(listed.stdout)["items"]
                if not j["metadata"].get("deletionTimestamp")]

    def _workloads(self) -> dict[str, dict[str, Any]]:
        listed = self.kubectl("get", "workloads.kueue.x-k8s.io", "-n", self.namespace,
                              "-o", "json")
        return {w["metadata"]["labels"][JOB_UID_LABEL]: w
                for w in json.loads(listed.stdout)["items"]}

    def _create_workload(self, job: dict[str, Any]) -> dict[str, Any]:
        meta = job["metadata"]
        workload = {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": f"job-{meta['name']}-{meta['uid'][:5]}",
                         "namespace": self.namespace,
                         "labels": {JOB_UID_LABEL: meta["uid"]},
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                              "name": meta["name"], "uid": meta["uid"],
                                              "controller": True}]},
            "spec": {"active": True, "queueName": meta["labels"][QUEUE_LABEL]}}
        created = self.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(workload))
        return json.loads(created.stdout)

    def _wait_for_workload(self, job: str) -> dict[str, Any]:
        return self._until(lambda: self.workload(job), f"a Workload for Job {job}")

    @staticmethod
    def _until(check: Any, what: str, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while not (found := check()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout} s")
            time.sleep(SYNC_SECONDS)
        return found

    def _get(self, kind: str, name: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", kind, name, "-n", self.namespace,
                                       "-o", "json").stdout)

    def _patch(self, kind: str, name: str, patch: dict[str, Any]) -> None:
        self.kubectl("patch", kind, name, "-n", self.namespace, "--type=merge",
                     "-p", json.dumps(patch))

    def _set_status(self, workload: dict[str, Any], status: dict[str, Any]) -> None:
        self.kubectl("patch", "workloads.kueue.x-k8s.io", workload["metadata"]["name"],
                     "-n", self.namespace, "--subresource=status", "--type=merge",
                     "-p", json.dumps({"status": status}))
