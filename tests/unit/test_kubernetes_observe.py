"""Reading a Job and its pods the way the reconciler needs: failures classified for the
restart budget, waiting reasons in the pod's own words."""

from __future__ import annotations

from finetune_operator.api import Progress
from finetune_operator.backends.kubernetes import observe, pod_failure, pod_waiting


def job_object(*conditions: str, suspend: bool = False, deleting: bool = False) -> dict:
    meta = {"name": "demo"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-21T12:00:00Z"
    listed = [{"type": c, "status": "True", "reason": "BackoffLimitExceeded",
               "message": "Job has reached the specified backoff limit"} for c in conditions]
    return {"metadata": meta, "spec": {"suspend": suspend}, "status": {"conditions": listed}}


def pod(name: str, phase: str, **status) -> dict:
    return {"metadata": {"name": name}, "status": {"phase": phase, **status}}


def terminated(code: int, reason: str = "Error", message: str = "") -> dict:
    return {"containerStatuses": [{"name": "trainer", "state": {"terminated": {
        "exitCode": code, "reason": reason, "message": message}}}]}


def test_no_workload():
    assert observe(None, [], nodes=2).exists is False


def test_a_worker_error_counts_and_carries_the_last_log_line():
    failed = pod("demo-1-x", "Failed", **terminated(
        1, message="Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory"))
    seen = observe(job_object(), [pod("demo-0-y", "Running"), failed], nodes=2)
    assert seen.failure.kind == "worker"
    assert seen.failure.message == ("demo-1-x exited 1 (Error): torch.OutOfMemoryError: CUDA "
                                    "out of memory")


def test_preemption_and_eviction_do_not_count():
    preempted = pod("demo-0-a", "Failed", conditions=[{
        "type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
        "message": "preempted by high-priority job"}])
    assert pod_failure(preempted).kind == "preempted"
    assert "PreemptionByScheduler" in pod_failure(preempted).message
    evicted = pod("demo-0-b", "Failed", reason="Evicted", message="The node was low on memory")
    assert pod_failure(evicted).kind == "preempted"


def test_sigterm_exit_is_a_stop_not_a_failure():
    assert pod_failure(pod("demo-0-c", "Failed", **terminated(143))).kind == "stopped"


def test_a_worker_failure_outranks_a_preemption_seen_with_it():
    pods = [pod("demo-0-a", "Failed", reason="Evicted"),
            pod("demo-1-b", "Failed", **terminated(1))]
    assert observe(job_object("Failed"), pods, nodes=2).failure.kind == "worker"


def test_success_suspension_and_deletion():
    progress = Progress(step=100, total_steps=100)
    done = observe(job_object("Complete"), [pod("demo-0-a", "Succeeded")], 1, progress)
    assert done.succeeded and done.progress == progress
    assert observe(job_object(suspend=True), [], nodes=1).suspended
    assert observe(job_object(deleting=True), [], nodes=1).deleting


def test_running_needs_every_node():
    pods = [pod("demo-0-a", "Running"), pod("demo-1-b", "Pending")]
    assert observe(job_object(), pods, nodes=2).running is False
    assert observe(job_object(), [pod("demo-0-a", "Running")] * 2, nodes=2).running is True


def test_waiting_reasons_in_the_pods_words():
    unschedulable = pod("demo-0-a", "Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}])
    assert pod_waiting(unschedulable) == (
        "demo-0-a: Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    pulling = pod("demo-1-b", "Pending", containerStatuses=[{"state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image 'trainer:typo'"}}}])
    seen = observe(job_object(), [pulling], nodes=2)
    assert seen.waiting.startswith("demo-1-b: ImagePullBackOff: Back-off pulling image")
    creating = pod("demo-1-c", "Pending", containerStatuses=[{"state": {"waiting": {
        "reason": "ContainerCreating"}}}])
    assert pod_waiting(creating) is None
