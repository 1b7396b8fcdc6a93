"""Launches are paced (#23): a burst of new jobs is acknowledged at once and launched at the
operator's --launch-rate after its --launch-burst, in the order the jobs came.

On the real control plane, `finetune operator --launch-rate 0.25 --launch-burst 2` (the
session's operator stands aside meanwhile), four jobs applied by one `kubectl apply`: two
launch at once; the other two say Pending until their turn comes, then launch about four and
eight seconds later, each exactly once. The pace is slow so that a loaded machine, slow
between the apply's creates or the operator's looks, does not earn the third job a turn of
its own before it asks.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from finetune_operator.kube import timestamp
from tests.support import waits
from tests.support.cluster_fixtures import OperatorProcess, standing_in
from tests.support.cluster_testbed import ControlPlaneTestbed

pytestmark = pytest.mark.asyncio
NAMES = [f"paced-{n}" for n in range(4)]
RATE = 0.25  # launches a second after the burst


@pytest_asyncio.fixture()
async def paced_operator(installation, operator_install, operator_process, tmp_path):
    paced = OperatorProcess(operator_install, installation.operator_kubeconfig,
                            operator_process.settings, tmp_path / "operator.log",
                            interval=operator_process.interval,
                            args=("--launch-rate", str(RATE), "--launch-burst", "2"))
    async with standing_in(operator_process, paced):
        yield paced


async def test_a_burst_is_acknowledged_at_once_and_launched_at_the_set_pace(
        installation, paced_operator, progress_port):
    bed = await ControlPlaneTestbed.open(installation, paced_operator, progress_port)
    await bed.start()
    try:
        await bed.apply({"apiVersion": "v1", "kind": "List",
                         "items": [bed.manifest(name, resources={"nodes": 1, "gpusPerNode": 1})
                                   for name in NAMES]})
        waited: dict[str, str] = {}
        deadline = time.monotonic() + waits.seconds_left()
        while not all(bed.jobs_created(n) for n in NAMES):  # what each job said meanwhile
            assert time.monotonic() < deadline, {n: bed.status(n) for n in NAMES}
            for name in NAMES:
                status = bed.status(name)
                if status.get("phase") == "Pending":
                    waited[name] = status["message"]
            await asyncio.sleep(0.1)
        log = paced_operator.log.read_text()[-3000:]
        assert len(waited) == 2, (waited, log)  # the burst of two launched without waiting
        for message in waited.values():
            assert message.startswith("waiting for its turn to launch at ")
            assert "--launch-rate" in message
        creates = sorted(timestamp(e["stageTimestamp"]).timestamp() for e in bed.audit()
                         if e.get("verb") == "create" and e.get("stage") == "ResponseComplete"
                         and e.get("objectRef", {}).get("resource") == "jobs"
                         and e.get("objectRef", {}).get("namespace") == bed.namespace)
        assert len(creates) == 4, (creates, log)  # each job's workers once, no 409 retried
        # two at once, then one every four seconds (two of slack for the loaded machine)
        period = 1 / RATE
        assert (creates[2] - creates[0] > period - 2
                and creates[3] - creates[0] > 2 * period - 2), (creates, log)
        for name in NAMES:
            await bed.until_phase("Running", name)
        assert bed.operator_denials() == []
    finally:
        await bed.clean()
