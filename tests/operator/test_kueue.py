"""FineTuneJobs under the real Kueue (v0.17, built by `make cluster` from the module proxy and
run beside the control plane): queued, admitted onto a flavor's nodes, preempted, suspended
through the Workload's switch, restarted as a new Workload, borrowing in a cohort, and what
happens while the operator or Kueue itself is down. docs/kueue.md says the same in words."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support import kueue
from tests.support.cluster_fixtures import controlplane
from tests.support.cluster_testbed import RUN_TIME, ControlPlaneTestbed

kueue_manager = controlplane.kueue_manager  # cluster/kueue_manager.py, what make cluster runs

pytestmark = pytest.mark.asyncio

GPUS = "16 GPUs"
"""What the testbed's default job asks for: 2 nodes x 8 GPUs (the ndasrv4 pool)."""


@pytest.fixture
def queues(control_plane_testbed):
    bed: ControlPlaneTestbed = control_plane_testbed
    made = kueue.Queues(bed.installation.kubectl, bed.namespace)
    yield made
    made.clean()


@pytest.fixture
def high_priority(control_plane_testbed):
    """A PriorityClass above the default (0): its jobs preempt others in a ClusterQueue."""
    bed: ControlPlaneTestbed = control_plane_testbed
    name = f"{bed.namespace}-high"
    bed.installation.kubectl("create", "priorityclass", name, "--value=1000")
    yield name
    bed.installation.kubectl("delete", "priorityclass", name, "--ignore-not-found")


def queued(bed: ControlPlaneTestbed, name: str = "demo", queue: str = "team-a",
           **spec) -> dict:
    kubernetes = {"queueName": queue, "annotations": {RUN_TIME: "1h"},
                  **spec.pop("kubernetes", {})}
    return bed.manifest(name, kubernetes=kubernetes, **spec)


def unpullable(bed: ControlPlaneTestbed, name: str, startup_deadline: int) -> dict:
    """A queued 1-node job whose image never pulls (KWOK plays registry.invalid so)."""
    doc = bed.unpullable(bed.manifest(name, resources={"nodes": 1, "gpusPerNode": 8}))
    doc["spec"]["kubernetes"]["queueName"] = "team-a"
    doc["spec"]["runPolicy"]["startupDeadlineSeconds"] = startup_deadline
    return doc


def events(bed: ControlPlaneTestbed, reason: str, name: str = "demo") -> list[str]:
    """The messages of the FineTuneJob's events of `reason`."""
    listed = bed.installation.kubectl(
        "get", "events", "-n", bed.namespace, "-o", "json", "--field-selector",
        f"involvedObject.kind=FineTuneJob,involvedObject.name={name},reason={reason}")
    return [e.get("message", "") for e in json.loads(listed.stdout)["items"]]


async def test_queued_admitted_onto_the_flavor_then_preempted_and_admitted_again(
        control_plane_testbed, queues, high_priority):
    """Queued from the first look with Kueue's reason; admitted onto the flavor's nodes
    (Kueue writes the flavor's node label into the pods); preempted by a job of higher
    priority, saying why in Kueue's words (#49: the event quoted an older wait's message),
    and admitted again as the same Job, no restart counted."""
    bed: ControlPlaneTestbed = control_plane_testbed
    queues.make(ndasrv4=0)
    await bed.apply(queued(bed))
    await bed.until_phase("Queued")
    job = bed.get("batch/v1/jobs", "demo")
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"][kueue.QUEUE_LABEL] == "team-a"
    # Kueue's per-workload pods-ready timeout (v0.20), past the startup deadline: this
    # Kueue (v0.17) admits the Job carrying it as any other (below)
    assert json.loads(job["metadata"]["annotations"]["kueue.x-k8s.io/wait-for-pods-ready"]) == {
        "timeoutSeconds": 1860}
    await bed.until(lambda: "couldn't assign flavors" in bed.condition("Admitted")["message"],
                    "Kueue's reason in the Admitted condition")
    assert bed.condition("Admitted")["reason"] == "WaitingForQueue"
    assert "nvidia.com/gpu" in bed.status()["message"]
    assert not bed.running_pods("demo")  # held while suspended

    await asyncio.to_thread(queues.quota, "ndasrv4", 16)
    await bed.until_phase("Running")
    assert bed.condition("Admitted")["status"] == "True"
    assert {p["spec"]["nodeSelector"]["agentpool"] for p in bed.running_pods("demo")} == {
        "ndasrv4"}

    await bed.apply(queued(bed, "urgent", kubernetes={"priorityClassName": high_priority}))
    await bed.until(lambda: bed.condition("Admitted")["reason"] == "Preempted", "Preempted")
    assert bed.status()["phase"] == "Queued"
    assert bed.condition("Running")["status"] == "False"
    [said] = events(bed, "Preempted")
    assert "Preempted to accommodate a workload" in said, said  # Kueue's own words
    assert "couldn't assign flavors" not in said
    await bed.until_phase("Running", "urgent")
    await bed.until(lambda: not bed.running_pods("demo"), "the preempted pods stopped")

    await bed.delete("urgent")
    await bed.until_phase("Running")
    assert bed.status().get("restarts", 0) == 0
    assert bed.jobs_created("demo") == 1  # the same Job, admitted again


async def test_suspend_frees_the_quota_and_resume_queues_again(control_plane_testbed, queues):
    """runPolicy.suspend on an admitted job goes through Kueue's switch (the Workload's
    spec.active): Kueue evicts it and frees its quota (another job is admitted), and does
    not undo the suspension; resume puts it back in its queue. #49: it kept Admitted=True
    while suspended, and showed Kueue's words about the suspension after the resume."""
    bed: ControlPlaneTestbed = control_plane_testbed
    queues.make(ndasrv4=16)
    await bed.apply(queued(bed))
    await bed.until_phase("Running")
    await bed.apply(queued(bed, "other"))
    await bed.until(lambda: "couldn't assign flavors" in bed.condition(
        "Admitted", "other")["message"], "the other job waiting for the quota")

    await bed.patch_spec("demo", {"runPolicy": {"suspend": True}})
    await bed.until_phase("Suspended")
    assert bed.condition("Admitted")["status"] == "False"
    assert bed.condition("Admitted")["reason"] == "Suspended"
    await bed.until(lambda: queues.workload("demo")["spec"]["active"] is False,
                    "the Workload deactivated")
    await bed.until(lambda: not bed.running_pods("demo"), "the workers stopped")
    await bed.until_phase("Running", "other")  # the quota freed
    assert bed.get("batch/v1/jobs", "demo")["spec"]["suspend"] is True
    assert kueue.condition(queues.workload("demo"), "QuotaReserved")["status"] == "False"
    assert bed.status()["phase"] == "Suspended"

    await bed.patch_spec("demo", {"runPolicy": {"suspend": False}})
    await bed.until(lambda: queues.workload("demo")["spec"]["active"] is True,
                    "the Workload active again")
    await bed.until_phase("Queued")
    seen: list[str] = []
    for _ in range(20):  # the waiting job's words, a few seconds long: never the suspension's
        seen.append(bed.condition("Admitted")["message"])
        await asyncio.sleep(0.25)
    assert not [m for m in seen if "deactivated" in m], seen
    await bed.delete("other")
    await bed.until_phase("Running")
    assert bed.jobs_created("demo") == 1
    assert bed.status().get("restarts", 0) == 0


async def test_a_gang_restart_queues_again_and_says_so(control_plane_testbed, queues):
    """A worker failure of an admitted 2-node job restarts the gang as a new Job, which Kueue
    queues as a new Workload (docs/kueue.md): Restarting, then Queued with the reason while
    the quota is taken, then admitted and counted."""
    bed: ControlPlaneTestbed = control_plane_testbed
    queues.make(ndasrv4=16)
    await bed.apply(queued(bed))
    await bed.until_phase("Running")
    await asyncio.to_thread(queues.quota, "ndasrv4", 0)  # an admitted Workload keeps its own
    await bed.fail_worker("demo", 1, "CUDA error: an illegal memory access")
    await bed.until(lambda: bed.condition("Admitted")["reason"] == "RequeuedByRestart",
                    "queued again by the restart")
    assert bed.status()["phase"] == "Queued"
    assert any("as a new Job" in said for said in events(bed, "Queued"))
    await bed.until(lambda: bed.jobs_created("demo") == 2, "the second Job")
    await bed.until(lambda: "couldn't assign flavors" in bed.condition("Admitted")["message"],
                    "Kueue's reason for the new Workload")
    await asyncio.to_thread(queues.quota, "ndasrv4", 16)
    await bed.until_phase("Running")
    assert bed.status()["restarts"] == 1


async def test_queued_jobs_survive_an_operator_restart(control_plane_testbed, queues):
    """The operator is down while Kueue admits one of two queued jobs: back, it finds the
    admitted one running and the other still queued with Kueue's reason, and creates
    nothing twice."""
    bed: ControlPlaneTestbed = control_plane_testbed
    queues.make(ndasrv4=0)
    await bed.apply(queued(bed))
    await bed.apply(queued(bed, "second"))
    await bed.until_phase("Queued")
    await bed.until_phase("Queued", "second")
    await bed.kill_operator()
    await asyncio.to_thread(queues.quota, "ndasrv4", 16)  # room for one of them
    await bed.until(lambda: len([n for n in ("demo", "second") if bed.running_pods(n)]) == 1,
                    "one job admitted and running while the operator is down")
    await bed.start_operator()
    running, waiting = ("demo", "second") if bed.running_pods("demo") else ("second", "demo")
    await bed.until_phase("Running", running)
    await bed.until(lambda: "couldn't assign flavors" in bed.condition(
        "Admitted", waiting).get("message", ""), "the other still queued, with the reason")
    assert bed.status(waiting)["phase"] == "Queued"
    assert bed.jobs_created("demo") == 1 and bed.jobs_created("second") == 1


async def test_a_job_borrows_in_its_cohort_and_is_reclaimed(control_plane_testbed, queues):
    """Two ClusterQueues of 8 GPUs in one cohort: a 16-GPU job of the first borrows the
    second's idle quota; a job of the second takes its quota back, preempting the borrower,
    which queues again (Preempted) and runs once the quota is back."""
    bed: ControlPlaneTestbed = control_plane_testbed
    queues.make("team-a", cohort="research", reclaim=True, ndasrv4=8)
    queues.make("team-b", cohort="research", reclaim=True, ndasrv4=8)
    await bed.apply(queued(bed))  # 2 nodes x 8 GPUs: 8 of its own, 8 borrowed
    await bed.until_phase("Running")
    await bed.apply(queued(bed, "owner", "team-b", resources={"nodes": 1, "gpusPerNode": 8}))
    await bed.until(lambda: bed.condition("Admitted")["reason"] == "Preempted",
                    "the borrower preempted")
    [said] = events(bed, "Preempted")
    assert "Preempted to accommodate a workload" in said, said
    await bed.until_phase("Running", "owner")
    await bed.until(lambda: not bed.running_pods("demo"), "the borrower's pods stopped")
    await bed.delete("owner")
    await bed.until_phase("Running")
    assert bed.jobs_created("demo") == 1 and bed.status().get("restarts", 0) == 0


async def test_kueue_restarted_mid_admission(control_plane_testbed, queues):
    """Kueue goes down with a job queued: while its webhooks do not answer, a new job's Job
    cannot be created (nor a ClusterQueue edited), and the job says so, Pending (#49: no
    phase at all); Kueue back, the new job launches into its queue and the queued one is
    admitted once quota is given, each Job created once."""
    bed: ControlPlaneTestbed = control_plane_testbed
    plane = bed.installation.plane
    queues.make(ndasrv4=0)
    await bed.apply(queued(bed))
    await bed.until_phase("Queued")
    await asyncio.to_thread(plane.stop_one, "kueue")
    try:
        await bed.apply(queued(bed, "late", resources={"nodes": 1, "gpusPerNode": 4},
                               kubernetes={"nodeSelector": {"agentpool": "a100"}}))
        await bed.until(lambda: "failed calling webhook" in bed.status("late").get(
            "message", ""), "the refusal in the status")
        late = bed.status("late")
        assert late["phase"] == "Pending"
        assert "kubectl -n kueue-system get pods" in late["message"]
        assert bed.get("batch/v1/jobs", "late") is None
        assert bed.status()["phase"] == "Queued"
    finally:
        await asyncio.to_thread(kueue_manager.run, plane)
    await bed.until_phase("Queued", "late")  # created now; no a100 quota here
    await asyncio.to_thread(queues.quota, "ndasrv4", 16)
    await bed.until_phase("Running")
    assert bed.jobs_created("demo") == 1 and bed.jobs_created("late") == 1


async def test_a_job_queued_before_kueue_is_installed_asks_for_it_then_runs(
        control_plane_testbed, queues):
    """A cluster without Kueue (its manager stopped, its webhooks gone): the Job is made
    suspended with the queue label and no Workload comes; after 30 s the job asks whether
    Kueue is installed. Kueue installed, it makes the Workload and admits the job."""
    bed: ControlPlaneTestbed = control_plane_testbed
    plane = bed.installation.plane
    queues.make(ndasrv4=16)
    await asyncio.to_thread(plane.stop_one, "kueue")
    try:
        await asyncio.to_thread(kueue_manager.uninstall_webhooks, plane)
        await bed.apply(queued(bed))
        await bed.until(lambda: "is Kueue installed" in bed.condition("Admitted")["message"],
                        "the question in the Admitted condition")
        assert bed.status()["phase"] == "Queued"
        assert bed.get("batch/v1/jobs", "demo")["spec"]["suspend"] is True
    finally:
        await asyncio.to_thread(kueue_manager.install, plane, plane.ports["kueue-webhook"])
        await asyncio.to_thread(kueue_manager.run, plane)
    await bed.until_phase("Running")
    assert bed.jobs_created("demo") == 1


async def test_the_startup_deadline_and_kueues_pods_ready_timeout_whichever_is_shorter(
        control_plane_testbed, queues):
    """With Kueue's waitForPodsReady on (docs/kueue.md), of two jobs whose image never
    pulls: the one whose startupDeadlineSeconds is shorter fails with the pods' reason and
    frees its quota; the one whose deadline is longer is evicted by Kueue and queues again,
    not failed and nothing counted."""
    bed: ControlPlaneTestbed = control_plane_testbed
    plane = bed.installation.plane
    await asyncio.to_thread(kueue_manager.restart, plane, pods_ready_timeout="20s")
    try:
        queues.make(ndasrv4=16)
        await bed.apply(unpullable(bed, "short", startup_deadline=4))
        await bed.apply(unpullable(bed, "long", startup_deadline=600))
        await bed.until(lambda: bed.condition("Admitted", "long").get("status") == "True",
                        "both admitted")
        await bed.until_phase("Failed", "short")
        assert bed.condition("Failed", "short")["reason"] == "StartupDeadlineExceeded"
        assert "ErrImagePull" in bed.status("short")["message"] or (
            "ImagePullBackOff" in bed.status("short")["message"])
        await bed.until(lambda: bed.get("batch/v1/jobs", "short") is None,
                        "its Job removed: its quota freed")
        await bed.until(lambda: bed.condition("Admitted", "long").get("reason") == "Preempted",
                        "the long one evicted by Kueue")
        [said] = events(bed, "Preempted", "long")
        assert "PodsReady" in said, said  # Kueue's reason
        assert bed.status("long")["phase"] == "Queued"
        assert bed.status("long").get("restarts", 0) == 0
    finally:
        await asyncio.to_thread(kueue_manager.restart, plane)
