"""The operator learns of its workers from watch streams (#23): when those streams die, it
must catch up with what changed while it could not see, not miss it.

The operator here reaches the real API server through a TCP relay owned by the test (TLS
passes through untouched), so the test can cut every connection it has, watches included,
and refuse new ones for a while: what a restarted API server or a broken load balancer does
to it. A worker fails during the outage; once the relay lets the operator back in, it must
restart the gang, count the failure once, and carry the job on to Succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import pytest_asyncio

from tests.support.cluster_fixtures import OperatorProcess, free_port, standing_in
from tests.support.cluster_testbed import ControlPlaneTestbed

pytestmark = pytest.mark.asyncio


class Relay:
    """127.0.0.1:<port> → the API server, byte for byte; `cut()` closes every connection and
    refuses new ones until `mend()`."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port, self.port = upstream_port, free_port()
        self.open = True
        self.links: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None
        self.cuts = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self.links |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.links -= {writer, up_writer}

    def cut(self) -> int:
        """Reset every connection (watch streams and calls alike); refuse new ones."""
        self.open, self.cuts = False, self.cuts + 1
        dropped = len(self.links)
        for writer in list(self.links):
            writer.transport.abort()
        return dropped

    def mend(self) -> None:
        self.open = True

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest_asyncio.fixture()
async def relayed_operator(installation, operator_install, operator_process, progress_port,
                           tmp_path):
    """The session's operator stands aside; one reaching the API server through a Relay
    takes its place (same install, same ServiceAccount), and hands back afterwards."""
    relay = Relay(installation.plane.ports["apiserver"])
    await relay.start()
    config = json.loads(installation.operator_kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"
    kubeconfig = tmp_path / "relayed.kubeconfig"
    kubeconfig.write_text(json.dumps(config))
    relayed = OperatorProcess(operator_install, kubeconfig, operator_process.settings,
                              tmp_path / "operator.log", interval=operator_process.interval)
    try:
        async with standing_in(operator_process, relayed):
            yield relay, relayed
    finally:
        await relay.close()


async def test_the_operator_catches_up_after_its_watch_streams_die(
        installation, relayed_operator, progress_port):
    relay, operator = relayed_operator
    bed = await ControlPlaneTestbed.open(installation, operator, progress_port)
    await bed.start()
    try:
        await bed.apply(bed.manifest(runPolicy={"backoffLimit": 2}))
        await bed.until_phase("Running")
        assert relay.cut() >= 3  # the watches of FineTuneJobs, Jobs, pods, ... and calls
        # what happens while the operator is blind: a worker fails, the Job fails with it
        await bed.fail_worker("demo", 1, "CUDA error: an illegal memory access")
        await bed.until(lambda: any(c.get("type") == "Failed" and c.get("status") == "True"
                                    for c in (bed.get("batch/v1/jobs", "demo") or {}).get(
                                        "status", {}).get("conditions") or []),
                        "the Job failed (seen by the test, not yet by the operator)")
        assert bed.status()["phase"] == "Running"  # nobody told the operator
        await asyncio.sleep(3)  # its reconnects are refused meanwhile
        relay.mend()
        # it watches again, sees the failed worker, and restarts the gang once
        await bed.until(lambda: bed.status().get("restarts") == 1, "the failure counted")
        await bed.until(lambda: bed.jobs_created("demo") == 2, "a second gang")
        await bed.until_phase("Running")
        await bed.finish("demo")
        await bed.until_phase("Succeeded")
        assert bed.status()["restarts"] == 1
        assert bed.jobs_created("demo") == 2
        assert bed.create_attempts("jobs", "demo") == 2  # no create was made twice
        assert bed.operator_denials() == []
    finally:
        await bed.clean()
