"""Shared fixtures: the repository's examples, the generated CRD, and manifest builders.

Tests are grouped by the component they check (api, cli, backends, operator, planner,
trainer, metrics, install, code); what they need to run is their level, one marker each, set
here from the markers and fixtures they use:

- `unit`: nothing but this process (no process of its own, no cluster): `make test-quick`;
- `process`: processes of its own on this machine (the CLI as a user runs it, torchrun and
  its workers, helm, pip), marked so in its module or on the test;
- `scenario`: the real operator against the emulator;
- `cluster`: the real control plane (one a session: its tests share a pytest-xdist worker);
- `kind`: a cluster of your own (KUBECONFIG); `gpu`: a CUDA GPU.

A `unit` test that starts a process fails, naming it: the quick loop stays quick and the
markers stay true. `make test` runs every level this machine can."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

# Three pytest-xdist workers share two cores (the Makefile's PYTEST_WORKERS): a process that
# takes every core for its OpenMP threads (torch's default, and `finetune run`'s for a job of
# one process) spins against the others' threads, and a 10-second run of one process took
# 200 s beside two others. One thread each, unless set already (before torch is imported).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# the real control plane's fixtures (control_plane, installation, operator_process, ...) and
# the emulated cluster's (cluster, kubelet, operator, rank0, testbed). They need the
# operator's stack; a GPU machine given only the trainer's wheels (scripts/gpu-wheels.sh)
# lacks it and runs the trainer's tests without them.
try:
    import kmock  # noqa: F401
    import kopf  # noqa: F401
    import pytest_asyncio  # noqa: F401

    pytest_plugins = ["tests.support.shared", "tests.support.cluster_fixtures",
                      "tests.support.operator_fixtures"]
except ImportError:
    pytest_plugins = ["tests.support.shared"]

LEVELS = ("unit", "process", "scenario", "cluster", "kind", "gpu")
CLUSTER_FIXTURES = {"control_plane", "installation", "operator_process",
                    "control_plane_testbed"}
SCENARIO_FIXTURES = {"kmock", "cluster", "kubelet", "operator", "emulated_testbed"}
PROCESS_FIXTURES = {"operator_install"}
TESTBED_LEVELS = {"emulator": "scenario", "control-plane": "cluster", "kubeconfig": "kind"}


def level(item: pytest.Item) -> str:
    """What a test needs to run: the highest of the level it is marked with (on the test or
    its module) and what the fixtures it asks for need; `unit` when neither says more."""
    marked = [m.name for m in item.iter_markers() if m.name in LEVELS]
    testbed = getattr(item, "callspec", None) and item.callspec.params.get("testbed")
    names = set(getattr(item, "fixturenames", ()))
    needs = TESTBED_LEVELS.get(testbed) or ("cluster" if names & CLUSTER_FIXTURES else
                                            "scenario" if names & SCENARIO_FIXTURES else
                                            "process" if names & PROCESS_FIXTURES else "unit")
    return max([*marked, needs], key=LEVELS.index)


REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml")
                  if "kind: FineTuneJob" in p.read_text())
CLUSTER_EXAMPLES = [p for p in EXAMPLES if not any(
    yaml.safe_load(p.read_text())["spec"][section]["uri"].startswith(".")
    for section in ("model", "dataset"))]
"""The examples a cluster can run (01, 08 and 09 name paths relative to their file:
`finetune run` only)."""
SWEEP_EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml")
                        if "kind: FineTuneSweep" in p.read_text())


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="session")
def committed_crd() -> dict[str, Any]:
    return load_yaml(REPO / "crds" / "finetunejobs.finetune.dev.yaml")


def minimal_job(**spec_overrides: Any) -> dict[str, Any]:
    """The smallest valid FineTuneJob; tests change one thing at a time."""
    job = {
        "apiVersion": "finetune.dev/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": "demo"},
        "spec": {
            "model": {"uri": "hf://Qwen/Qwen2.5-0.5B"},
            "dataset": {"uri": "pvc://data/train.jsonl"},
            "hyperparameters": {"maxSteps": 10},
            "output": {"uri": "pvc://ckpt/demo"},
        },
    }
    job["spec"].update(copy.deepcopy(spec_overrides))
    return job


@pytest.fixture(scope="session")
def kubectl_cli() -> Path:
    """The real kubectl, built from its Go module beside the control plane (what `make
    cluster-bin` built): `--local` commands of it need no cluster."""
    import shutil

    if shutil.which("go") is None:
        pytest.skip("kubectl is built from its Go module beside the control plane: no Go")
    sys.path.insert(0, str(REPO / "cluster"))
    import controlplane

    return controlplane.build() / "kubectl"


@pytest.fixture(scope="session")
def tiny_model_dir(shared) -> Path:
    """A tiny Llama and its tokenizer, saved with save_pretrained (nothing downloaded); one
    for the session, so that runs of the same manifest on two workers are one run."""
    from finetune_trainer.tiny import build_tiny_llama, corpus_from_jsonl

    def build(out: Path) -> None:
        build_tiny_llama(out, corpus_from_jsonl(REPO / "examples/data/tiny-chat.jsonl"))

    return shared.get("tiny-llama", build, name="tiny-llama")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def worker_group(item: pytest.Item) -> str | None:
    """The tests that must share a pytest-xdist worker (`--dist loadgroup`): those of the
    control plane (one control plane and one operator venv, not one per worker), and those
    of a module that share a module-scoped fixture (its runs made once)."""
    names = set(getattr(item, "fixturenames", ()))
    testbed = getattr(item, "callspec", None) and item.callspec.params.get("testbed")
    if testbed == "control-plane" or names & (CLUSTER_FIXTURES | PROCESS_FIXTURES):
        return "control-plane"
    info = getattr(item, "_fixtureinfo", None)
    shared = info and any(definitions[-1].scope == "module"
                          for definitions in info.name2fixturedefs.values() if definitions)
    return item.nodeid.split("::")[0] if shared else None


def longest_first(item: pytest.Item) -> int:
    """Where a test's work unit goes in the workers' queue, longest first (each worker takes
    the next unit as it finishes one, so a long one started last would end the run alone):
    the control plane's tests, then each module of shared runs and each test that starts a
    cluster of its own, then the tests of processes, of the emulator, and the unit tests,
    which fill the gaps."""
    group = worker_group(item)
    if group == "control-plane":
        return 0
    return 1 if group else {"cluster": 1, "process": 2, "scenario": 3}.get(level(item), 4)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Each test gets its level marker; GPU tests skip cleanly where no CUDA device is
    visible, kind tests without a cluster. Under pytest-xdist each test gets its worker
    group, and the workers' queue is ordered longest first."""
    gpu, mislabelled = None, []
    for item in items:
        needed = level(item)
        if item.get_closest_marker(needed) is None:
            item.add_marker(getattr(pytest.mark, needed))
        if extra := {m.name for m in item.iter_markers() if m.name in LEVELS} - {needed}:
            mislabelled.append(f"{item.nodeid}: needs {needed}, also marked {sorted(extra)}")
        if group := worker_group(item):
            item.add_marker(pytest.mark.xdist_group(group))
        if item.get_closest_marker("gpu") is not None:
            if gpu is None:
                import torch

                gpu = torch.cuda.is_available()
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible"))
        if item.get_closest_marker("kind") is not None and not os.environ.get("KUBECONFIG"):
            item.add_marker(pytest.mark.skip(
                reason="needs a real cluster: set KUBECONFIG (kind cannot run without Docker)"))
    if mislabelled:  # `pytest -m LEVEL` selects a test by any level marker it carries
        raise pytest.UsageError("one level marker per test:\n" + "\n".join(mislabelled))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects in the same order
        items.sort(key=longest_first)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Each group really shares a worker: pytest 9.2 keeps pytest-xdist's loadgroup from
    seeing the groups (pytest-xdist#1386), and the suite would then start a control plane on
    each worker and make each module's shared runs twice, silently."""
    if node.config.getvalue("dist") == "loadgroup" and not any("@" in i for i in ids):
        pytest.exit(f"pytest-xdist's --dist loadgroup does not group on pytest "
                    f"{pytest.__version__} (pytest-xdist#1386): install the pytest that "
                    "pyproject.toml names", returncode=pytest.ExitCode.USAGE_ERROR)


# --- each wait bounded by its test's own timeout (tests/support/waits.py) ----------------

@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    from tests.support import waits

    waits.started(settings.timeout)  # and returns None: pytest-timeout sets its timer too


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item):
    from tests.support import waits

    waits.ended()


# --- a unit test starts no process -------------------------------------------------------

PROCESS_EVENTS = {"subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty", "os.system",
                  "os.exec", "os.spawn"}
LIBRARY_PROBES = {"git", "ldconfig", "uname"}
"""Commands a library runs on its own, not the test: azure-ai-ml asks git about the working
folder at every job create (get_git_properties), a few milliseconds; the first import of
torch asks ldconfig where libdl is (cuda-pathfinder, through ctypes.util.find_library),
and the first of deepspeed (which transformers' save_pretrained imports) asks uname for
the processor (mlflow's telemetry, platform.processor()): whichever unit test came first
failed for them."""
_unit_test: dict[str, list[str]] = {}
"""While a `unit` test runs: its node id → the processes it started."""


def _audit(event: str, args: tuple) -> None:
    if event in PROCESS_EVENTS and _unit_test:
        started = args[1] if event == "subprocess.Popen" else args[0] if args else event
        if event == "subprocess.Popen" and isinstance(started, list | tuple) and started \
                and Path(str(started[0])).name in LIBRARY_PROBES:
            return
        next(iter(_unit_test.values())).append(f"{event} {started!r}"[:200])


sys.addaudithook(_audit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if level(item) == "unit":
        _unit_test[item.nodeid] = []
    try:
        return (yield)
    finally:
        _unit_test.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{call.when}", report)  # what a fixture's teardown may read
    started = _unit_test.get(item.nodeid)
    if started and call.when == "call" and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is a `unit` test but started a process: "
                           f"{started[0]}. Mark it `process` (@pytest.mark.process), or keep "
                           "it in this process: `make test-quick` runs only unit tests.")
    return report
