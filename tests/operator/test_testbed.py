"""The real-cluster testbed's API half, checked against the emulator through a kubeconfig:
CI has no cluster, and code that only runs on one would rot unseen. (Exec and eviction,
which the emulator does not serve, run only on a real cluster.)"""

from __future__ import annotations

import asyncio

import pytest
import yaml

from tests.operator.emulator import ApiServer
from tests.operator.testbed import RealTestbed

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.asyncio, pytest.mark.timeout(120)]


async def test_the_real_testbed_drives_a_job_through_the_api(
        emulated_testbed, tmp_path, monkeypatch):
    kubeconfig = tmp_path / "kubeconfig"
    server = str(emulated_testbed.server.url).rstrip("/")
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("FINETUNE_E2E_NAMESPACE", "default")
    real = await RealTestbed.connect()
    real.slowness, real.poll = 1.0, 0.2
    await real.start()
    # the emulator answers in this event loop: the testbed's blocking reads go to a thread
    read = asyncio.to_thread

    await real.apply(emulated_testbed.manifest())
    await real.until_phase("Running")
    assert (await read(real.condition, "Validated"))["status"] == "True"
    assert len(await read(real.running_pods, "demo")) == 2
    await real.until(lambda: real.jobs_created("demo") == 1, "the Job seen")
    assert "Launching" in await read(real.event_reasons)

    await real.patch_spec("demo", {"runPolicy": {"suspend": True}})
    await real.until_phase("Suspended")
    assert (await read(real.get, "batch/v1/jobs", "demo"))["spec"]["suspend"] is True

    await real.clean()
    assert await read(real.ftj) is None
    assert await read(real.get, "batch/v1/jobs", "demo") is None
