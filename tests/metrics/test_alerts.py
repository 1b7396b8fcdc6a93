"""The chart's alert rules (rules/finetune-alerts.yaml): promtool checks them and runs their
unit tests (alerts_test.yaml), where every alert is shown firing and not firing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import waits
from tests.support.monitoring import PROMTOOL, RULES, alerts

pytestmark = pytest.mark.process

ALERTS_TEST = Path(__file__).with_name("alerts_test.yaml")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not on PATH (CI installs it; Debian/Ubuntu: "
    "apt-get install prometheus)")
EXPECTED = {"FineTuneJobStalled", "FineTuneGPUUtilizationLow",
            "FineTuneCollectiveBandwidthLow", "FineTuneSlowNode", "FineTuneRestartStorm",
            "FineTuneJobFailed"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True,
                          timeout=waits.seconds_left(),
                          cwd=ALERTS_TEST.parent)


@needs_promtool
def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


@needs_promtool
def test_every_alert_fires_and_stays_quiet_as_its_unit_tests_say():
    result = promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_unit_tests_show_every_alert_both_firing_and_not():
    cases = [case for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"]
             for case in test.get("alert_rule_test", [])]
    for alert in alerts():
        mine = [case for case in cases if case["alertname"] == alert["alert"]]
        assert any(case.get("exp_alerts") for case in mine), f"{alert['alert']} never fires"
        assert any(not case.get("exp_alerts") for case in mine), \
            f"{alert['alert']} is never shown quiet"


def test_every_alert_says_how_bad_which_job_and_what_to_do():
    assert {alert["alert"] for alert in alerts()} == EXPECTED
    for alert in alerts():
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}, alert["alert"]
        assert "for" in alert, alert["alert"]
        annotations = alert["annotations"]
        assert set(annotations) >= {"summary", "description"}, alert["alert"]
        for text in annotations.values():
            assert "$labels.namespace" in text, (alert["alert"], text)
            assert "$labels.job" in text or "$labels.finetunejob" in text, (alert["alert"], text)
