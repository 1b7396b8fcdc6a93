"""The operator's decisions as a table of situations: no kopf, no cluster, no clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from finetune_operator.api import FineTuneJobStatus, LaunchPlan, Progress
from finetune_operator.reconcile import (
    Failure,
    Feasibility,
    Observation,
    as_launched,
    condition,
    reconcile,
    set_condition,
    spec_fingerprint,
)
from finetune_operator.validation import parse_job
from tests.conftest import minimal_job

T0 = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


def job(status: FineTuneJobStatus | None = None, generation: int = 1, **spec):
    doc = minimal_job(**spec)
    doc["metadata"]["generation"] = generation
    parsed = parse_job(doc)
    parsed.status = status
    return parsed


def launched(phase="Launching", restarts=0, **spec) -> FineTuneJobStatus:
    """The status of a job whose workers were created at T0."""
    return FineTuneJobStatus(phase=phase, restarts=restarts, launch_time=T0, start_time=T0,
                             launched_spec=spec_fingerprint(job(**spec)))


def kinds(decision) -> list[str]:
    return [a.kind for a in decision.actions]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_new_job_is_validated_and_launched():
    d = reconcile(job(), Observation(), T0)
    assert kinds(d) == ["launch"]
    assert d.status.phase == "Launching" and d.status.start_time == T0
    assert condition(d.status, "Validated").status == "True"
    assert d.status.launched_spec == spec_fingerprint(job())
    assert d.status.observed_generation == 1
    assert [e.reason for e in d.events] == ["Launching"]


def test_an_invalid_job_fails_without_creating_anything():
    d = reconcile(job(), Observation(), T0, problems=["spec.backend: 'slurm' is not installed"])
    assert kinds(d) == [] and d.status.phase == "Failed"
    assert condition(d.status, "Validated").reason == "InvalidSpec"
    assert "slurm" in d.status.message


def test_waiting_workers_are_reported_until_the_startup_deadline():
    seen = Observation(exists=True, waiting="demo-0-x7k2p: ImagePullBackOff: pull access denied")
    d = reconcile(job(launched()), seen, at(60))
    assert kinds(d) == [] and d.status.phase == "Launching"
    assert "ImagePullBackOff" in d.status.message
    assert d.requeue_after is not None

    late = reconcile(job(launched()), seen, at(1801))
    assert late.status.phase == "Failed" and kinds(late) == ["delete-workload"]
    assert condition(late.status, "Failed").reason == "StartupDeadlineExceeded"
    assert "demo-0-x7k2p: ImagePullBackOff" in late.status.message


def test_workers_that_ran_since_the_launch_are_past_the_startup_deadline():
    """One node's worker ended before the other's, or all ended before the Job controller
    says so: not running now, yet started long ago (#49)."""
    ending = Observation(exists=True, running=False)
    d = reconcile(job(launched(phase="Running")), ending, at(3600))
    assert d.status.phase == "Running" and kinds(d) == []
    assert condition(d.status, "Failed") is None
    assert d.requeue_after is not None


def test_workers_that_cannot_start_are_a_warning_event_once_per_cause():
    """What blocks the workers (an image, a Secret, no node that fits) is a Warning event,
    once per cause: the kubelet's retries and the scheduler's changing counts reword it, and
    `kubectl get events` must not fill up; a wait that ends by itself (a model's download)
    is said in the status only."""
    def look(status, waiting, blocked, seconds):
        return reconcile(job(status), Observation(exists=True, waiting=waiting,
                                                  blocked=blocked), at(seconds))

    fetching = look(launched(), "demo-0-a: fetching the model", None, 10)
    assert fetching.events == []
    assert condition(fetching.status, "Running").reason == "WorkersWaiting"
    pull = "demo-0-a: ErrImagePull: not found (init container resume-check)"
    first = look(fetching.status, pull, "ErrImagePull", 20)
    assert [(e.type, e.reason, e.message) for e in first.events] == [
        ("Warning", "ErrImagePull", f"workers cannot start: {pull}")]
    assert condition(first.status, "Running").reason == "ErrImagePull"
    retried = look(first.status, "demo-0-a: ImagePullBackOff: Back-off", "ErrImagePull", 40)
    assert retried.events == [] and "Back-off" in retried.status.message
    secret = look(retried.status, "demo-0-a: CreateContainerConfigError: secret",
                  "CreateContainerConfigError", 60)
    assert [e.reason for e in secret.events] == ["CreateContainerConfigError"]


def test_a_plan_warning_is_a_warning_event_at_the_first_launch_only():
    """A maxSeqLength beyond the model's context does not stop the job: the operator says
    so once, in an event, where `kubectl describe` shows it."""
    said = "spec.dataset.maxSeqLength: 4096 is longer than the model's context"
    verdict = Feasibility(fits=True, message="fits", warnings=(said,))
    first = reconcile(job(), Observation(), T0, feasibility=verdict)
    assert kinds(first) == ["launch"]
    assert [(e.type, e.reason, e.message) for e in first.events if e.type == "Warning"] == [
        ("Warning", "PlanWarning", said)]
    again = reconcile(job(first.status), Observation(exists=True), at(5), feasibility=verdict)
    assert [e for e in again.events if e.reason == "PlanWarning"] == []


def test_running_workers_and_progress_reach_the_status():
    progress = Progress(step=10, total_steps=100, loss=1.5, tokens_per_second=1e4,
                        eta_seconds=900)
    d = reconcile(job(launched()), Observation(exists=True, running=True, progress=progress),
                  at(30))
    assert d.status.phase == "Running" and condition(d.status, "Running").status == "True"
    assert d.status.progress.step == 10 and d.status.progress.last_step_time == at(30)
    # the figures `kubectl get ftj` shows, to 4 significant digits (every digit, unrounded)
    precise = Progress(step=11, loss=6.144528664547088, eval_loss=0.012345678,
                       tokens_per_second=123456.7, mfu=0.4321987)
    shown = reconcile(job(d.status), Observation(exists=True, running=True, progress=precise),
                      at(40)).status.progress
    assert (shown.loss, shown.eval_loss, shown.tokens_per_second, shown.mfu) == (
        6.145, 0.01235, 123500.0, 0.4321987)
    # the same step seen later keeps the time it was first seen
    again = reconcile(job(d.status), Observation(exists=True, running=True, progress=progress),
                      at(90))
    assert again.status.progress.last_step_time == at(30)
    assert [e.reason for e in again.events] == []  # no transition, no event


def test_a_stalled_gang_is_marked_and_restarted():
    status = launched("Running")
    status.progress = Progress(step=10, last_step_time=at(100))
    seen = Observation(exists=True, running=True, progress=Progress(step=10))
    d = reconcile(job(status, runPolicy={"stallTimeoutSeconds": 600}), seen, at(701))
    assert condition(d.status, "Stalled").status == "True"
    assert kinds(d) == ["delete-workload"] and d.status.restarts == 1
    assert d.status.phase == "Restarting"


def test_a_push_to_output_export_longer_than_the_stall_timeout_is_no_stall():
    """After the last step rank 0 pushes the model (a 16 GB push can take longer than
    stallTimeoutSeconds): the trainer says Exporting, the status message says where to (what
    `finetune status` shows), and the stall check waits."""
    spec = {"runPolicy": {"stallTimeoutSeconds": 600}, "output": {
        "uri": "pvc://data/out", "export": [{"uri": "hf://team/demo"}]}}
    status = launched("Running", **spec)
    status.progress = Progress(step=10, last_step_time=at(100))
    seen = Observation(exists=True, running=True, progress=Progress(step=10, exporting=True))
    d = reconcile(job(status, **spec), seen, at(5000))
    assert condition(d.status, "Stalled") is None and kinds(d) == []
    assert d.status.phase == "Running" and d.requeue_after == 30.0
    assert d.status.message == "steps done; pushing the model to hf://team/demo"
    assert not d.events  # the same phase: no event


def test_a_worker_failure_restarts_the_gang_once_and_counts():
    seen = Observation(exists=True, failure=Failure("worker", "demo-1-abcde exited 1 (OOMKilled)"))
    d = reconcile(job(launched("Running")), seen, at(50))
    assert kinds(d) == ["delete-workload"] and d.status.restarts == 1
    assert d.status.phase == "Restarting" and "OOMKilled" in d.status.message
    assert d.events[-1].type == "Warning"
    # the deletion has not shown yet: ask again, do not count again
    again = reconcile(job(d.status), seen, at(52))
    assert kinds(again) == ["delete-workload"] and again.status.restarts == 1
    # gone: the next attempt is launched
    relaunch = reconcile(job(again.status), Observation(), at(60))
    assert kinds(relaunch) == ["launch"] and relaunch.status.phase == "Launching"
    assert relaunch.status.launch_time == at(60) and relaunch.status.start_time == T0


def test_preemption_restarts_without_using_the_budget():
    seen = Observation(exists=True, failure=Failure("preempted", "node aks-spot-1 was reclaimed"))
    d = reconcile(job(launched("Running", restarts=2)), seen, at(50))
    assert kinds(d) == ["delete-workload"] and d.status.restarts == 2
    assert "not counted" in d.status.message


def test_an_exhausted_budget_fails_the_job_with_the_cause():
    seen = Observation(exists=True, failure=Failure("worker", "demo-0-aaaaa exited 1"))
    d = reconcile(job(launched("Running", restarts=3)), seen, at(50))
    assert d.status.phase == "Failed" and kinds(d) == ["delete-workload"]
    assert condition(d.status, "Failed").reason == "BackoffLimitExceeded"
    assert "demo-0-aaaaa exited 1" in d.status.message


def test_success_and_ttl():
    d = reconcile(job(launched("Running")), Observation(exists=True, succeeded=True), at(500))
    assert d.status.phase == "Succeeded" and d.status.completion_time == at(500)
    assert condition(d.status, "Complete").status == "True"
    finished = d.status
    ttl = {"runPolicy": {"ttlSecondsAfterFinished": 3600}}
    assert kinds(reconcile(job(finished, **ttl), Observation(), at(600))) == []
    assert kinds(reconcile(job(finished, **ttl), Observation(), at(4101))) == ["delete-job"]
    assert kinds(reconcile(job(finished), Observation(), at(99999))) == []  # no ttl: kept


def test_every_push_taken_is_said_once_with_its_digest():
    pushed = "myreg.azurecr.io/adapters/demo:v1@sha256:" + "b" * 64
    seen = Observation(exists=True, succeeded=True, progress=Progress(step=6, exports=[
        {"uri": "oci://myreg.azurecr.io/adapters/demo:v1", "pushed": pushed}]))
    d = reconcile(job(launched("Running")), seen, at(500))
    assert d.status.phase == "Succeeded"
    exported = condition(d.status, "Exported")
    assert (exported.status, exported.reason, exported.message) == ("True", "Pushed",
                                                                     f"pushed {pushed}")
    assert [(e.type, e.reason) for e in d.events if e.reason == "Pushed"] == [
        ("Normal", "Pushed")]
    assert "exports" not in d.status.to_dict()["progress"]  # the condition holds them
    again = reconcile(job(d.status), seen, at(600))  # a finished job says nothing again
    assert not [e for e in again.events if e.reason == "Pushed"]
    plain = reconcile(job(launched("Running")), Observation(exists=True, succeeded=True),
                      at(500))
    assert condition(plain.status, "Exported") is None  # nothing asked, nothing said


def test_a_failed_push_names_the_folder_its_target_pushes():
    """A `merged` target pushes merged/, the others final/: the fix names the folder the
    failed one would have pushed (`finetune export` of that one)."""
    merged, adapter = "oci://r.example.com/m/merged:v1", "oci://r.example.com/m/adapter:v1"
    spec = {"output": {"uri": "pvc://ckpt/demo", "mergeAdapter": True,
                       "export": [{"uri": merged, "merged": True}, {"uri": adapter}]}}
    refused = "the registry refused the push (401: unauthorized); give it credentials"
    one = Observation(exists=True, succeeded=True, progress=Progress(step=6, exports=[
        {"uri": merged, "error": refused}, {"uri": adapter, "pushed": "r/m@sha256:0"}]))
    said = condition(reconcile(job(launched("Running", **spec), **spec), one, at(500)).status,
                     "Exported").message
    assert said.endswith("the model is in pvc://ckpt/demo/merged: push it by hand with "
                         "`finetune export` once fixed"), said
    both = Observation(exists=True, succeeded=True, progress=Progress(step=6, exports=[
        {"uri": merged, "error": refused}, {"uri": adapter, "error": refused}]))
    said = condition(reconcile(job(launched("Running", **spec), **spec), both, at(500)).status,
                     "Exported").message
    assert "the model is in pvc://ckpt/demo/merged and pvc://ckpt/demo/final:" in said, said


def test_suspend_and_resume():
    suspend = {"runPolicy": {"suspend": True}}
    d = reconcile(job(launched("Running", **suspend), **suspend),
                  Observation(exists=True, running=True), at(100))
    assert kinds(d) == ["suspend"] and d.status.phase == "Suspended"
    assert condition(d.status, "Suspended").status == "True"
    resumed = reconcile(job(d.status), Observation(exists=True, suspended=True), at(200))
    assert kinds(resumed) == ["resume"] and resumed.status.phase == "Launching"
    assert condition(resumed.status, "Suspended").status == "False"


def test_resume_waits_until_the_suspended_workers_have_stopped():
    """A gang started while the old one still writes its checkpoint would resume from an
    older one (and the real Job controller counts the late exits as failures)."""
    suspend = {"runPolicy": {"suspend": True}}
    d = reconcile(job(launched("Running", **suspend), **suspend),
                  Observation(exists=True, running=True), at(100))
    waiting = reconcile(job(d.status), Observation(exists=True, suspended=True, stopping=True),
                        at(101))
    assert kinds(waiting) == [] and waiting.status.phase == "Suspended"
    assert "once the suspended workers have stopped" in waiting.status.message
    assert kinds(reconcile(job(waiting.status), Observation(exists=True, suspended=True),
                           at(103))) == ["resume"]


def test_a_job_created_suspended_launches_nothing():
    d = reconcile(job(runPolicy={"suspend": True}), Observation(), T0)
    assert kinds(d) == [] and d.status.phase == "Suspended"


def test_kueue_queued_until_admitted():
    queue = {"kubernetes": {"queueName": "team-a"}}
    d = reconcile(job(launched(**queue), **queue), Observation(exists=True, suspended=True),
                  at(10))
    assert d.status.phase == "Queued" and condition(d.status, "Admitted").status == "False"
    assert "team-a" in condition(d.status, "Admitted").message
    admitted = reconcile(job(d.status, **queue), Observation(exists=True, running=True), at(900))
    assert admitted.status.phase == "Running"
    assert condition(admitted.status, "Admitted").status == "True"


QUEUE = {"kubernetes": {"queueName": "team-a"}}


def test_a_queued_job_says_queued_from_its_first_reconcile():
    """#24: it showed Launching until the next look, though nothing runs before admission."""
    d = reconcile(job(**QUEUE), Observation(), T0)
    assert kinds(d) == ["launch"]
    assert d.status.phase == "Queued" and "queue team-a" in d.status.message
    assert condition(d.status, "Admitted").reason == "WaitingForQueue"


def test_kueue_preemption_says_preempted_and_clears_running():
    """#24: after preemption the job said Queued with Running=True and no word of why."""
    running = reconcile(job(launched(**QUEUE), **QUEUE), Observation(exists=True, running=True),
                        at(10))
    assert running.status.phase == "Running"
    preempted = reconcile(job(running.status, **QUEUE),
                          Observation(exists=True, suspended=True, stopping=True), at(20))
    assert preempted.status.phase == "Queued"
    assert condition(preempted.status, "Admitted").reason == "Preempted"
    assert condition(preempted.status, "Running").status == "False"
    assert [e.reason for e in preempted.events] == ["Preempted", "Queued"]
    assert preempted.status.restarts == 0 and kinds(preempted) == []
    # still waiting: the condition keeps the reason, no second event
    waiting = reconcile(job(preempted.status, **QUEUE), Observation(exists=True, suspended=True),
                        at(30))
    assert condition(waiting.status, "Admitted").reason == "Preempted" and waiting.events == []
    admitted = reconcile(job(waiting.status, **QUEUE), Observation(exists=True), at(35))
    assert admitted.status.phase == "Launching"  # pods not running yet: the startup deadline
    assert condition(admitted.status, "Admitted").status == "True"
    again = reconcile(job(admitted.status, **QUEUE), Observation(exists=True, running=True),
                      at(40))
    assert again.status.phase == "Running"
    assert condition(again.status, "Admitted").status == "True"


def test_the_preempted_event_quotes_the_eviction_not_an_older_wait():
    """#49: the event quoted Kueue's last word on why the job waited (a flavor message from
    before its admission) instead of the eviction's."""
    running = reconcile(job(launched(**QUEUE), **QUEUE), Observation(exists=True, running=True),
                        at(10))
    evicted = ("Preempted to accommodate a workload (UID: 5f0c, JobUID: 77ab) due to "
               "prioritization in the ClusterQueue")
    d = reconcile(job(running.status, **QUEUE), Observation(
        exists=True, suspended=True, stopping=True, queue_active=True,
        queue_message="couldn't assign flavors to pod set main", queue_evicted=evicted), at(20))
    [event] = [e for e in d.events if e.reason == "Preempted"]
    assert f"Kueue evicted the job ({evicted})" in event.message
    assert "flavors" not in event.message


def test_a_queued_job_shows_kueues_reason_for_not_admitting_it():
    """#24: a job Kueue could not place stayed Queued for ever without the reason."""
    queued = reconcile(job(**QUEUE), Observation(), T0)
    why = "couldn't assign flavors to pod set main: flavor a100 doesn't match node affinity"
    d = reconcile(job(queued.status, **QUEUE), Observation(
        exists=True, suspended=True, queue_active=True, queue_message=why), at(5))
    assert d.status.phase == "Queued" and why in d.status.message
    assert why in condition(d.status, "Admitted").message


def test_suspending_a_queued_job_goes_through_kueues_switch():
    """#24: the operator suspended the Job, which Kueue unsuspended at once (quota held);
    a queued job is suspended by deactivating its Workload, and resumed into the queue."""
    running = reconcile(job(launched(**QUEUE), **QUEUE), Observation(exists=True, running=True),
                        at(10))
    suspend = {"runPolicy": {"suspend": True}, **QUEUE}
    d = reconcile(job(running.status, **suspend),
                  Observation(exists=True, running=True, queue_active=True), at(20))
    assert kinds(d) == ["suspend"] and d.status.phase == "Suspended"
    assert "quota" in condition(d.status, "Suspended").message
    # #49: it kept Admitted=True while suspended, its quota freed
    assert condition(d.status, "Admitted").status == "False"
    assert condition(d.status, "Admitted").reason == "Suspended"
    # Kueue suspends the Job itself: nothing more to do, whatever the Job shows
    for seen in (Observation(exists=True, running=True, queue_active=False),
                 Observation(exists=True, suspended=True, queue_active=False)):
        assert kinds(reconcile(job(d.status, **suspend), seen, at(25))) == []
    resumed = reconcile(job(d.status, **QUEUE), Observation(
        exists=True, suspended=True, queue_active=False,
        queue_message="The workload is deactivated"), at(30))
    assert kinds(resumed) == ["resume"]
    assert resumed.status.phase == "Queued"  # not Launching: Kueue decides when it runs
    assert condition(resumed.status, "Admitted").status == "False"
    # #49: Kueue's word read before the resume is about the suspension, not news
    assert "deactivated" not in condition(resumed.status, "Admitted").message


def test_a_queued_job_without_a_workload_is_suspended_by_its_job():
    """No Kueue Workload (Kueue not installed, or not yet): the Job's own switch."""
    suspend = {"runPolicy": {"suspend": True}, **QUEUE}
    d = reconcile(job(launched(**QUEUE), **suspend), Observation(exists=True, running=True),
                  at(20))
    assert kinds(d) == ["suspend"]


def test_a_gang_restart_of_a_queued_job_queues_again_and_says_why():
    """#24: the new Job is a new Workload to Kueue; the status says so, not Launching."""
    failed = reconcile(job(launched("Running", **QUEUE), **QUEUE), Observation(
        exists=True, failure=Failure("worker", "demo-1 exited 1 (Error)")), at(10))
    assert failed.status.phase == "Restarting"
    relaunched = reconcile(job(failed.status, **QUEUE), Observation(), at(15))
    assert kinds(relaunched) == ["launch"] and relaunched.status.phase == "Queued"
    admitted = condition(relaunched.status, "Admitted")
    assert admitted.reason == "RequeuedByRestart" and "new Job" in admitted.message
    waiting = reconcile(job(relaunched.status, **QUEUE), Observation(exists=True, suspended=True),
                        at(20))
    assert condition(waiting.status, "Admitted").reason == "RequeuedByRestart"


def test_the_startup_deadline_counts_from_admission_not_from_each_look_in_the_queue():
    queued = reconcile(job(launched(**QUEUE), **QUEUE), Observation(exists=True, suspended=True),
                       at(10))
    assert queued.status.launch_time == T0  # unchanged while queued: no status churn
    admitted = reconcile(job(queued.status, **QUEUE), Observation(exists=True), at(500))
    assert admitted.status.launch_time == at(500)


def test_an_eviction_says_kueues_reason():
    """Kueue evicts for preemption, and for pods not ready in time: its words say which."""
    running = reconcile(job(launched(**QUEUE), **QUEUE), Observation(exists=True, running=True),
                        at(10))
    why = "Exceeded the PodsReady timeout default/demo"
    evicted = reconcile(job(running.status, **QUEUE), Observation(
        exists=True, suspended=True, queue_active=True, queue_message=why), at(20))
    assert condition(evicted.status, "Admitted").reason == "Preempted"
    assert why in condition(evicted.status, "Admitted").message


def test_a_job_failing_after_admission_has_no_stale_queue_condition():
    """#24: it ended Failed still saying it waited for Kueue."""
    queued = reconcile(job(**QUEUE), Observation(), T0)
    failed = reconcile(job(queued.status, runPolicy={"backoffLimit": 0}, **QUEUE), Observation(
        exists=True, failure=Failure("worker", "demo-0 exited 1 (Error)")), at(5))
    assert failed.status.phase == "Failed"
    assert condition(failed.status, "Admitted").status == "True"


def test_spec_changes_after_launch_are_refused_except_run_policy():
    status = launched("Running")
    changed = reconcile(job(status, generation=2, method={"type": "full"}),
                        Observation(exists=True, running=True), at(10))
    refused = condition(changed.status, "SpecChangeRefused")
    assert refused.status == "True" and "spec.method" in refused.message
    assert kinds(changed) == []  # what runs keeps running
    assert changed.status.observed_generation == 2
    policy = reconcile(job(status, generation=3, runPolicy={"backoffLimit": 9}),
                       Observation(exists=True, running=True), at(20))
    assert condition(policy.status, "SpecChangeRefused") is None


def test_a_refused_change_is_an_event_once_per_generation():
    """A GitOps tool shows the spec as synced and `kubectl get ftj` says `training`: the
    refusal must reach `kubectl get events` too, once per edit, not once per look."""
    status = launched("Running")
    status.progress = Progress(step=5)
    edited = reconcile(job(status, generation=2, method={"type": "full"}),
                       Observation(exists=True, running=True), at(10))
    assert [(e.type, e.reason) for e in edited.events] == [("Warning", "SpecChangeRefused")]
    again = reconcile(job(edited.status, generation=2, method={"type": "full"}),
                      Observation(exists=True, running=True), at(20))
    assert again.events == []
    other = reconcile(job(again.status, generation=3, method={"type": "full"},
                          dataset={"uri": "pvc://data/other.jsonl"}),
                      Observation(exists=True, running=True), at(30))
    assert [e.reason for e in other.events] == ["SpecChangeRefused"]


def test_an_edit_of_an_ended_job_is_said_to_start_nothing():
    """observedGeneration alone read as "applied" (Flux's kstatus does)."""
    ended = launched("Succeeded")
    ended.observed_generation = 1
    edited = reconcile(job(ended, generation=2, method={"type": "full"}),
                       Observation(exists=True, succeeded=True), at(10))
    assert [(e.type, e.reason) for e in edited.events] == [("Warning", "SpecChangeIgnored")]
    assert "the job has ended (Succeeded): an edit starts nothing" in edited.events[0].message
    assert edited.status.phase == "Succeeded" and kinds(edited) == []
    again = reconcile(job(edited.status, generation=2, method={"type": "full"}),
                      Observation(exists=True, succeeded=True), at(20))
    assert again.events == []


def test_an_edit_before_any_worker_ran_relaunches_them_with_it():
    """The fix a waiting job's message asks for (an image, a nodeSelector): refused, the job
    waited out its startup deadline and failed."""
    first = reconcile(job(), Observation(), T0)
    edited = job(first.status, generation=2, kubernetes={"image": "trainer:fixed"})
    waiting = Observation(exists=True, waiting="demo-0: ErrImagePull")
    applied = reconcile(edited, waiting, at(10))
    assert kinds(applied) == ["delete-workload"]
    assert applied.status.phase == "Restarting" and not applied.status.launched_spec
    assert [e.reason for e in applied.events] == ["SpecChangeApplied", "Restarting"]
    assert "spec.kubernetes changed before any worker ran" in applied.events[0].message
    gone = reconcile(job(applied.status, generation=2, kubernetes={"image": "trainer:fixed"}),
                     Observation(), at(20))
    assert kinds(gone) == ["launch"] and gone.status.phase == "Launching"
    assert gone.status.spec_at_launch["kubernetes"]["image"] == "trainer:fixed"
    # once a worker has trained, the same edit is refused: its checkpoints are of the spec
    ran = first.status.model_copy(update={"phase": "Running", "progress": Progress(step=1)})
    refused = reconcile(job(ran, generation=2, kubernetes={"image": "trainer:fixed"}),
                        Observation(exists=True, running=True), at(10))
    assert kinds(refused) == [] and condition(refused.status, "SpecChangeRefused").status == "True"


def test_a_field_a_newer_operator_added_is_no_change_after_an_upgrade():
    """specAtLaunch written by an operator that had no such field, and its fingerprint: the
    upgraded operator called every running job changed, and advised deleting them."""
    first = reconcile(job(), Observation(), T0)
    older = first.status.model_copy(deep=True)
    older.phase, older.progress = "Running", Progress(step=5)
    del older.spec_at_launch["hyperparameters"]["earlyStoppingThreshold"]  # not there then
    older.launched_spec["hyperparameters"] = "0123456789ab"  # hashed with the fields then
    upgraded = reconcile(job(older), Observation(exists=True, running=True), at(10))
    assert condition(upgraded.status, "SpecChangeRefused") is None and upgraded.events == []
    assert upgraded.status.launched_spec == first.status.launched_spec  # hashed anew


def test_after_a_refused_change_the_workers_run_and_relaunch_as_launched():
    first = reconcile(job(), Observation(), T0)
    assert first.status.spec_at_launch["resources"]["nodes"] == 1
    assert "runPolicy" not in first.status.spec_at_launch
    ran = first.status.model_copy(update={"phase": "Running", "progress": Progress(step=5)})
    edited = job(ran, generation=2, resources={"nodes": 3, "gpusPerNode": 1},
                 runPolicy={"backoffLimit": 9})
    running = as_launched(edited)
    assert running.spec.resources.nodes == 1  # what the workers were launched as
    assert running.spec.run_policy.backoff_limit == 9  # the section that may change does
    # a gang restart relaunches that, and the refusal stays said
    failed = Observation(exists=True, failure=Failure("worker", "demo-0-abcde exited 1"))
    restart = reconcile(edited, failed, at(30))
    relaunch = reconcile(job(restart.status, generation=2, resources={"nodes": 3,
                                                                      "gpusPerNode": 1}),
                         Observation(), at(40))
    assert kinds(relaunch) == ["launch"]
    assert relaunch.status.launched_spec == first.status.launched_spec
    assert relaunch.status.spec_at_launch == first.status.spec_at_launch
    assert condition(relaunch.status, "SpecChangeRefused").status == "True"
    # a job launched by an operator that kept only the fingerprints: kept at the next look
    # while the spec is still as launched
    older = launched("Running")
    assert not older.spec_at_launch
    kept = reconcile(job(older), Observation(exists=True, running=True), at(50))
    assert kept.status.spec_at_launch == first.status.spec_at_launch


def test_an_invalid_edit_after_launch_is_said_and_the_workers_are_still_followed():
    """It stopped every later guard: the job never reached Succeeded."""
    status = launched("Running")
    edit = ["spec.hyperparameters.learningRate: must be positive — set a value above 0"]
    d = reconcile(job(status, generation=2), Observation(exists=True, succeeded=True), at(60),
                  problems=edit)
    assert condition(d.status, "Validated").reason == "InvalidSpec"
    assert d.status.phase == "Succeeded" and kinds(d) == []


def test_a_job_refused_as_invalid_is_admitted_again_once_edited():
    problems = ["spec.backend: 'slurm' is not installed"]
    refused = reconcile(job(), Observation(), T0, problems=problems)
    again = reconcile(job(refused.status), Observation(), at(5), problems=problems)
    assert again.status.phase == "Failed" and again.events == []  # same generation: said once
    fixed = reconcile(job(again.status, generation=2), Observation(), at(10))
    assert kinds(fixed) == ["launch"] and fixed.status.phase == "Launching"
    assert condition(fixed.status, "Validated").status == "True"
    assert condition(fixed.status, "Failed").status == "False"
    still = reconcile(job(again.status, generation=2), Observation(), at(10), problems=problems)
    assert still.status.phase == "Failed" and kinds(still) == []


def test_active_deadline_fails_the_job():
    d = reconcile(job(launched("Running"), runPolicy={"activeDeadlineSeconds": 3600}),
                  Observation(exists=True, running=True), at(3601))
    assert d.status.phase == "Failed" and kinds(d) == ["delete-workload"]
    assert condition(d.status, "Failed").reason == "DeadlineExceeded"


def test_condition_transition_time_moves_only_with_its_status():
    status = FineTuneJobStatus()
    set_condition(status, "Running", True, "WorkersRunning", "", T0, 1)
    set_condition(status, "Running", True, "WorkersRunning", "still", at(60), 2)
    assert status.conditions[0].last_transition_time == T0
    assert status.conditions[0].observed_generation == 2
    set_condition(status, "Running", False, "Restarting", "", at(120), 2)
    assert status.conditions[0].last_transition_time == at(120)


def test_the_trainers_preflight_becomes_a_condition_naming_slow_nodes():
    running = launched(phase="Running")
    good = {"busBandwidthGBps": 182.4, "nodes": {"aks-gpu-0": 180.1, "aks-gpu-1": 184.0},
            "slowNodes": [], "transport": "IB"}
    d = reconcile(job(running), Observation(exists=True, running=True,
                                            progress=Progress(step=1, preflight=good)), at(60))
    ok = condition(d.status, "CollectivePreflight")
    assert ok.status == "True" and "182.4 GB/s" in ok.message and "aks-gpu-1 184" in ok.message
    assert "NCCL transport IB" in ok.message
    slow = {**good, "nodes": {"aks-gpu-0": 180.1, "aks-gpu-1": 61.0, "aks-gpu-2": 179.0},
            "slowNodes": ["aks-gpu-1"]}
    d = reconcile(job(running), Observation(exists=True, running=True,
                                            progress=Progress(step=1, preflight=slow)), at(60))
    lagging = condition(d.status, "CollectivePreflight")
    assert lagging.status == "False" and lagging.reason == "SlowNodes"
    assert lagging.message.startswith("aks-gpu-1 below 0.8x the median")
    assert "Cordon" in lagging.message
    assert d.status.phase == "Running"  # a report, not a failure (the floor fails the job)
    assert "preflight" not in d.status.to_dict()["progress"]


def test_workers_found_without_a_recorded_launch_are_adopted():
    # the operator died after creating them, before its status patch landed
    d = reconcile(job(), Observation(exists=True, running=True), at(30))
    assert kinds(d) == [] and d.status.phase == "Running"
    assert d.status.launched_spec == spec_fingerprint(job())
    assert d.status.launch_time == at(30) and d.status.start_time == at(30)
    changed = reconcile(job(d.status, generation=2, method={"type": "full"}),
                        Observation(exists=True, running=True), at(40))
    assert condition(changed.status, "SpecChangeRefused").status == "True"


def test_workers_deleted_by_hand_are_launched_again_with_a_warning():
    d = reconcile(job(launched("Running", restarts=1)), Observation(), at(60))
    assert kinds(d) == ["launch"] and d.status.phase == "Launching"
    assert d.status.restarts == 1  # not the workers' failure: not counted
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "WorkersMissing"),
                                                      ("Normal", "Launching")]
    # a restart the operator asked for is not "missing"
    restart = reconcile(job(launched("Restarting", restarts=1)), Observation(), at(60))
    assert "WorkersMissing" not in [e.reason for e in restart.events]


def test_a_child_deleted_by_hand_is_recreated_and_the_workers_keep_running():
    seen = Observation(exists=True, running=True, missing=("Service demo",))
    d = reconcile(job(launched("Running")), seen, at(60))
    assert kinds(d) == ["launch"] and d.status.phase == "Running"
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "ChildRecreated")]
    assert "Service demo" in d.events[0].message


def test_a_refused_output_folder_fails_the_job_at_once_without_using_the_budget():
    """The trainer refused checkpoints of other settings: every restart would refuse again."""
    why = ("/out holds checkpoints trained with other settings (method.lora.r: 8 → 16), "
           "which this job cannot resume from — set spec.output.uri to a new folder")
    d = reconcile(job(launched("Running")),
                  Observation(exists=True, failure=Failure("refused", why)), at(100))
    assert d.status.phase == "Failed" and d.status.restarts == 0
    assert condition(d.status, "Failed").reason == "OtherSettingsCheckpoints"
    assert condition(d.status, "Failed").message == why
    assert kinds(d) == ["delete-workload"]


SETUP = ("demo-0-abcde exited 5: op 'deepspeed_shm_comm' could not be built in this image: "
         "/bin/sh: 1: c++: not found (DeepSpeed builds its ops on first use: prebuild it into "
         "the image, or use one that can build it)")


def test_a_worker_that_cannot_set_itself_up_fails_the_job_after_one_restart():
    """The trainer's exit 5 (an op that cannot build, an import error: the image's) before
    any step: one restart, in case a node was at fault, counted and said; the same again on
    a job that still never trained fails it, quoting the worker's line, budget or not."""
    seen = Observation(exists=True, failure=Failure("worker", SETUP, setup=True))
    first = reconcile(job(launched("Running")), seen, at(50))
    assert kinds(first) == ["delete-workload"] and first.status.restarts == 1
    assert first.status.phase == "Restarting" and "c++: not found" in first.status.message
    assert "the same failure again before any step fails the job" in first.status.message
    second = reconcile(job(launched("Running", restarts=1)), seen, at(50))
    assert second.status.phase == "Failed" and kinds(second) == ["delete-workload"]
    failed = condition(second.status, "Failed")
    assert failed.reason == "WorkerSetupFailed" and second.status.restarts == 1
    assert failed.message.startswith(SETUP) and "after 1 restart," in failed.message
    assert SETUP in second.status.message
    assert condition(second.status, "Running").reason == "WorkerSetupFailed"
    # backoffLimit 0: no restart, the same reason
    none = reconcile(job(launched("Running"), runPolicy={"backoffLimit": 0}), seen, at(50))
    assert condition(none.status, "Failed").reason == "WorkerSetupFailed"


def test_a_setup_failure_of_a_job_that_trained_uses_the_budget():
    """Once a step or a checkpoint was made, the image could set the workers up: exit 5
    then counts like any worker failure, up to backoffLimit."""
    seen = Observation(exists=True, failure=Failure("worker", SETUP, setup=True))
    trained = launched("Running", restarts=1)
    trained.progress = Progress(step=40, last_step_time=at(40))
    d = reconcile(job(trained), seen, at(50))
    assert d.status.phase == "Restarting" and d.status.restarts == 2
    assert "the same failure again" not in d.status.message
    trained.restarts = 3
    d = reconcile(job(trained), seen, at(50))
    assert condition(d.status, "Failed").reason == "BackoffLimitExceeded"


PLAN = LaunchPlan(strategy="fsdp", gradient_checkpointing=True,
                  gradient_checkpointing_policy="selective", compile=False)


def test_the_plan_is_recorded_at_the_first_launch_and_kept_through_restarts():
    """#16: `auto` decided once; later launches render from the record."""
    d = reconcile(job(), Observation(), T0, feasibility=Feasibility(True, "fits", PLAN))
    assert kinds(d) == ["launch"] and d.status.plan == PLAN
    failed = reconcile(job(d.status), Observation(
        exists=True, failure=Failure("worker", "demo-1 exited 1 (Error)")), at(10))
    relaunched = reconcile(job(failed.status), Observation(), at(15), feasibility=Feasibility(
        True, "fits", PLAN.model_copy(update={"strategy": "zero3"})))
    assert kinds(relaunched) == ["launch"] and relaunched.status.plan == PLAN


def test_the_plan_is_recorded_when_workers_are_adopted():
    d = reconcile(job(), Observation(exists=True, running=True), T0,
                  feasibility=Feasibility(True, "fits", PLAN))
    assert d.status.plan == PLAN


def test_a_new_job_waiting_for_its_turn_is_pending_and_says_when():
    d = reconcile(job(), Observation(), T0, launch_at=at(12.3))
    assert kinds(d) == [] and d.events == []  # said in the status, not one event per job
    assert d.status.phase == "Pending" and d.status.message == (
        "waiting for its turn to launch at 2026-11-21T12:00:12Z (the operator paces "
        "launches: --launch-rate, the chart's launchRate)")
    assert condition(d.status, "Validated").status == "True"
    assert not d.status.launched_spec and d.status.launch_time is None
    assert d.requeue_after == 12.3
    # looked at again before its turn (an operator that restarted, a late clock): the same
    # words, so the status is not written again (a countdown was rewritten at each look)
    again = reconcile(job(d.status), Observation(), at(11.2), launch_at=at(12.3))
    assert again.status == d.status and again.requeue_after == 1.1
    # its turn: launched as a job that never waited is
    turn = reconcile(job(d.status), Observation(), at(13))
    assert kinds(turn) == ["launch"] and turn.status.phase == "Launching"
    assert [e.reason for e in turn.events] == ["Launching"]


def test_a_gang_restart_waiting_for_its_turn_keeps_saying_why_it_restarts():
    status = launched(phase="Restarting", restarts=1)
    status.message = "a worker failed: demo-0 exit 1; restarting the gang (restart 1 of 3)"
    d = reconcile(job(status), Observation(), at(60), launch_at=at(64))
    assert kinds(d) == [] and d.status.phase == "Restarting"
    assert d.status.message == status.message and d.requeue_after == 4


def test_the_launch_wait_does_not_hold_up_workers_that_exist():
    seen = Observation(exists=True, running=True)
    d = reconcile(job(launched()), seen, at(60), launch_at=at(90))
    assert d.status.phase == "Running" and kinds(d) == []
