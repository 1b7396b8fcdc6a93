"""The Argo CD health checks the chart ships (charts/finetune-operator/argocd/) on statuses
built from the API's own types, every phase among them (tests/support/argocd.py runs them as
Argo CD does); tests/e2e/test_real_pods.py runs them on statuses the operator wrote."""

from __future__ import annotations

import subprocess
import typing

import pytest
import yaml

from finetune_operator.api import (
    Condition,
    FineTuneJobStatus,
    FineTuneSweepStatus,
    Phase,
    Progress,
)
from finetune_operator.reasons import (
    ConditionType,
    DegradedReason,
    ExportedReason,
    SpecChangeRefusedReason,
)
from tests.support.argocd import HEALTH_PATCH, argo_health

EXPECTED = {"Pending": "Progressing", "Queued": "Progressing", "Launching": "Progressing",
            "Running": "Progressing", "Restarting": "Progressing", "Suspended": "Suspended",
            "Succeeded": "Healthy", "Failed": "Degraded"}


def health(kind: str, status: FineTuneJobStatus | FineTuneSweepStatus | None) -> dict:
    obj = {"apiVersion": "finetune.dev/v1alpha1", "kind": kind, "metadata": {"name": "x"}}
    if status is not None:
        obj["status"] = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    return argo_health(obj)


@pytest.mark.unit
def test_every_phase_of_a_job_has_its_argo_cd_health():
    assert set(EXPECTED) == set(typing.get_args(Phase))  # a new phase needs its health
    for phase, expected in EXPECTED.items():
        said = health("FineTuneJob", FineTuneJobStatus(phase=phase, message=f"{phase} now"))
        assert said == {"status": expected, "message": f"{phase} now"}, phase
    assert health("FineTuneJob", None)["status"] == "Progressing"
    assert health("FineTuneJob", FineTuneJobStatus())["status"] == "Progressing"


@pytest.mark.unit
def test_a_running_job_says_its_step_and_a_refused_edit_is_degraded():
    running = FineTuneJobStatus(phase="Running", message="training",
                                progress=Progress(step=120, total_steps=1000))
    assert health("FineTuneJob", running) == {"status": "Progressing",
                                              "message": "training (step 120/1000)"}
    refused = Condition(type=ConditionType.SPEC_CHANGE_REFUSED, status="True",
                        reason=SpecChangeRefusedReason.IMMUTABLE_AFTER_LAUNCH,
                        message="spec.model changed after launch")
    running.conditions = [refused]
    assert health("FineTuneJob", running) == {
        "status": "Degraded",
        "message": "ImmutableAfterLaunch: spec.model changed after launch"}
    refused.status = "False"
    assert health("FineTuneJob", running)["status"] == "Progressing"
    running.conditions = [Condition(type=ConditionType.DEGRADED, status="True",
                                    reason=DegradedReason.BACKEND_UNREACHABLE, message="")]
    assert health("FineTuneJob", running) == {"status": "Degraded",
                                              "message": "BackendUnreachable"}


@pytest.mark.unit
def test_a_trained_job_whose_export_failed_is_degraded():
    done = FineTuneJobStatus(phase="Succeeded", message="trained")
    done.conditions = [Condition(type=ConditionType.EXPORTED, status="True",
                                 reason=ExportedReason.PUSHED, message="pushed oci://r/m:1")]
    assert health("FineTuneJob", done) == {"status": "Healthy", "message": "trained"}
    done.conditions = [Condition(type=ConditionType.EXPORTED, status="False",
                                 reason=ExportedReason.EXPORT_FAILED, message="oci://r/m:1: 401")]
    assert health("FineTuneJob", done) == {
        "status": "Degraded", "message": "Trained, not exported: ExportFailed: oci://r/m:1: 401"}


@pytest.mark.unit
def test_every_phase_of_a_sweep_has_its_argo_cd_health():
    phases = typing.get_args(typing.get_args(FineTuneSweepStatus.model_fields["phase"]
                                             .annotation)[0])
    expected = {"Running": "Progressing", "Succeeded": "Healthy", "Failed": "Degraded"}
    assert set(phases) == set(expected)
    for phase, status in expected.items():
        assert health("FineTuneSweep", FineTuneSweepStatus(phase=phase))["status"] == status
    running = FineTuneSweepStatus(phase="Running", message="searching", trial_count=5,
                                  running_trials=2)
    assert health("FineTuneSweep", running)["message"] == "searching (5 trials made, 2 running)"
    assert health("FineTuneSweep", None)["status"] == "Progressing"


@pytest.mark.process
def test_the_documented_patch_merges_into_argocd_cm_with_kubectl(kubectl_cli, tmp_path):
    """The README's command, `kubectl patch --type merge --patch-file`, run by the real
    kubectl on a ConfigMap like Argo CD's (`--local`: no cluster); what it already held
    stays."""
    config_map = tmp_path / "argocd-cm.yaml"
    config_map.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: argocd-cm\n"
                          "  namespace: argocd\ndata:\n  url: https://argocd.example\n")
    done = subprocess.run([str(kubectl_cli), "patch", "--local", "-f", str(config_map),
                           "--type", "merge", "--patch-file", str(HEALTH_PATCH), "-o", "yaml"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = yaml.safe_load(done.stdout)["data"]
    assert data["url"] == "https://argocd.example"
    assert data == {**yaml.safe_load(HEALTH_PATCH.read_text())["data"],
                    "url": "https://argocd.example"}
