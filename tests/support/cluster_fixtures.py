"""A real Kubernetes control plane for the tests, installed as users install the product.

- `control_plane`: etcd, kube-apiserver (RBAC, audit log), controller-manager, scheduler and
  KWOK (cluster/controlplane.py, what `make cluster` runs), once per session.
- `installation`: the CRD by `kubectl apply`, the chart rendered by the Helm engine and
  applied (all but the operator's Deployment, whose process runs here instead), and a
  kubeconfig holding only a token of the chart's ServiceAccount (`kubectl create token`):
  the API server enforces the chart's RBAC on everything the operator does.
- `operator_install`: `pip install .` into a fresh venv, without the trainer extra: what the
  operator image installs. The operator runs from there.
- `operator_process`: `finetune operator` from that venv with only the ServiceAccount's
  kubeconfig and the chart's FINETUNE_* settings.

Skipped, saying why, where Go or openssl is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from tests.support import waits

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "cluster"))  # cluster/controlplane.py: what `make cluster` runs
import controlplane  # noqa: E402
from controlplane import OPERATOR_NAMESPACE, Installation, free_port  # noqa: E402


def missing_tools() -> str | None:
    for tool, why in (("go", "the control plane is built from Go modules (install Go 1.26+)"),
                      ("openssl", "its certificates are made with openssl")):
        if shutil.which(tool) is None:
            return f"no real control plane: `{tool}` is not installed; {why}"
    return None


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    controlplane.build()  # cached: `make test` builds it first, outside any test's timeout
    with running(controlplane.ControlPlane(tmp_path_factory.mktemp("control-plane"))) as plane:
        yield plane


@contextlib.contextmanager
def running(plane: controlplane.ControlPlane):
    """`plane` started, and stopped after (also when it fails to start: nothing is left)."""
    try:
        plane.start()
    except BaseException:
        plane.stop()
        raise
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def installation(control_plane) -> Installation:
    return control_plane.install(OPERATOR_NAMESPACE)


def image_sources(dockerfile: Path, into: Path) -> Path:
    """The files `dockerfile`'s COPY instructions take from the repository, laid out as in
    the image's build folder: what its `pip install` sees, nothing more."""
    text = dockerfile.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith("--") for w in words):
            continue
        *sources, target = words[1:]
        for source in sources:
            origin = REPO / source
            if origin.is_dir():  # as Docker does: the folder's contents into the target
                shutil.copytree(origin, into / target, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                destination = into / target / (origin.name if target.endswith("/") else "")
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, destination)
    return into


@pytest.fixture(scope="session")
def operator_install(tmp_path_factory) -> Path:
    """What the operator image installs, into a fresh venv: the files operator/Dockerfile
    copies, `pip install`ed without extras (no torch, no trainer extra). Returns its bin."""
    sources = image_sources(REPO / "operator" / "Dockerfile",
                            tmp_path_factory.mktemp("operator-image-src"))
    venv = tmp_path_factory.mktemp("operator-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    result = subprocess.run([*pip, "install", str(sources)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return venv / "bin"


@dataclass
class OperatorProcess:
    """`finetune operator`, started as a user (or the chart's pod) starts it."""

    bin: Path
    kubeconfig: Path
    settings: dict[str, str]
    log: Path
    interval: float = 1.0
    process: subprocess.Popen | None = None
    health_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    starts: int = 0
    args: tuple[str, ...] = ()
    """More arguments of `finetune operator` (e.g. --namespace)."""

    def environment(self) -> dict[str, str]:
        """Nothing of the test's own environment beyond what any shell has."""
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
        return {**keep, **self.settings, "KUBECONFIG": str(self.kubeconfig),
                "HF_HUB_OFFLINE": "1"}

    def start(self) -> None:
        self.starts += 1
        with self.log.open("a") as out:
            out.write(f"--- start {self.starts} ---\n")
            self.process = subprocess.Popen(
                [str(self.bin / "finetune"), "operator", "--interval", str(self.interval),
                 "--metrics-port", str(self.metrics_port), "--health-port",
                 str(self.health_port), *self.args], env=self.environment(), stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        timeout = waits.seconds_left()
        deadline = time.monotonic() + timeout
        while True:  # ready: kopf serves its liveness endpoint once it watches
            if self.process.poll() is not None:
                raise AssertionError(f"the operator exited {self.process.returncode}:\n"
                                     f"{self.log.read_text()[-4000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz",
                                            timeout=1):
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"the operator did not get ready in {timeout:.0f}s:\n"
                                     f"{self.log.read_text()[-4000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        """Gone without a goodbye (SIGKILL), as when its pod is OOM-killed."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()
        self.process = None


@contextlib.asynccontextmanager
async def standing_in(session_operator: OperatorProcess, replacement: OperatorProcess):
    """`replacement` runs in place of the session's operator (stopped meanwhile: two
    operators would both act on every job), which is started again afterwards."""
    import asyncio

    await asyncio.to_thread(session_operator.stop)
    try:
        await asyncio.to_thread(replacement.start)
        yield replacement
    finally:
        await asyncio.to_thread(replacement.stop)
        await asyncio.to_thread(session_operator.start)


@pytest.fixture(scope="session")
def progress_port() -> int:
    """Where the operator reads rank 0's /progress (FINETUNE_METRICS_PORT): tests serve it on
    each pod's own (loopback) IP, so nothing else answers."""
    return free_port()


@pytest.fixture(scope="session")
def operator_process(installation, operator_install, progress_port, tmp_path_factory):
    running = OperatorProcess(
        operator_install, installation.operator_kubeconfig,
        {**installation.operator_env, "FINETUNE_METRICS_PORT": str(progress_port)},
        tmp_path_factory.mktemp("operator") / "operator.log")
    running.start()
    yield running
    running.stop()


@pytest_asyncio.fixture()
async def control_plane_testbed(installation, operator_process, progress_port):
    """A namespace of its own on the control plane, with the operator running; afterwards,
    no call of the operator was refused by RBAC."""
    from tests.support.cluster_testbed import ControlPlaneTestbed

    bed = await ControlPlaneTestbed.open(installation, operator_process, progress_port)
    await bed.start()
    yield bed
    await bed.clean()
    assert bed.operator_denials() == []  # the chart's RBAC let it do everything it did
