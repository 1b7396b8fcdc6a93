"""Each test's level (unit, scenario, cluster, kind, gpu) comes from what it uses, so
`pytest -m unit` is a quick loop that starts no cluster and no operator."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

FILES = ["tests/operator/test_scenarios.py", "tests/operator/test_reconcile.py",
         "tests/operator/test_peering.py", "tests/install/test_install.py",
         "tests/trainer/test_gpu_training.py"]


LIST_LEVELS = """
import sys, pytest
LEVELS = ("unit", "scenario", "cluster", "kind", "gpu")
class Levels:
    def pytest_collection_finish(self, session):
        for item in session.items:
            marked = [m for m in LEVELS if item.get_closest_marker(m)]
            print("LEVEL", item.nodeid, ",".join(marked))
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]],
                     plugins=[Levels()]))
"""


def collected() -> dict[str, set[str]]:
    """level → the node ids `make test` would give that level (one collection, as pytest
    makes it, with this repository's conftest)."""
    result = subprocess.run([sys.executable, "-c", LIST_LEVELS, *FILES], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    levels: dict[str, set[str]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("LEVEL "):
            _, node, marked = line.split(" ", 2)
            assert "," not in marked and marked, f"{node}: one level each, got {marked!r}"
            levels.setdefault(marked, set()).add(node)
    return levels


def test_levels_follow_the_fixtures_and_markers_a_test_uses():
    levels = collected()
    scenario = "tests/operator/test_scenarios.py::test_invalid_spec_is_refused_with_a_condition"
    assert f"{scenario}[emulator]" in levels["scenario"]
    assert f"{scenario}[control-plane]" in levels["cluster"]
    assert f"{scenario}[kubeconfig]" in levels["kind"]
    assert any(name.startswith("tests/operator/test_reconcile.py") for name in levels["unit"])
    assert not any(name.startswith("tests/operator/test_scenarios.py") for name in levels["unit"])
    assert any(name.startswith("tests/operator/test_peering.py") for name in levels["scenario"])
    assert any(name.startswith("tests/install/test_install.py") for name in levels["cluster"])
    assert levels["gpu"] and all("test_gpu_training" in name for name in levels["gpu"])
