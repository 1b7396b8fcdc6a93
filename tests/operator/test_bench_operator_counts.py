"""How `make bench-operator` counts the API requests that launch a job, from the API server's
audit log (Metadata level: who, which verb, which object, when; no bodies)."""

from __future__ import annotations

from tests.support.bench_scripts import bench_script


def audit(t: float, verb: str, resource: str, name: str = "", subresource: str = "") -> dict:
    ref = {"resource": resource, "name": name}
    if subresource:
        ref["subresource"] = subresource
    return {"verb": verb, "objectRef": ref, "stageTimestamp": f"2026-11-24T12:00:{t:06.3f}Z"}


def paced_job(name: str, start: float) -> list[dict]:
    """A job that waited for its turn: acknowledged, launched, its event posted, and later
    told how its pods fare."""
    return [audit(start, "patch", "finetunejobs", name, "status"),  # Pending: its turn
            audit(start + 2, "create", "configmaps", f"{name}-trainer"),
            audit(start + 2, "create", "services", name),
            audit(start + 3, "create", "jobs", name),
            audit(start + 4, "patch", "finetunejobs", name, "status"),  # Launching
            audit(start + 4, "create", "events"),
            audit(start + 9, "patch", "finetunejobs", name, "status")]  # pods Unschedulable


def test_a_launch_counts_what_led_to_it_and_its_own_status_patch_not_what_follows():
    bench = bench_script("operator_load")
    events = paced_job("a", 1) + paced_job("b", 20)
    assert bench.launch_requests(events, jobs=2) == 6.0  # 1 + 3 + 1 + the event
    assert bench.by_kind(events, 2)["patch finetunejobs/status"] == 3.0  # all of them


def test_an_operator_that_launches_nothing_has_no_launch_count():
    bench = bench_script("operator_load")
    events = [audit(1, "patch", "finetunejobs", "a"),
              audit(1, "patch", "finetunejobs", "a", "status")]
    assert bench.launch_requests(events, jobs=1) is None


def test_kopfs_own_patches_of_a_launched_job_count():
    bench = bench_script("operator_load")  # the launcher: kopf's annotations, then its phase
    events = [audit(1, "create", "configmaps", "a-trainer"), audit(1, "create", "services", "a"),
              audit(2, "create", "jobs", "a"), audit(3, "patch", "finetunejobs", "a"),
              audit(3, "patch", "finetunejobs", "a", "status")]
    assert bench.launch_requests(events, jobs=1) == 5.0
