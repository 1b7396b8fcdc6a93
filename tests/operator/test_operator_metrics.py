"""The operator's /metrics while it runs jobs: scraped over HTTP as Prometheus would."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import waits
from tests.support.emulator import ApiServer

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.asyncio, pytest.mark.timeout(300)]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                timeout=waits.seconds_left()) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_a_restart_and_the_phases_show_on_the_metrics_endpoint(emulated_testbed):
    testbed = emulated_testbed
    port = testbed.operator.runtime.metrics.serve(0, host="127.0.0.1")
    await testbed.apply(testbed.manifest())
    await testbed.until_phase("Running")
    await testbed.fail_worker("demo", 1, "RuntimeError: NCCL error")
    await testbed.until(lambda: testbed.status().get("restarts") == 1, "restart counted")
    await testbed.until_phase("Running")

    got = scrape(port)
    kubernetes = ("backend", "kubernetes")
    assert got[("finetune_operator_jobs", (kubernetes, ("phase", "Running")))] == 1
    assert got[("finetune_operator_restarts_total", (kubernetes, ("cause", "worker")))] == 1
    assert got[("finetune_operator_restarts_total", (kubernetes, ("cause", "preempted")))] == 0
    assert got[("finetune_operator_time_to_running_seconds_count", (kubernetes,))] == 1
    assert got[("finetune_operator_reconcile_duration_seconds_count", (kubernetes,))] >= 3

    await testbed.delete("demo")
    await testbed.until(lambda: testbed.ftj() is None, "deleted")
    await testbed.until(lambda: scrape(port)[("finetune_operator_jobs", (
        kubernetes, ("phase", "Running")))] == 0, "the deletion seen by the watch")
