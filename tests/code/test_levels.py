"""Each test's level (unit, process, scenario, cluster, kind, gpu) comes from what it uses, so
`pytest -m unit` (`make test-quick`) is a quick loop that starts no process and no cluster."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.support import waits

pytestmark = pytest.mark.process

FILES = ["tests/operator/test_scenarios.py", "tests/operator/test_reconcile.py",
         "tests/operator/test_peering.py", "tests/install/test_install.py",
         "tests/trainer/test_gpu_training.py", "tests/trainer/test_training.py",
         "tests/cli/test_cli.py", "tests/cli/test_local_machine.py"]


LIST_LEVELS = """
import sys, pytest
from tests.conftest import LEVELS
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
                            capture_output=True, text=True, timeout=waits.seconds_left())
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
    assert any(name.startswith("tests/trainer/test_training.py") for name in levels["process"])
    assert any(name.startswith("tests/cli/test_cli.py") for name in levels["process"])
    local = "tests/cli/test_local_machine.py::"  # a module of both
    assert f"{local}test_cpu_instead_of_the_gpu_the_spec_asks_for_is_said" in levels["unit"]
    assert f"{local}test_finetune_run_refuses_it_before_anything_starts" in levels["process"]


GUARDED = """
import subprocess
import pytest

def test_a_unit_test_that_starts_a_process():
    subprocess.run(["true"], check=True)

@pytest.mark.process
def test_a_process_test_that_starts_one():
    subprocess.run(["true"], check=True)

def test_a_unit_test():
    assert True
"""


def pytest_with_our_conftest(test_file) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q",
                           "-p", "no:cacheprovider", "--rootdir", str(test_file.parent),
                           str(test_file)], cwd=REPO, capture_output=True, text=True,
                          timeout=waits.seconds_left())


def test_a_unit_test_that_starts_a_process_fails_naming_it(tmp_path):
    """The levels stay true: a test the quick loop would run starts no process, or fails
    saying what it started and which marker it needs; a test marked twice is refused."""
    guarded = tmp_path / "test_guarded.py"
    guarded.write_text(GUARDED)
    result = pytest_with_our_conftest(guarded)
    assert "1 failed, 2 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]
    assert ("test_guarded.py::test_a_unit_test_that_starts_a_process is a `unit` test but "
            "started a process: subprocess.Popen ['true']. Mark it `process`") in result.stdout

    guarded.write_text("import pytest\n\n@pytest.mark.process\n@pytest.mark.gpu\n"
                       "def test_it():\n    pass\n")
    result = pytest_with_our_conftest(guarded)
    assert result.returncode != 0
    assert "test_it: needs gpu, also marked ['process']" in result.stdout + result.stderr
