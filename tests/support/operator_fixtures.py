"""The real operator (kopf) against KMock's Kubernetes emulator, in one event loop."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Collection

import pytest
import pytest_asyncio

from finetune_operator.controller import reconcilers
from finetune_operator.kube import Kube
from finetune_operator.settings import OperatorSettings
from finetune_trainer.progress import ProgressServer
from tests.support import waits
from tests.support.cluster_fixtures import controlplane
from tests.support.emulator import ApiServer, Kubelet
from tests.support.testbed import (
    REAL_CLUSTER_ENV,
    REAL_CLUSTER_SKIP,
    EmulatedTestbed,
    RealTestbed,
    Testbed,
)


@pytest.fixture()
def cluster(kmock: ApiServer, tmp_path) -> ApiServer:
    """The emulator, reached through a kubeconfig file (`cluster.kubeconfig`) as users do."""
    kmock.declare_resources()
    path = tmp_path / "emulator.kubeconfig"
    path.write_text(json.dumps(controlplane.kubeconfig(str(kmock.url).rstrip("/"), "test")))
    kmock.kubeconfig = str(path)
    return kmock


@pytest.fixture()
def rank0():
    """What rank 0 of every job serves on /progress: the trainer's own endpoint."""
    server = ProgressServer(0, host="127.0.0.1")
    yield server
    server.close()


@pytest_asyncio.fixture()
async def kubelet(cluster: ApiServer):
    async with Kubelet(cluster) as simulator:
        yield simulator


class NotKopfs(Collection):
    """Every task but kopf's own: what the operator must leave alone when it stops (the
    test's tasks, pytest-asyncio's teardown)."""

    def __contains__(self, task: object) -> bool:
        coro = task.get_coro() if isinstance(task, asyncio.Task) else None
        code = getattr(coro, "cr_code", None)
        return code is None or f"{os.sep}kopf{os.sep}" not in code.co_filename

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


class Operator:
    """Starts and stops the real controller; a test may kill and restart it."""

    def __init__(self, cluster: ApiServer, rank0: ProgressServer,
                 peering: reconcilers.Peering | None = None):
        self.kubeconfig = cluster.kubeconfig
        self.peering = peering
        self.runtime = reconcilers.Runtime.build(Kube(self.kubeconfig), OperatorSettings(),
                                                interval=0.3, progress_port=rank0.port)
        self.task: asyncio.Task | None = None
        self.stop_flag: asyncio.Event | None = None

    async def start(self) -> None:
        self.stop_flag, ready = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(reconcilers.run(
            self.runtime, kubeconfig=self.kubeconfig, stop_flag=self.stop_flag, ready_flag=ready,
            spare=NotKopfs(), peering=self.peering))
        await asyncio.wait_for(ready.wait(), waits.seconds_left())

    async def stop(self) -> None:
        if self.task is None:
            return
        self.stop_flag.set()
        await asyncio.wait_for(self.task, waits.seconds_left())
        self.task = None

    async def kill(self) -> None:
        """Gone without a goodbye, as when its pod is OOM-killed mid-reconcile."""
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.task = None


@pytest_asyncio.fixture()
async def operator(cluster: ApiServer, kubelet: Kubelet, rank0: ProgressServer):
    running = Operator(cluster, rank0)
    await running.start()
    yield running
    await running.stop()


@pytest_asyncio.fixture()
async def emulated_testbed(cluster: ApiServer, kubelet: Kubelet, operator: Operator,
                           rank0: ProgressServer) -> EmulatedTestbed:
    return EmulatedTestbed(cluster, kubelet, operator, rank0)


@pytest_asyncio.fixture()
async def real_testbed():
    if not all(os.environ.get(name) for name in REAL_CLUSTER_ENV):
        pytest.skip(REAL_CLUSTER_SKIP)
    real = await RealTestbed.connect()
    await real.start()
    yield real
    await real.clean()


TESTBEDS = {"emulator": "emulated_testbed", "control-plane": "control_plane_testbed",
            "kubeconfig": "real_testbed"}


@pytest.fixture(params=list(TESTBEDS))
def testbed(request: pytest.FixtureRequest) -> Testbed:
    """The scenarios' world: the emulator and the real control plane always (the latter
    where Go is installed); a cluster of your own when one is chosen."""
    return request.getfixturevalue(TESTBEDS[request.param])
