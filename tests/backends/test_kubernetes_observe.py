"""Reading a Job and its pods the way the reconciler needs: failures classified for the
restart budget, waiting reasons in the pod's own words."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from finetune_operator.api import FineTuneJob, Progress
from finetune_operator.backends.kubernetes.states import (
    PEER_LOSS_GRACE_SECONDS,
    creation_failure,
    mount_failure,
    mounting,
    named_by_field,
    needs_creation_events,
    observe,
    pod_failure,
    pod_waiting,
)
from tests.conftest import minimal_job


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


def ended(code: int, at: str, message: str) -> dict:
    status = terminated(code, message=message)
    status["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = at
    return status


LOST_PEER = ("rank 0 exited 1: RuntimeError: [pair.cc:534] Connection closed by peer "
             "[10.244.0.6]:41234. This is typically caused by a remote worker crashing.")
KILLED = "rank 1 was ended by SIGKILL"


def test_of_two_failed_workers_the_first_to_end_is_the_cause():
    oom = "rank 1 exited 1: torch.OutOfMemoryError: CUDA out of memory"
    seen = observe(job_object(), [
        pod("demo-0-a", "Failed", **ended(1, "2026-11-27T10:40:03Z", "rank 0 exited 1: boom")),
        pod("demo-1-b", "Failed", **ended(1, "2026-11-27T10:40:01Z", oom))], nodes=2)
    assert seen.failure.message == f"demo-1-b exited 1 (Error): {oom}"


def test_a_ranks_own_failure_outranks_its_peers_lost_connection_ended_before_it():
    """Seen on the real node: rank 1's trainer killed, rank 0's collective lost the peer and
    its pod ended first; the status gave rank 0's lost connection, not the kill."""
    seen = observe(job_object("FailureTarget"), [
        pod("demo-0-a", "Failed", **ended(1, "2026-11-27T10:40:01Z", LOST_PEER)),
        pod("demo-1-b", "Failed", **ended(1, "2026-11-27T10:40:02Z", KILLED))], nodes=2)
    assert seen.failure.message == f"demo-1-b exited 1 (Error): {KILLED}"


def test_a_lost_peer_waits_for_the_peers_own_word_while_its_pod_still_runs():
    """Rank 0 failed on its lost connection; rank 1's pod, which the Job controller is
    taking away, has not ended yet: no cause is given (and the job is looked at again), for
    at most PEER_LOSS_GRACE_SECONDS, then the lost connection is the cause."""
    lost = pod("demo-0-a", "Failed", **ended(1, "2026-11-27T10:40:01Z", LOST_PEER))
    peer = pod("demo-1-b", "Running")
    peer["metadata"]["deletionTimestamp"] = "2026-11-27T10:40:01Z"
    pods = [lost, peer]
    soon = datetime(2026, 11, 27, 10, 40, 5, tzinfo=UTC)
    waiting = observe(job_object("FailureTarget"), pods, nodes=2, now=soon)
    assert waiting.failure is None and waiting.polled and waiting.exists
    late = soon + timedelta(seconds=PEER_LOSS_GRACE_SECONDS)
    assert LOST_PEER in observe(job_object("FailureTarget"), pods, nodes=2,
                                now=late).failure.message
    # the peer's own failure, once its pod ended (still being deleted): that is the cause
    peer["status"] = {"phase": "Failed", **ended(1, "2026-11-27T10:40:06Z", KILLED)}
    assert observe(job_object("FailureTarget"), pods, nodes=2,
                   now=soon).failure.message == f"demo-1-b exited 1 (Error): {KILLED}"
    # a worker's own failure, ended or not: no wait
    own = pod("demo-0-a", "Failed", **ended(1, "2026-11-27T10:40:01Z", "rank 0 exited 1: boom"))
    assert observe(job_object("FailureTarget"), [own, pod("demo-1-b", "Running")], nodes=2,
                   now=soon).failure.message == "demo-0-a exited 1 (Error): rank 0 exited 1: boom"


def test_a_worker_stopped_on_suspend_is_no_cause():
    """Pods being deleted on a suspension exit on SIGTERM: not failures of the gang."""
    going = pod("demo-0-a", "Failed", **ended(1, "2026-11-27T10:40:01Z", "rank 0 exited 1: x"))
    going["metadata"]["deletionTimestamp"] = "2026-11-27T10:40:00Z"
    seen = observe(job_object(suspend=True), [going], nodes=1)
    assert seen.failure is None and seen.suspended


def test_an_oomkilled_worker_is_said_plainly_with_the_field_to_raise():
    """Seen on the real node (a 200Mi limit): the kernel's OOMKilled, and nothing else said."""
    killed = pod("demo-0-a", "Failed", **terminated(137, reason="OOMKilled"))
    failure = pod_failure(killed)
    assert failure.kind == "worker"
    assert failure.message.startswith("demo-0-a exited 137 (OOMKilled): its processes needed "
                                      "more memory than the container's limit, "
                                      "spec.resources.memory; raise it")


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


def conditions(*said: tuple[str, str, str]) -> dict:
    """A Job whose status holds these (type, status, reason) conditions, in order."""
    return {"metadata": {"name": "demo"}, "spec": {"suspend": False}, "status": {
        "conditions": [{"type": t, "status": v, "reason": r, "message": f"{r} said"}
                       for t, v, r in said]}}


SUCCESS = ("SuccessCriteriaMet", "True", "CompletionsReached")
COMPLETE = ("Complete", "True", "CompletionsReached")
FAILURE_TARGET = ("FailureTarget", "True", "BackoffLimitExceeded")
FAILED = ("Failed", "True", "BackoffLimitExceeded")
SUSPENDED = ("Suspended", "True", "JobSuspended")
RESUMED = ("Suspended", "False", "JobResumed")


@pytest.mark.parametrize(("said", "suspend", "phases", "concluded"), [
    # every pod running, no verdict yet
    ((), False, ("Running", "Running"), "running"),
    # one node's worker ended first: the other still trains
    ((), False, ("Succeeded", "Running"), "starting"),
    # the Job controller's verdict while a pod still holds its finalizer, then its last word
    ((SUCCESS,), False, ("Succeeded", "Succeeded"), "succeeded"),
    ((SUCCESS, COMPLETE), False, ("Succeeded", "Succeeded"), "succeeded"),
    ((SUCCESS, COMPLETE), False, (), "succeeded"),  # the pods already collected
    ((FAILURE_TARGET,), False, (), "failed"),  # the failed pods already gone
    ((FAILURE_TARGET, FAILED), False, (), "failed"),
    # suspended (Kueue, or runPolicy.suspend), then resumed: the condition stays, False
    ((SUSPENDED,), True, (), "suspended"),
    ((SUSPENDED,), True, ("Running",), "suspended"),  # its pods stopping
    ((RESUMED,), False, ("Running", "Running"), "running"),
    ((RESUMED, SUCCESS, COMPLETE), False, ("Succeeded",), "succeeded"),
], ids=lambda value: "-".join(c if isinstance(c, str) else c[0] for c in value)
    if isinstance(value, tuple) else str(value))
def test_every_condition_sequence_of_the_job_controller(said, suspend, phases, concluded):
    """What the Job controller of 1.34-1.36 writes (SuccessCriteriaMet and FailureTarget the
    moment it decides, Complete and Failed once every pod has terminated) and what we
    conclude at each point."""
    workload = conditions(*said)
    workload["spec"]["suspend"] = suspend
    pods = [pod(f"demo-{i}-x", phase) for i, phase in enumerate(phases)]
    seen = observe(workload, pods, nodes=2)
    found = ("succeeded" if seen.succeeded else "failed" if seen.failure else
             "suspended" if seen.suspended else "running" if seen.running else "starting")
    assert found == concluded
    if concluded == "failed":
        assert seen.failure.kind == "worker"
        assert seen.failure.message == "BackoffLimitExceeded: BackoffLimitExceeded said"


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
    assert seen.blocked == "ErrImagePull"  # the kubelet's retry of the same pull: one cause
    assert observe(job_object(), [unschedulable], nodes=1).blocked == "Unschedulable"
    creating = pod("demo-1-c", "Pending", containerStatuses=[{"state": {"waiting": {
        "reason": "ContainerCreating"}}}])
    assert pod_waiting(creating) is None


def test_a_missing_claim_is_named_by_the_field_that_names_it():
    """The scheduler says only 'persistentvolumeclaim "x" not found': the status names the
    field (a pvc:// location or a user volume), the namespace and the fix."""
    manifest = minimal_job(output={"uri": "pvc://data/out"}, kubernetes={"volumes": [
        {"name": "scratch", "mountPath": "/scratch", "emptyDir": {}},
        {"name": "shared", "mountPath": "/shared", "persistentVolumeClaim": {"claimName": "data"}},
    ]})
    manifest["metadata"]["namespace"] = "ml-team"
    job = FineTuneJob.model_validate(manifest)
    unschedulable = pod("demo-0-a", "Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": '0/5 nodes are available: persistentvolumeclaim "data" not found. not found'}])
    said = named_by_field(job, pod_waiting(unschedulable))
    assert said == (
        "demo-0-a: namespace ml-team has no PersistentVolumeClaim 'data', which "
        "spec.dataset.uri (pvc://data/train.jsonl) and spec.output.uri (pvc://data/out) and "
        "spec.kubernetes.volumes[1] (shared) name — create the claim (the workers start once "
        "it is bound) or name one that exists (kubectl get pvc -n ml-team)")
    other = unschedulable["status"]["conditions"][0]["message"].replace('"data"', '"other"')
    not_ours = f"demo-0-a: Unschedulable: {other}"  # a claim the job does not name
    assert named_by_field(job, not_ours) == not_ours
    crashing = "demo-0-a: CrashLoopBackOff: back-off restarting failed container"
    assert named_by_field(job, crashing) == crashing
    assert named_by_field(job, None) is None


def test_a_missing_priority_class_and_a_selector_no_node_matches_name_their_fields():
    """The Job controller's and the scheduler's words name neither field."""
    job = FineTuneJob.model_validate(minimal_job(kubernetes={
        "priorityClassName": "nosuch-prio", "nodeSelector": {"pool": "h100"}}))
    refused = ('FailedCreate: Error creating: pods "demo-0-x" is forbidden: no PriorityClass '
               "with name nosuch-prio was found")
    assert named_by_field(job, refused) == (
        f"{refused} — spec.kubernetes.priorityClassName names it: create the PriorityClass "
        "(cluster-wide, an admin's: kubectl get priorityclasses lists those there are) or "
        "name one that exists")
    nowhere = ("demo-0-a: Unschedulable: 0/5 nodes are available: 5 node(s) didn't match "
               "Pod's node affinity/selector.")
    assert named_by_field(job, nowhere) == (
        f"{nowhere} — spec.kubernetes.nodeSelector (pool=h100) is what those nodes lack: "
        "check it against their labels (kubectl get nodes -L pool)")
    plain = FineTuneJob.model_validate(minimal_job())  # no selector of the user's
    assert named_by_field(plain, nowhere) == nowhere
    # the nodes it matches are only full: on a cluster of several pools some node always
    # "didn't match", and blaming the selector sent users to edit one that was right
    busy = ("demo-0-a: Unschedulable: 0/5 nodes are available: 1 node(s) had untolerated "
            "taint(s), 2 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node "
            "affinity/selector.")
    assert named_by_field(job, busy) == (
        f"{busy} — the nodes spec.kubernetes.nodeSelector (pool=h100) matches have no free "
        "nvidia.com/gpu now: the workers start when some frees up (or when the node pool "
        "scales up)")


def test_an_init_container_that_cannot_start_is_the_reason_not_pod_initializing():
    """resume-check runs first in the trainer's image: a typo in the image stops it, and the
    kubelet says only PodInitializing of the trainer (kubectl: Init:ImagePullBackOff)."""
    pulling = pod("demo-0-a", "Pending", initContainerStatuses=[
        {"name": "resume-check", "state": {"waiting": {
            "reason": "ImagePullBackOff", "message": 'Back-off pulling image "trainer:typo"'}}},
        {"name": "fetch-model", "state": {"waiting": {"reason": "PodInitializing"}}}],
        containerStatuses=[{"name": "trainer", "state": {"waiting": {
            "reason": "PodInitializing"}}}])
    assert pod_waiting(pulling) == ('demo-0-a: ImagePullBackOff: Back-off pulling image '
                                    '"trainer:typo" (init container resume-check)')
    checking = pod("demo-0-a", "Pending", initContainerStatuses=[
        {"name": "resume-check", "state": {"running": {}}}],
        containerStatuses=[{"name": "trainer", "state": {"waiting": {
            "reason": "PodInitializing"}}}])
    assert pod_waiting(checking) is None  # on its way: nothing to act on


def test_an_image_the_nodes_cannot_pull_is_traced_to_where_it_is_set():
    """The kubelet names the image, not where it comes from: the job's spec.kubernetes.image,
    else the operator's trainer image (the chart's trainer.image), and how nodes may pull."""
    pulling = ('demo-0-a: ErrImagePull: failed to pull image "trainer:typo" (init container '
               'resume-check)')
    may_pull = ("on AKS: az aks update --attach-acr; else a pull Secret in "
                "spec.kubernetes.imagePullSecrets or the chart's trainer.imagePullSecrets")
    default = FineTuneJob.model_validate(minimal_job())
    assert named_by_field(default, pulling) == (
        f"{pulling} — the operator's trainer image (Helm values trainer.image.repository and "
        ".tag): set spec.kubernetes.image to one the nodes can pull, or fix the chart's value "
        f"({may_pull})")
    own = FineTuneJob.model_validate(minimal_job(kubernetes={"image": "trainer:typo"}))
    assert named_by_field(own, pulling.replace("ErrImagePull", "ImagePullBackOff")).endswith(
        "— spec.kubernetes.image names the image: check its name and tag, and that the nodes "
        f"may pull from its registry ({may_pull})")


def test_a_pull_the_registry_refuses_or_a_tag_it_lacks_says_which_and_the_fix():
    """The real kubelet's words (containerd 1.6, seen on the real node against the cluster's
    registry): a 401 for a pod without credentials, `not found` for a tag the registry lacks."""
    image = "10.250.1.1:5000/finetune-trainer:abc"
    refused = (f'demo-0-a: ErrImagePull: failed to pull and unpack image "{image}": failed to '
               f'resolve reference "{image}": pulling from host 10.250.1.1:5000 failed with '
               "status code [manifests abc]: 401 Unauthorized")
    default = FineTuneJob.model_validate(minimal_job())
    said = named_by_field(default, refused)
    assert said.startswith(refused + " — the registry 10.250.1.1:5000 refused the pull "
                           "without credentials it accepts: create a pull Secret (kubectl "
                           "create secret docker-registry NAME -n default "
                           "--docker-server=10.250.1.1:5000 "), said
    assert "spec.kubernetes.imagePullSecrets or the chart's trainer.imagePullSecrets" in said
    assert said.endswith("no re-apply needed")
    named = FineTuneJob.model_validate(minimal_job(kubernetes={"imagePullSecrets": ["late"]}))
    said = named_by_field(named, refused.replace("ErrImagePull", "ImagePullBackOff"))
    assert ("refused the pull with the credentials of spec.kubernetes.imagePullSecrets (late): "
            "check that each exists in namespace default" in said), said
    lacking = (f'demo-0-a: ErrImagePull: rpc error: code = NotFound desc = failed to pull and '
               f'unpack image "{image}": failed to resolve reference "{image}": {image}: '
               "not found")
    own = FineTuneJob.model_validate(minimal_job(kubernetes={"image": image}))
    assert named_by_field(own, lacking) == (
        f"{lacking} — the registry has no such image: spec.kubernetes.image names it; check "
        "its repository and tag against those the registry lists (crane ls REPOSITORY)")
    assert "it is the operator's trainer image (Helm values trainer.image.repository" in (
        named_by_field(default, lacking))


def test_an_image_not_on_the_node_under_pull_policy_never_names_both_fields():
    """Seen on the real node: `spec.kubernetes.image` with a typo and imagePullPolicy Never
    (images loaded into the node, none pulled): the kubelet's ErrImageNeverPull."""
    doc = minimal_job(kubernetes={"image": "localhost/finetune-trainer:typo",
                                  "imagePullPolicy": "Never"})
    waiting = ('demo-0-a: ErrImageNeverPull: Container image "localhost/finetune-trainer:typo" '
               "is not present with pull policy of Never (init container resume-check)")
    said = named_by_field(FineTuneJob.model_validate(doc), waiting)
    assert said.startswith(waiting + " — spec.kubernetes.image names it, and "
                           "spec.kubernetes.imagePullPolicy Never"), said


def test_a_missing_secret_or_key_is_named_by_the_field_that_names_it():
    """The kubelet says 'secret "hf-token" not found' (older ones: 'secrets'), or that a key
    is not in it: the status names the field, and the command that makes the Secret."""
    job = FineTuneJob.model_validate(minimal_job(
        model={"uri": "hf://org/gated", "tokenSecretRef": {"name": "hf-token", "key": "token"}},
        kubernetes={"env": [
            {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "hf-token",
                                                                     "key": "wandb"}}},
            {"name": "OTHER", "value": "1"}]}))
    for kubelet_said in ('secret "hf-token" not found', 'secrets "hf-token" not found'):
        waiting = pod_waiting(pod("demo-0-a", "Pending", initContainerStatuses=[
            {"name": "fetch-model", "state": {"waiting": {
                "reason": "CreateContainerConfigError", "message": kubelet_said}}}]))
        assert named_by_field(job, waiting) == (
            "demo-0-a: namespace default has no Secret 'hf-token', which "
            "spec.model.tokenSecretRef and spec.kubernetes.env[0] (WANDB_API_KEY) name — "
            "create it (kubectl create secret generic hf-token -n default "
            "--from-literal=token=... --from-literal=wandb=...) or name one that exists "
            "(kubectl get secrets -n default)")
    no_key = ("demo-0-a: CreateContainerConfigError: couldn't find key wandb in Secret "
              "default/hf-token (init container fetch-model)")
    assert named_by_field(job, no_key) == (
        "demo-0-a: Secret 'hf-token' has no key 'wandb', which "
        "spec.kubernetes.env[0] (WANDB_API_KEY) names — add the key to the Secret or name a "
        "key it has (kubectl describe secret hf-token -n default)")
    theirs = 'demo-0-a: CreateContainerConfigError: secret "registry" not found'
    assert named_by_field(job, theirs) == theirs


def test_a_missing_export_secret_is_named_with_the_command_that_makes_a_registry_login():
    job = FineTuneJob.model_validate(minimal_job(output={"uri": "pvc://data/runs/demo",
                                                         "export": [
        {"uri": "oci://myreg.azurecr.io/adapters/demo:v1", "secretName": "regcred"}]}))
    said = ('demo-0-a: FailedMount: MountVolume.SetUp failed for volume "export-secret-0" : '
            'secret "regcred" not found')
    assert named_by_field(job, said) == (
        "demo-0-a: namespace default has no Secret 'regcred', which "
        "spec.output.export[0].secretName names — create it (kubectl create secret "
        "docker-registry regcred -n default --docker-server=<registry> --docker-username=... "
        "--docker-password=...) or name one that exists (kubectl get secrets -n default)")


def test_a_volume_that_does_not_mount_is_read_from_the_kubelets_events():
    """A pod on its node whose containers wait ContainerCreating says nothing in its status
    of a volume it cannot mount: the kubelet's FailedMount event does, and a ConfigMap the
    namespace lacks is named by the volume that names it."""
    creating = pod("demo-0-a", "Pending", containerStatuses=[{"name": "trainer", "state": {
        "waiting": {"reason": "ContainerCreating"}}}])
    assert not mounting(creating)  # not on a node yet
    creating["spec"] = {"nodeName": "gpu-0"}
    assert mounting(creating)
    assert not mounting({**pod("demo-0-a", "Running"), "spec": {"nodeName": "gpu-0"}})

    def event(reason, message, at):
        return {"metadata": {"creationTimestamp": at}, "reason": reason, "message": message,
                "lastTimestamp": at}

    events = [
        event("FailedMount", 'MountVolume.SetUp failed for volume "cfg" : configmap '
              '"train-cfg" not found', "2026-11-25T10:00:01Z"),
        event("FailedMount", "Unable to attach or mount volumes: unmounted volumes=[cfg], "
              "unattached volumes=[]: timed out waiting for the condition",
              "2026-11-25T10:02:01Z"),
        event("FailedScheduling", "an older word", "2026-11-25T09:59:00Z")]
    said = mount_failure(creating, events)
    assert said == ('demo-0-a: FailedMount: MountVolume.SetUp failed for volume "cfg" : '
                    'configmap "train-cfg" not found')
    assert mount_failure(creating, events[1:]).endswith("timed out waiting for the condition")
    assert mount_failure(creating, events[2:]) is None
    job = FineTuneJob.model_validate(minimal_job(kubernetes={"volumes": [
        {"name": "cfg", "mountPath": "/cfg", "configMap": {"name": "train-cfg"}}]}))
    assert named_by_field(job, said) == (
        "demo-0-a: namespace default has no ConfigMap 'train-cfg', which "
        "spec.kubernetes.volumes[0] (cfg) names — create it (kubectl create configmap "
        "train-cfg -n default --from-file=...) or name one that exists (kubectl get "
        "configmaps -n default)")
    seen = observe(job_object(), [creating], nodes=1, not_mounted=said)
    assert seen.waiting == said and not seen.running and seen.blocked == "FailedMount"


def test_a_pod_fetching_the_model_says_so():
    """The startup deadline covers a first fetch of a large model: while it runs, the
    status says what the pod is doing rather than PodInitializing."""
    fetching = pod("demo-0-a", "Pending", initContainerStatuses=[
        {"name": "resume-check", "state": {"terminated": {"exitCode": 0}}},
        {"name": "fetch-model", "state": {"running": {"startedAt": "2026-11-21T12:00:00Z"}}}],
        containerStatuses=[{"name": "trainer", "state": {"waiting": {
            "reason": "PodInitializing"}}}])
    assert pod_waiting(fetching) == (
        "demo-0-a: fetching the model into the output volume (fetch-model)")
    seen = observe(job_object(), [fetching], nodes=1)
    assert seen.waiting == pod_waiting(fetching)
    assert seen.blocked is None  # it ends by itself: no Warning event


def failed_by_policy(message: str) -> dict:
    job = job_object()
    job["status"]["conditions"] = [{"type": "Failed", "status": "True",
                                    "reason": "PodFailurePolicy", "message": message}]
    return job


def test_the_jobs_own_record_classifies_a_failure_whose_pod_is_gone():
    """An evicted pod is deleted soon after it fails; the Job's pod failure policy names the
    rule that matched (message as the Job controller of v1.36 writes it, seen on the real
    control plane)."""
    evicted = failed_by_policy("Pod t-1/demo-0-hjdl7 has condition DisruptionTarget matching "
                               "FailJob rule at index 0")
    assert observe(evicted, [], nodes=2).failure.kind == "preempted"
    stopped = failed_by_policy("Container trainer for pod t-1/demo-0-x failed with exit code "
                               "143 matching FailJob rule at index 1")
    assert observe(stopped, [], nodes=2).failure.kind == "stopped"
    assert observe(job_object("Failed"), [], nodes=2).failure.kind == "worker"


def test_a_pod_being_deleted_counts_only_as_a_disruption():
    evicted = pod("demo-0-a", "Failed", conditions=[{
        "type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}],
        **terminated(143))
    evicted["metadata"]["deletionTimestamp"] = "2026-11-22T12:00:00Z"
    assert observe(job_object(), [evicted], nodes=2).failure.kind == "preempted"
    stopped = pod("demo-1-b", "Failed", **terminated(143))
    stopped["metadata"]["deletionTimestamp"] = "2026-11-22T12:00:00Z"
    assert observe(job_object(), [stopped], nodes=2).failure is None


def test_a_suspended_job_is_stopping_while_its_pods_remain():
    going = pod("demo-0-a", "Failed", **terminated(143))
    going["metadata"]["deletionTimestamp"] = "2026-11-22T12:00:00Z"
    assert observe(job_object(suspend=True), [going], nodes=1).stopping
    assert not observe(job_object(suspend=True), [], nodes=1).stopping


def test_pods_the_job_controller_could_not_create_say_why():
    events = [
        {"metadata": {"creationTimestamp": "2026-11-22T12:00:00Z"}, "reason": "FailedCreate",
         "message": 'Error creating: pods "demo-0-a" is forbidden: old'},
        {"metadata": {"creationTimestamp": "2026-11-22T12:00:05Z"}, "reason": "FailedCreate",
         "lastTimestamp": "2026-11-22T12:00:09Z",
         "message": 'Error creating: pods "demo-0-b" is forbidden: no PriorityClass with name '
                    'training-high was found'},
        {"metadata": {"creationTimestamp": "2026-11-22T12:00:07Z"}, "reason": "SuccessfulCreate",
         "message": "Created pod: demo-1-c"},
    ]
    why = creation_failure(events)
    assert why == ('FailedCreate: Error creating: pods "demo-0-b" is forbidden: no '
                   'PriorityClass with name training-high was found')
    seen = observe(job_object(), [], nodes=2, not_created=why)
    assert (seen.waiting, seen.blocked) == (why, "FailedCreate")
    # a pod's own reason says more, and a Job with all its pods needs no events
    assert needs_creation_events(job_object(), [], nodes=2)
    assert not needs_creation_events(job_object(), [pod("a", "Running")] * 2, nodes=2)
    assert not needs_creation_events(job_object(suspend=True), [], nodes=2)
    assert creation_failure(events[2:]) is None


REFUSAL = ("finetune-train: /out holds checkpoints trained with other settings "
           "(method.lora.r: 8 → 16; newest step-00000040), which this job cannot resume from "
           "— set spec.output.uri to a new folder")


def test_a_refusal_of_the_output_folder_is_not_a_worker_failure():
    """Exit 4 of the resume check (an init container, before torchrun) or of the trainer:
    no restart can help, so it is told apart from a failure that might pass."""
    refused = pod("demo-0-a", "Failed", initContainerStatuses=[{
        "name": "resume-check", "state": {"terminated": {
            "exitCode": 4, "reason": "Error", "message": REFUSAL}}}],
        containerStatuses=[{"name": "trainer", "state": {"waiting": {
            "reason": "PodInitializing"}}}])
    failure = pod_failure(refused)
    assert failure.kind == "refused"
    assert failure.message == REFUSAL.removeprefix("finetune-train: ")
    seen = observe(job_object(), [pod("demo-1-b", "Failed", **terminated(1)), refused], 2)
    assert seen.failure.kind == "refused"  # outranks the other worker's failure
    by_policy = failed_by_policy("Container resume-check for pod t-1/demo-0-a failed with "
                                 "exit code 4 matching FailJob rule at index 2")
    assert observe(by_policy, [], nodes=2).failure.kind == "refused"


GATED = ("finetune-train: spec.model.tokenSecretRef: hf://meta-llama/Llama-3.1-8B is gated or "
         "private and no token was given — create a Secret with a hub token of an account "
         "that accepted the model's licence and name it in spec.model.tokenSecretRef")


def test_the_hubs_refusal_of_the_model_fails_the_job_at_once():
    """Exit 2 of fetch-model (no such model or revision, a gated model without a token): a
    restart would only ask again, so it is a refusal, with the fetch's own line."""
    refused = pod("demo-0-a", "Failed", initContainerStatuses=[
        {"name": "resume-check", "state": {"terminated": {"exitCode": 0}}},
        {"name": "fetch-model", "state": {"terminated": {
            "exitCode": 2, "reason": "Error", "message": GATED}}}],
        containerStatuses=[{"name": "trainer", "state": {"waiting": {
            "reason": "PodInitializing"}}}])
    failure = pod_failure(refused)
    assert (failure.kind, failure.reason) == ("refused", "InputRefused")
    assert failure.message == GATED.removeprefix("finetune-train: ")
    by_policy = failed_by_policy("Container fetch-model for pod t-1/demo-0-a failed with "
                                 "exit code 2 matching FailJob rule at index 4")
    failure = observe(by_policy, [], nodes=2).failure
    assert failure.kind == "refused" and "spec.model" in failure.message


def test_an_init_container_that_succeeded_is_not_the_cause():
    ran = pod("demo-0-a", "Failed", initContainerStatuses=[{
        "name": "resume-check", "state": {"terminated": {"exitCode": 0}}}], **terminated(1))
    assert pod_failure(ran).kind == "worker"


def test_a_previous_gangs_pods_do_not_fail_the_new_job():
    """A gang restart recreates the Job under its name: a failed pod of the old Job that is
    still seen (its deletion not yet reported) belongs to another uid and is not a failure
    of the new gang."""
    new = job_object()
    new["metadata"]["uid"] = "uid-2"
    old = pod("demo-1-x", "Failed", **terminated(1, message="CUDA error"))
    old["metadata"]["labels"] = {"batch.kubernetes.io/controller-uid": "uid-1"}
    mine = pod("demo-0-y", "Running")
    mine["metadata"]["labels"] = {"batch.kubernetes.io/controller-uid": "uid-2"}
    seen = observe(new, [old, mine], nodes=1)
    assert seen.failure is None and seen.running
    old["metadata"]["labels"]["batch.kubernetes.io/controller-uid"] = "uid-2"
    assert observe(new, [old, mine], nodes=1).failure.kind == "worker"


def test_the_job_is_named_where_users_look():
    """status.backendRef (kubectl describe, `finetune status`'s "where:") names the Job,
    whatever state it is in."""
    for workload in (job_object(), job_object("Complete"), job_object(suspend=True),
                     job_object(deleting=True)):
        ref = observe(workload, [pod("demo-0-y", "Running")], nodes=1).backend_ref
        assert (ref.kind, ref.name) == ("Job", "demo")
    assert observe(None, [], nodes=1).backend_ref is None


BAD_LINE = ("finetune-train: /data/chats.jsonl:7: is not valid JSON (Expecting ',' delimiter, "
            "column 40) — fix that line, or remove it")


def test_the_trainers_refusal_of_the_data_fails_the_job_at_once():
    """Exit 2 of the trainer container (passed on by finetune_trainer.launch): the model or
    the data cannot be used, on any attempt; the launcher's last line is the message. The
    run itself: tests/backends/test_trainer_pod.py."""
    failure = pod_failure(pod("demo-0-b", "Failed", **terminated(2, message=BAD_LINE)))
    assert (failure.kind, failure.reason) == ("refused", "InputRefused")
    assert failure.message == BAD_LINE.removeprefix("finetune-train: ")
    by_policy = failed_by_policy("Container trainer for pod t-1/demo-0-b failed with "
                                 "exit code 2 matching FailJob rule at index 3")
    failure = observe(by_policy, [], nodes=2).failure
    assert (failure.kind, failure.reason) == ("refused", "InputRefused")
    assert "its log names the field" in failure.message
    assert pod_failure(pod("demo-0-b", "Failed", **terminated(1))).kind == "worker"


UNBUILDABLE = ("finetune-train: op 'deepspeed_shm_comm' could not be built in this image: "
               "/bin/sh: 1: c++: not found (DeepSpeed builds its ops on first use: prebuild it "
               "into the image, or use one that can build it)")


def test_a_worker_that_cannot_set_itself_up_is_said_in_its_own_line():
    """Exit 5 of the trainer container (errors.setup_failure, passed on by the launcher): the
    image's, the same on every rank, marked for one restart at most (reconcile); the message
    is the trainer's line, which names what is missing, not a compiler's command line. It
    outranks a peer's lost connection and another rank's plain failure seen with it, and the
    Job's own record says it once the pods are gone."""
    failure = pod_failure(pod("demo-0-a", "Failed", **terminated(5, message=UNBUILDABLE)))
    assert (failure.kind, failure.setup) == ("worker", True)
    assert failure.message == ("demo-0-a exited 5: "
                               + UNBUILDABLE.removeprefix("finetune-train: "))
    seen = observe(job_object("FailureTarget"), [
        pod("demo-0-a", "Failed", **ended(1, "2026-11-27T10:40:01Z", LOST_PEER)),
        pod("demo-1-b", "Failed", **ended(1, "2026-11-27T10:40:01Z", "rank 1 exited 1: x")),
        pod("demo-2-c", "Failed", **ended(5, "2026-11-27T10:40:02Z", UNBUILDABLE))], nodes=3)
    assert seen.failure.setup and "c++: not found" in seen.failure.message
    by_policy = failed_by_policy("Container trainer for pod t-1/demo-0-a failed with "
                                 "exit code 5 matching FailJob rule at index 4")
    failure = observe(by_policy, [], nodes=2).failure
    assert (failure.kind, failure.setup) == ("worker", True)
    for other in (terminated(1, message="rank 0 exited 1: x"), terminated(137, "OOMKilled")):
        assert not pod_failure(pod("demo-0-a", "Failed", **other)).setup
