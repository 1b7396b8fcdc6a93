"""`make bench-operator` runs: a small burst through the same script, each operator (ours paced
and unpaced) on a control plane of its own. (The figures come from the full run; here only
that it measures, and that no launch was made twice under load.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.support import waits
from tests.support.cluster_fixtures import missing_tools

pytestmark = pytest.mark.cluster


def test_the_operator_load_benchmark_measures_both_side_by_side(tmp_path):
    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "load.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "operator_load.py"),
                             "--jobs", "10", "--steady", "2", "--out", str(out)],
                            capture_output=True, text=True, timeout=waits.seconds_left())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "seconds until every job has a phase" in result.stdout
    (figures,) = json.loads(out.read_text())["runs"]
    assert figures["jobs"] == 10
    for side in ("floor", "launcher", "ours", "ours_unpaced"):
        assert figures[side]["seconds_to_all_phased"] > 0
        assert figures[side]["peak_rss_mib"] > 20
    assert figures["floor"]["api_requests_per_job"] >= 1  # at least its status patch
    for ours in ("ours", "ours_unpaced"):
        assert figures[ours]["child_creates_refused_409"] == 0  # each job launched once
        # and none was launched again while its namespace went (a 403 and an Error event)
        assert figures[ours]["errors_logged"] == 0
        assert figures[ours]["api_requests_by_kind"]["create jobs"] == 1
        # 10 jobs launch at once (within --launch-burst): three creates, the status patch
        # and the Launching event each (a Retrying event under load may add to that)
        assert 5 <= figures[ours]["api_requests_to_launch_a_job"] <= 6
    # the launcher created the same three children per job that ours did
    assert figures["launcher"]["api_requests_by_kind"]["create jobs"] == 1
    # its own CPU time while nothing changes (robust to a busy machine): near 0 when it
    # waits on watches; a poll or spin loop would hold most of a core
    for ours in ("ours", "ours_unpaced"):
        assert 0 <= figures[ours]["steady_cpu_percent"] < 50
    assert figures["ratios"]["peak_rss_mib"] == round(
        figures["ours"]["peak_rss_mib"] / figures["floor"]["peak_rss_mib"], 2)
    assert figures["unpaced_ratios_to_launcher"]["seconds_to_all_launched"] == round(
        figures["ours_unpaced"]["seconds_to_all_launched"]
        / figures["launcher"]["seconds_to_all_launched"], 2)
