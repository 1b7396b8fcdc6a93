"""The pure parts of the event-driven operator (#23): what the watches' store answers while
the watches lag the operator's own writes, and when a job must be looked at with no change
reported (only the clock can fire a deadline)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from finetune_operator import naming
from finetune_operator.api import FineTuneJobStatus, Progress, RunPolicy
from finetune_operator.backends.children import Children, slim
from finetune_operator.reconcile import next_deadline

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def child(kind: str, name: str, uid: str, job: str = "demo",
          metadata_extra: dict | None = None, **extra) -> dict:
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns", "uid": uid,
                                       "labels": {naming.LABEL_JOB: job},
                                       **(metadata_extra or {})}, **extra}


def store(children: Children, *objects: dict) -> None:
    """What kopf's indexes hold: per (namespace, job), the slim objects."""
    for kind in ("Job", "Pod", "Service", "ConfigMap"):
        index: dict = {}
        for obj in objects:
            if obj["kind"] == kind:
                index.setdefault(("ns", obj["metadata"]["labels"][naming.LABEL_JOB]),
                                 []).append(slim(kind, obj))
        children.indexes[kind] = index


def test_a_created_child_exists_until_the_watch_shows_it():
    clock = FakeClock()
    children = Children(clock)
    store(children)
    assert children.ready
    children.created(child("Job", "demo", uid=""))
    assert children.get("Job", "ns", "demo", "demo") is not None  # not created twice
    assert children.get("Job", "ns", "other", "other") is None
    store(children, child("Job", "demo", uid="u1"))
    assert children.get("Job", "ns", "demo", "demo")["metadata"]["uid"] == "u1"
    store(children)  # deleted by hand afterwards: gone, the expectation is spent
    assert children.get("Job", "ns", "demo", "demo") is None


def test_an_expectation_never_confirmed_lapses():
    clock = FakeClock()
    children = Children(clock)
    store(children)
    children.created(child("Service", "demo", uid=""))
    clock.now += 61
    assert children.get("Service", "ns", "demo", "demo") is None


def test_a_job_being_deleted_reads_as_deleting_until_the_watch_says_so():
    clock = FakeClock()
    children = Children(clock)
    failed = child("Job", "demo", uid="u1", status={"conditions": [
        {"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}]})
    store(children, failed)
    children.deleted("Job", "ns", "demo", "demo")
    # the watch still shows the failed Job: a look now must not count the failure again
    assert children.get("Job", "ns", "demo", "demo")["metadata"]["deletionTimestamp"]
    store(children)  # gone
    assert children.get("Job", "ns", "demo", "demo") is None
    store(children, child("Job", "demo", uid="u2"))  # the next gang is not "deleting"
    assert "deletionTimestamp" not in children.get("Job", "ns", "demo", "demo")["metadata"]


def test_children_of_a_deleted_job_of_the_same_name_are_not_taken_for_its_own():
    children = Children(FakeClock())
    owned = {"ownerReferences": [{"uid": "old", "controller": True, "kind": "FineTuneJob"}]}
    store(children, child("Job", "demo", uid="j1", metadata_extra=owned),
          child("ConfigMap", "demo-trainer", uid="c1", metadata_extra=owned))
    assert children.foreign("ns", "demo", "new") == ["Job demo", "ConfigMap demo-trainer"]
    assert children.foreign("ns", "demo", "old") == []  # its own
    store(children)  # the garbage collector took them
    assert children.foreign("ns", "demo", "new") == []


def test_children_orphaned_by_a_deleted_job_are_named_with_the_command_that_removes_them():
    """`kubectl delete --cascade=orphan` (Argo CD's PrunePropagationPolicy=orphan) strips
    the owner: adopted, they ran the old config, and were orphaned again when this job was
    deleted; nothing else ever removes them."""
    from finetune_operator.backends.kubernetes.states import waiting_for_leftovers
    from finetune_operator.validation import parse_job
    from tests.conftest import minimal_job

    children = Children(FakeClock())
    store(children, child("Job", "demo", uid="j1"), child("ConfigMap", "demo-trainer", uid="c1"))
    left = children.foreign("ns", "demo", "new")
    assert left == ["Job demo (no owner)", "ConfigMap demo-trainer (no owner)"]
    seen = waiting_for_leftovers(parse_job(minimal_job()), left)
    assert seen.deleting and "deleted with --cascade=orphan, so nothing removes them" in (
        seen.waiting)
    assert "kubectl delete -n default job/demo configmap/demo-trainer" in seen.waiting


def test_slim_keeps_what_observe_reads_and_drops_the_rest():
    pod = {"metadata": {"name": "demo-0-abc", "namespace": "ns", "uid": "p",
                        "labels": {naming.LABEL_JOB: "demo", "other": "x"},
                        "annotations": {"batch.kubernetes.io/job-completion-index": "0",
                                        "big": "x" * 1000},
                        "managedFields": [{"manager": "kubelet"}] * 20},
           "spec": {"nodeName": "n1", "containers": [{"name": "trainer"}] * 5},
           "status": {"phase": "Failed", "podIP": "10.0.0.1", "containerStatuses": [
               {"name": "trainer", "state": {"terminated": {"exitCode": 1}}, "image": "i"}]}}
    kept = slim("Pod", pod)
    assert kept["metadata"]["labels"] == {naming.LABEL_JOB: "demo"}
    assert kept["metadata"]["annotations"] == {"batch.kubernetes.io/job-completion-index": "0"}
    assert "managedFields" not in kept["metadata"] and "containers" not in kept["spec"]
    assert kept["status"]["containerStatuses"] == [
        {"name": "trainer", "state": {"terminated": {"exitCode": 1}}}]


def test_an_idle_job_without_deadlines_is_not_looked_at_on_a_timer():
    policy = RunPolicy(startupDeadlineSeconds=0, stallTimeoutSeconds=0)
    assert next_deadline(policy, FineTuneJobStatus(phase="Launching", launch_time=NOW),
                         NOW) is None
    assert next_deadline(policy, FineTuneJobStatus(phase="Queued"), NOW) is None
    assert next_deadline(RunPolicy(), FineTuneJobStatus(phase="Succeeded"), NOW) is None


def test_each_clock_rule_is_timed_to_when_it_falls_due():
    started = NOW - timedelta(seconds=100)
    launching = FineTuneJobStatus(phase="Launching", launch_time=started, start_time=started)
    assert next_deadline(RunPolicy(startupDeadlineSeconds=130), launching, NOW) == 30
    assert next_deadline(RunPolicy(startupDeadlineSeconds=1800, activeDeadlineSeconds=110),
                         launching, NOW) == 10
    running = FineTuneJobStatus(phase="Running", launch_time=started, start_time=started,
                                progress=Progress(step=5, last_step_time=NOW
                                                  - timedelta(seconds=20)))
    assert next_deadline(RunPolicy(stallTimeoutSeconds=60), running, NOW) == 40
    finished = FineTuneJobStatus(phase="Failed", completion_time=started)
    assert next_deadline(RunPolicy(ttlSecondsAfterFinished=300), finished, NOW) == 200
    assert next_deadline(RunPolicy(startupDeadlineSeconds=10), launching, NOW) == 0
