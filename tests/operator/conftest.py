"""The real operator (kopf) against KMock's Kubernetes emulator, in one event loop."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Collection

import pytest
import pytest_asyncio

from finetune_operator import controller
from finetune_operator.kube import Kube, connect
from finetune_operator.settings import OperatorSettings
from finetune_trainer.progress import ProgressServer
from tests.operator.emulator import ApiServer, Kubelet


@pytest.fixture()
def cluster(kmock: ApiServer) -> ApiServer:
    kmock.declare_resources()
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

    def __init__(self, cluster: ApiServer, rank0: ProgressServer):
        self.server = str(cluster.url).rstrip("/")
        self.runtime = controller.Runtime.build(Kube(connect(self.server)), OperatorSettings(),
                                                interval=0.3, progress_port=rank0.port)
        self.task: asyncio.Task | None = None
        self.stop_flag: asyncio.Event | None = None

    async def start(self) -> None:
        self.stop_flag, ready = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(controller.run(
            self.runtime, server=self.server, stop_flag=self.stop_flag, ready_flag=ready,
            spare=NotKopfs()))
        await asyncio.wait_for(ready.wait(), timeout=20)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.stop_flag.set()
        await asyncio.wait_for(self.task, timeout=20)
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


async def eventually(check: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (KeyError, StopIteration, TypeError, AssertionError) as error:
            last_error = error
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what or check}; last error: {last_error!r}")
