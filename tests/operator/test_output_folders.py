"""One output folder, one live job: which job holds a folder, how each backend names one, and
what the reconciler does with a job whose folder another holds (#58)."""

from __future__ import annotations

import pytest

from finetune_operator.api import FineTuneJobStatus
from finetune_operator.backends.azureml.backend import output_folder as azureml_folder
from finetune_operator.backends.kubernetes.backend import output_folder as kubernetes_folder
from finetune_operator.output_folders import OutputUser, holder
from finetune_operator.reconcile import Observation, condition, reconcile
from finetune_operator.validation import parse_job
from tests.conftest import minimal_job
from tests.operator.test_reconcile import T0, at, job, kinds, launched

pytestmark = pytest.mark.unit


def user(name: str, created: str = "2026-11-27T10:00:00Z", launched: bool = False,
         phase: str | None = None, namespace: str = "ml") -> OutputUser:
    return OutputUser(namespace, name, created, launched, phase)


@pytest.mark.parametrize(("me", "others", "held_by"), [
    pytest.param(user("b", "2026-11-27T10:00:05Z"), [user("a")], "a", id="the older holds"),
    pytest.param(user("a"), [user("b", "2026-11-27T10:00:05Z")], None, id="the older goes on"),
    pytest.param(user("b"), [user("a")], "a", id="same second: by name"),
    pytest.param(user("a"), [user("z", "2026-11-27T11:00:00Z", launched=True, phase="Running")],
                 "z", id="a launched one holds, however young"),
    pytest.param(user("b", launched=True, phase="Running"),
                 [user("a", launched=True, phase="Running")], None,
                 id="launched already: its workers own it"),
    pytest.param(user("b", "2026-11-27T10:00:05Z"), [user("a", phase="Succeeded")], None,
                 id="an ended job holds nothing"),
    pytest.param(user("b", "2026-11-27T10:00:05Z"), [user("a", phase="Failed")], None,
                 id="nor a refused one"),
    pytest.param(user("b"), [user("b")], None, id="not held by itself"),
    pytest.param(user("c", "2026-11-27T10:00:09Z"),
                 [user("b", "2026-11-27T10:00:05Z", phase="Pending"),
                  user("a", "2026-11-27T10:00:07Z", launched=True, phase="Running")],
                 "a", id="the one it names is the first holder"),
])
def test_the_job_that_holds_a_folder(me, others, held_by):
    found = holder(me, others)
    assert (found.name if found else None) == held_by


def k8s(uri: str, namespace: str = "ml", **spec) -> str | None:
    doc = minimal_job(output={"uri": uri}, **spec)
    doc["metadata"]["namespace"] = namespace
    return kubernetes_folder(parse_job(doc))


def test_kubernetes_names_a_folder_by_claim_and_path_in_the_namespace():
    assert k8s("pvc://ckpt/runs/a") == k8s("pvc://ckpt/runs/a/") == k8s("pvc://ckpt/runs/./a")
    assert k8s("pvc://ckpt/runs/a") != k8s("pvc://ckpt/runs/b")
    assert k8s("pvc://ckpt/runs/a") != k8s("pvc://ckpt/runs/a", namespace="other")
    assert k8s("pvc://ckpt") == k8s("pvc://ckpt/")
    # an absolute path is on a claim only where spec.kubernetes.volumes mounts one there
    on_claim = {"volumes": [{"name": "out", "mountPath": "/mnt/out",
                             "persistentVolumeClaim": {"claimName": "ckpt"}}]}
    assert k8s("/mnt/out/runs/a", kubernetes=on_claim) == k8s("pvc://ckpt/runs/a")
    assert k8s("/mnt/outside/a", kubernetes=on_claim) is None
    assert k8s("/tmp/out") is None  # the pod's own disk: no other job's


def aml(uri: str, workspace: str = "ws") -> str | None:
    azure = {"subscriptionId": "00000000-0000-0000-0000-000000000001",
             "resourceGroup": "RG", "workspace": workspace, "compute": "gpu"}
    return azureml_folder(parse_job(minimal_job(backend="azureml", azureml=azure,
                                                model={"uri": "hf://org/m"},
                                                dataset={"uri": "https://x/d.jsonl"},
                                                output={"uri": uri})))


def test_azureml_names_a_folder_by_workspace_datastore_and_path():
    short = aml("azureml://datastores/workspaceblobstore/paths/runs/a")
    assert short == aml("azureml://datastores/WorkspaceBlobStore/paths/runs/a/")
    assert short == aml("azureml://subscriptions/00000000-0000-0000-0000-000000000001/"
                        "resourcegroups/rg/workspaces/WS/datastores/workspaceblobstore/"
                        "paths/runs/a", workspace="elsewhere")
    assert short != aml("azureml://datastores/workspaceblobstore/paths/runs/A")
    assert short != aml("azureml://datastores/workspaceblobstore/paths/runs/a", "other-ws")


def test_a_job_whose_folder_another_holds_fails_naming_it_until_its_spec_is_edited():
    held = reconcile(job(), Observation(), T0, output_holder="ml/first (Running)")
    assert kinds(held) == [] and held.status.phase == "Failed"
    failed = condition(held.status, "Failed")
    assert failed.reason == "OutputInUse"
    assert failed.message == (
        "spec.output.uri pvc://ckpt/demo is the output folder of FineTuneJob ml/first "
        "(Running) — give this job a folder of its own (another spec.output.uri); to train "
        "on from that job's checkpoints, once it has ended delete this job and apply it "
        "again (`kubectl delete ftj demo -n default`, then `kubectl apply -f` its manifest)")
    assert condition(held.status, "Validated").status == "True"  # valid: only not now
    assert [(e.type, e.reason) for e in held.events] == [("Warning", "Failed")]
    # looked at again (the other still there, or gone; the same manifest applied again is
    # `unchanged`, no new generation): it stays refused, quietly, as its message says
    again = reconcile(job(held.status), Observation(), at(5))
    assert again.status.phase == "Failed" and kinds(again) == [] and again.events == []
    # its output edited: admitted again, and launched where nothing else holds the folder
    edited = reconcile(job(held.status, generation=2, output={"uri": "pvc://ckpt/mine"}),
                       Observation(), at(10))
    assert kinds(edited) == ["launch"] and edited.status.phase == "Launching"


def test_a_launched_job_is_never_refused_for_its_folder():
    running = reconcile(job(launched("Running")), Observation(exists=True, running=True),
                        at(30), output_holder="ml/other (Pending)")
    assert running.status.phase == "Running" and condition(running.status, "Failed") is None


def test_a_job_refused_for_other_reasons_keeps_that_reason():
    status = FineTuneJobStatus()
    d = reconcile(job(status), Observation(), T0, problems=["spec.x: bad — fix it"],
                  output_holder="ml/other (Running)")
    assert condition(d.status, "Failed").reason == "InvalidSpec"
