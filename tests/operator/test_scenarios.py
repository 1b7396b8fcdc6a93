"""`kubectl apply` to `Succeeded`, and every way in between, with the real kopf operator.

Each scenario runs on KMock's Kubernetes emulator (a simulated kubelet plays the Job
controller, fast), on a real control plane (kube-apiserver with RBAC, the real scheduler and
Job controller, KWOK as the kubelets, the operator a process of its own logged in as the
chart's ServiceAccount: tests/support/cluster_testbed.py), and, when KUBECONFIG and
FINETUNE_E2E_NAMESPACE are set, on that cluster with real trainer pods (see
tests/support/testbed.py): the `[emulator]`, `[control-plane]` and `[kubeconfig]` variants.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from finetune_trainer.record import ProgressRecord
from tests.support.emulator import ApiServer
from tests.support.testbed import Testbed, merged

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.asyncio]
CHILDREN = (("batch/v1/jobs", "demo"), ("v1/services", "demo"), ("v1/configmaps", "demo-trainer"))


def assert_launched_once(testbed: Testbed) -> None:
    """One create of each child reached the API server (where its audit log can tell): the
    create handler and the first timer tick both launched, once (the second answered 409)."""
    for resource, name in (("jobs", "demo"), ("services", "demo"),
                           ("configmaps", "demo-trainer")):
        attempts = testbed.create_attempts(resource, name)
        assert attempts in (None, 1), f"{attempts} creates of {resource}/{name}"


async def test_apply_creates_the_workers_and_reports_progress(testbed: Testbed):
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")

    job = testbed.get("batch/v1/jobs", "demo")
    nodes = testbed.manifest()["spec"]["resources"]["nodes"]
    assert job["spec"]["completions"] == nodes and job["spec"]["completionMode"] == "Indexed"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "finetune_trainer.launch"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PET_NNODES"] == str(nodes)
    assert env["PET_MASTER_ADDR"] == f"demo-0.demo.{testbed.namespace}.svc"
    uid = testbed.ftj()["metadata"]["uid"]
    for kind, name in CHILDREN:
        owner = testbed.get(kind, name)["metadata"]["ownerReferences"][0]
        assert owner["uid"] == uid and owner["controller"] is True
    # its children are owned: the garbage collector removes them, no finalizer holds the job
    assert not testbed.ftj()["metadata"].get("finalizers")
    assert_launched_once(testbed)

    published = await testbed.report_progress("demo")
    await testbed.until(lambda: testbed.status().get("progress", {}).get("step", 0) >= (
        published.step if published else 1), "progress in status")
    progress = testbed.status()["progress"]
    if published is not None:  # the emulator: exactly what rank 0 served
        assert progress["totalSteps"] == 100 and progress["loss"] == 1.25
        assert progress["tokensPerSecond"] == 52000.0 and progress["etaSeconds"] == 600
    else:  # a real trainer: its own figures
        assert progress["totalSteps"] == testbed.manifest()["spec"]["hyperparameters"][
            "maxSteps"]
        assert progress["loss"] > 0 and progress["tokensPerSecond"] > 0
    assert testbed.condition("Validated")["status"] == "True"
    assert testbed.condition("Running")["status"] == "True"

    await testbed.finish("demo")
    await testbed.until_phase("Succeeded")
    assert testbed.status()["completionTime"]
    await testbed.until(lambda: {"Launching", "Running", "Succeeded"} <= set(
        testbed.event_reasons()), "an event for every transition")


async def test_a_run_that_stopped_early_says_why_in_its_status(testbed: Testbed):
    """earlyStoppingPatience: the run ends before its last step and Succeeds. Rank 0's final
    record reaches the status through its pod's termination message (its trainer, and
    /progress with it, are gone by then): the stopping step's figures, the Complete
    condition's reason, and why it stopped, where the status had said `training finished`
    at the last step it polled."""
    doc = testbed.manifest()
    doc["spec"]["dataset"]["evalFraction"] = 0.2
    doc["spec"]["hyperparameters"].update(evalEverySteps=2, earlyStoppingPatience=2,
                                          earlyStoppingThreshold=100.0)
    await testbed.apply(doc)
    await testbed.until_phase("Running")
    total = doc["spec"]["hyperparameters"]["maxSteps"]
    why = (f"stopped early at step 6 of {total}: 2 evaluations in a row did not improve on "
           "the best eval loss, 2.0480 at step 2 by more than 100 "
           "(hyperparameters.earlyStoppingPatience: 2); the export is of step 2, the best "
           "evaluation's")
    await testbed.finish("demo", ProgressRecord(  # where a real trainer stops by itself
        step=6, totalSteps=total, loss=1.9, evalLoss=2.2, phase="Succeeded", stoppedEarly=why))
    await testbed.until_phase("Succeeded")
    status = testbed.status()
    assert status["message"].startswith(f"training stopped early at step 6 of {total}: 2 "
                                        "evaluations in a row did not improve"), status
    assert status["message"].endswith(f"; the model is in {doc['spec']['output']['uri']}/final")
    complete = testbed.condition("Complete")
    assert complete["reason"] == "StoppedEarly" and complete["message"].startswith(
        "stopped early at step 6"), complete
    assert status["progress"]["step"] == 6 and status["progress"]["evalLoss"] > 0
    assert status["progress"]["etaSeconds"] == 0


async def test_a_failed_push_after_training_leaves_the_job_succeeded_and_says_which(
        testbed: Testbed):
    """`output.export`: rank 0 pushes after the last step and its final record says how
    each push went. One refused push: the job still Succeeds (its model is in the folder),
    `Exported` is False naming the target, the registry's words and the fix, and a Warning
    event says it once."""
    doc = testbed.manifest()
    good, bad = "oci://myreg.azurecr.io/adapters/demo:v1", "oci://ghcr.io/team/demo:v1"
    doc["spec"]["output"]["export"] = [{"uri": good}, {"uri": bad}]
    await testbed.apply(doc)
    await testbed.until_phase("Running")
    total = doc["spec"]["hyperparameters"]["maxSteps"]
    await testbed.finish("demo", ProgressRecord(
        step=total, totalSteps=total, loss=1.2, phase="Succeeded", exports=[
            {"uri": good, "pushed": "myreg.azurecr.io/adapters/demo:v1@sha256:" + "a" * 64},
            {"uri": bad, "error": "the registry refused the push (401: unauthorized); "
                                  "give it credentials: secretName"}]))
    await testbed.until_phase("Succeeded")
    exported = testbed.condition("Exported")
    assert exported["status"] == "False" and exported["reason"] == "ExportFailed", exported
    assert exported["message"].startswith(f"{bad}: the registry refused the push (401")
    assert good not in exported["message"]
    assert f"the model is in {doc['spec']['output']['uri']}/final" in exported["message"]
    assert "finetune export" in exported["message"]
    await testbed.until(lambda: "ExportFailed" in testbed.event_reasons(),
                        "an ExportFailed event")
    assert testbed.event_reasons().count("ExportFailed") == 1


async def test_a_worker_failure_restarts_the_gang_and_counts(testbed: Testbed):
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    await testbed.fail_worker("demo", 1, "torch.OutOfMemoryError: CUDA out of memory")
    await testbed.until(lambda: testbed.status().get("restarts") == 1, "restart counted")
    await testbed.until(lambda: testbed.jobs_created("demo") == 2, "a new Job")
    await testbed.until_phase("Running")
    assert testbed.status()["restarts"] == 1
    assert "Restarting" in testbed.event_reasons()


async def test_preemption_restarts_without_using_the_budget(testbed: Testbed):
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    await testbed.preempt_worker("demo", 0)
    await testbed.until(lambda: testbed.jobs_created("demo") == 2, "a new Job")
    await testbed.until_phase("Running")
    assert testbed.status().get("restarts", 0) == 0


async def test_an_exhausted_budget_fails_with_the_cause(testbed: Testbed):
    await testbed.apply(testbed.manifest(runPolicy={"backoffLimit": 0}))
    await testbed.until_phase("Running")
    await testbed.fail_worker("demo", 0, "ValueError: bad batch")
    await testbed.until_phase("Failed")
    assert testbed.condition("Failed")["reason"] == "BackoffLimitExceeded"
    assert "ValueError: bad batch" in testbed.status()["message"]
    await testbed.until(lambda: testbed.get("batch/v1/jobs", "demo") is None, "workers stopped")


async def test_a_refused_output_folder_fails_at_once_and_keeps_the_budget(testbed: Testbed):
    """The trainer's resume check (exit 4): the output folder holds checkpoints trained with
    other settings. Restarting would refuse again, so the job fails, saying why."""
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    await testbed.fail_worker("demo", 0, (
        "finetune-train: /out holds checkpoints trained with other settings (method.lora.r: "
        "8 → 16; newest step-00000040), which this job cannot resume from — set "
        "spec.output.uri to a new folder, or move its checkpoints/ away to start over"),
        exit_code=4)
    await testbed.until_phase("Failed")
    failed = testbed.condition("Failed")
    assert failed["reason"] == "OtherSettingsCheckpoints"
    assert "method.lora.r: 8 → 16" in failed["message"]
    assert "set spec.output.uri to a new folder" in testbed.status()["message"]
    assert testbed.status().get("restarts", 0) == 0
    assert testbed.jobs_created("demo") == 1


async def test_pods_stuck_past_the_startup_deadline_fail_with_their_reason(testbed: Testbed):
    """The deadline is shortened (runPolicy may change after launch) once the pods say why
    they wait: a deadline of a few seconds set at apply passed, on a busy machine, before
    the kubelet had said anything, and the job failed without the reason."""
    await testbed.apply(merged(testbed.unpullable(testbed.manifest()),
                               {"runPolicy": {"startupDeadlineSeconds": 3600}}))
    await testbed.until(lambda: "spec.kubernetes.image" in testbed.status().get("message", ""),
                        "waiting on the image pull")
    await testbed.patch_spec("demo", {"runPolicy": {"startupDeadlineSeconds": 1}})
    await testbed.until_phase("Failed")
    assert "ImagePull" in testbed.status()["message"]  # ImagePullBackOff or ErrImagePull
    # resume-check runs first in the trainer's image: the kubelet says only PodInitializing
    # of the trainer, and the init container's reason is the one a user needs
    assert "(init container resume-check)" in testbed.status()["message"]
    assert "spec.kubernetes.image" in testbed.status()["message"]  # where the image is set
    assert testbed.condition("Failed")["reason"] == "StartupDeadlineExceeded"


async def test_the_fix_a_waiting_job_asks_for_relaunches_its_workers(testbed: Testbed):
    """ErrImagePull names spec.kubernetes.image as what to check; the fixed image was
    refused as a change after launch, and the job waited out its startup deadline and
    failed. No worker has run, so the edit relaunches them with it."""
    await testbed.apply(merged(testbed.unpullable(testbed.manifest()),
                               {"runPolicy": {"startupDeadlineSeconds": 120}}))
    await testbed.until(lambda: "spec.kubernetes.image" in testbed.status().get("message", ""),
                        "waiting on the image pull")
    image = testbed.manifest()["spec"].get("kubernetes", {}).get("image")  # None: the default
    await testbed.patch_spec("demo", {"kubernetes": {"image": image},
                                      "hyperparameters": {"learningRate": 0.005}})
    await testbed.until(lambda: testbed.jobs_created("demo") == 2, "the workers relaunched")
    # only now, where the test plays the kubelet: its stuck pull held every pod, the old
    # Job's too, which ran when it let go first on a busy machine (Running, no relaunch yet)
    testbed.pulls_again()
    await testbed.until_phase("Running")
    assert testbed.jobs_created("demo") == 2
    template = testbed.get("batch/v1/jobs", "demo")["spec"]["template"]["spec"]
    assert "registry.invalid" not in json.dumps(template)
    config = testbed.get("v1/configmaps", "demo-trainer")["data"]
    assert "0.005" in json.dumps(config)  # the trainer config relaunched with the edit
    assert "SpecChangeApplied" in testbed.event_reasons()
    assert "SpecChangeRefused" not in {c["type"] for c in testbed.status()["conditions"]}
    assert testbed.status().get("restarts", 0) == 0


async def test_suspend_and_resume(testbed: Testbed):
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    await testbed.patch_spec("demo", {"runPolicy": {"suspend": True}})
    await testbed.until_phase("Suspended")
    await testbed.until(lambda: testbed.get("batch/v1/jobs", "demo")["spec"]["suspend"],
                        "the Job suspended")
    await testbed.until(lambda: not testbed.running_pods("demo"), "pods stopped")
    await testbed.patch_spec("demo", {"runPolicy": {"suspend": False}})
    await testbed.until_phase("Running")
    assert testbed.jobs_created("demo") == 1  # the same Job, unsuspended


async def test_a_refused_edit_never_reaches_the_workers(testbed: Testbed):
    """Nodes and learning rate edited after launch: refused, and kept out of every later
    step. The running gang was judged against the edited node count (and killed as `workers
    did not start`), and a gang restart relaunched the edited Job beside the launched
    ConfigMap, the refusal then reading `SpecMatchesLaunch`."""
    await testbed.apply(testbed.manifest(runPolicy={"startupDeadlineSeconds": 8}))
    await testbed.until_phase("Running")
    nodes = testbed.manifest()["spec"]["resources"]["nodes"]
    config = testbed.get("v1/configmaps", "demo-trainer")["data"]
    await testbed.patch_spec("demo", {"resources": {"nodes": nodes + 1},
                                      "hyperparameters": {"learningRate": 0.005}})
    await testbed.until(lambda: testbed.condition("SpecChangeRefused").get("status") == "True",
                        "the edit refused")
    await asyncio.sleep(10)  # past the startup deadline
    assert testbed.status()["phase"] == "Running", testbed.status()
    await testbed.fail_worker("demo", 0, "RuntimeError: NCCL watchdog timeout")
    await testbed.until(lambda: testbed.jobs_created("demo") == 2, "the gang restarted")
    await testbed.until_phase("Running")
    assert testbed.get("batch/v1/jobs", "demo")["spec"]["completions"] == nodes
    assert testbed.get("v1/configmaps", "demo-trainer")["data"] == config
    refused = testbed.condition("SpecChangeRefused")
    assert refused["status"] == "True" and "spec.hyperparameters" in refused["message"]


async def test_delete_removes_the_children(testbed: Testbed):
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    await testbed.delete("demo")
    await testbed.until(lambda: testbed.ftj() is None, "FineTuneJob gone")
    for kind, name in CHILDREN:  # owned: the garbage collector removes them
        await testbed.until(lambda kind=kind, name=name: testbed.get(kind, name) is None, kind)


async def test_a_job_made_again_under_its_name_gets_workers_of_its_own(testbed: Testbed):
    """No finalizer holds a deleted job: made again at once, it finds the old job's children
    still there (the garbage collector takes them a moment later) and must neither adopt
    them nor be left without workers."""
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    old = testbed.ftj()["metadata"]["uid"]
    held = testbed.hold_garbage_collection(True)  # a slow collector, where the test plays it
    await testbed.delete("demo")
    await testbed.until(lambda: testbed.ftj() is None, "the first job gone")
    await testbed.apply(testbed.manifest())
    if held:
        await testbed.until(lambda: testbed.status().get("message", "").startswith(
            "waiting for the workers of a deleted job of this name to stop and go (Job demo"),
            "the new job waiting for the old one's workers to go")
        status = testbed.status()
        assert not status.get("launchedSpec"), "the old job's workers adopted"
        assert status.get("phase") == "Pending", status  # not a blank phase while it waits
        testbed.hold_garbage_collection(False)
    await testbed.until_phase("Running")
    new = testbed.ftj()["metadata"]["uid"]
    assert new != old
    for kind, name in CHILDREN:
        owner = testbed.get(kind, name)["metadata"]["ownerReferences"][0]["uid"]
        assert owner == new, f"{kind} {name} belongs to the deleted job"
    assert testbed.jobs_created("demo") == 2


async def test_an_operator_restart_adopts_and_creates_nothing_twice(testbed: Testbed):
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    await testbed.kill_operator()
    await testbed.start_operator()
    await testbed.finish("demo")
    await testbed.until_phase("Succeeded")
    assert testbed.jobs_created("demo") == 1
    assert testbed.status().get("restarts", 0) == 0
    assert_launched_once(testbed)


async def test_a_second_job_on_one_output_folder_is_refused_naming_the_first(
        testbed: Testbed):
    """#58: two FineTuneJobs writing one folder resume each other's checkpoints or replace
    each other's model. The second is refused before it launches, naming the first; given a
    folder of its own, it is admitted and launched."""
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    await testbed.apply(testbed.manifest("second", output={"uri": "pvc://ckpt/demo"}))
    await testbed.until_phase("Failed", name="second")
    failed = testbed.condition("Failed", name="second")
    assert failed["reason"] == "OutputInUse"
    assert (f"spec.output.uri pvc://ckpt/demo is the output folder of FineTuneJob "
            f"{testbed.namespace}/demo (Running)") in failed["message"]
    assert testbed.get("batch/v1/jobs", "second") is None
    assert testbed.status()["phase"] == "Running"  # the first is left alone
    await testbed.patch_spec("second", {"output": {"uri": "pvc://ckpt/second"}})
    await testbed.until(lambda: testbed.status("second").get("launchedSpec"),
                        "the second launched in its own folder")
    assert testbed.get("batch/v1/jobs", "second") is not None
    assert testbed.condition("Failed", name="second")["status"] == "False"


async def test_invalid_spec_is_refused_with_a_condition(testbed: Testbed):
    await testbed.apply(testbed.manifest(dataset={"uri": "./local/train.jsonl"}))
    await testbed.until_phase("Failed")
    validated = testbed.condition("Validated")
    assert validated["status"] == "False"
    assert "spec.dataset.uri: relative locations cannot be reached from pods" in (
        validated["message"])
    assert testbed.get("batch/v1/jobs", "demo") is None


async def test_an_unknown_backend_is_refused_naming_the_installed_ones(testbed: Testbed):
    await testbed.apply(testbed.manifest(backend="slurm"))
    await testbed.until_phase("Failed")
    validated = testbed.condition("Validated")
    assert validated["status"] == "False"
    assert "spec.backend: 'slurm' is not an installed backend — use one of: azureml, " \
           "kubernetes" in validated["message"]
    assert testbed.get("batch/v1/jobs", "demo") is None


async def test_many_jobs_at_once_all_run(testbed: Testbed):
    if testbed.real:
        pytest.skip("50 jobs measure the operator, not a real cluster's capacity: "
                    "emulator only")
    operator = testbed.operator
    await operator.stop()
    operator.runtime.interval = 3.0  # 50 jobs: look at each every few seconds, as in production
    await operator.start()
    names = [f"job-{i:02d}" for i in range(50)]
    for name in names:
        await testbed.apply(testbed.manifest(name, resources={"nodes": 1, "gpusPerNode": 1}))
    await testbed.until(lambda: all(testbed.status(n).get("phase") == "Running" for n in names),
                        "all 50 Running")
    assert sorted(n for n in names if testbed.jobs_created(n) == 1) == names
