"""Several operator replicas (the chart's `replicas > 1`): kopf peering lets one act, and a
standby takes over when the acting replica's record expires (its pod died, no goodbye).

The acting replica is played by its record in the peering object: the standby is the real
operator, and what is tested is that it stays idle while a higher-priority peer lives and
takes the jobs over once that peer is gone."""

from __future__ import annotations

import asyncio
import datetime
import logging

import aiohttp
import pytest

from finetune_operator.controller import reconcilers
from finetune_operator.controller.reconcilers import Peering
from finetune_operator.kube import Kube
from finetune_operator.settings import OperatorSettings
from finetune_trainer.record import ProgressRecord
from tests.support import waits
from tests.support.emulator import ApiServer
from tests.support.operator_fixtures import NotKopfs, Operator
from tests.support.testbed import EmulatedTestbed

pytestmark = [pytest.mark.kmock(cls=ApiServer), pytest.mark.asyncio, pytest.mark.timeout(300)]
PEERINGS = "/apis/kopf.dev/v1/clusterkopfpeerings"
LIFETIME = 4
STANDING_BY = "another replica leads: standing by"
"""What a replica logs when it stops acting (reconcilers.follow_peering)."""


async def test_a_standby_replica_takes_over_when_the_acting_one_dies(cluster, kubelet, rank0):
    """replica-a's record lives, however slowly this machine starts the standby, until the
    test has seen the standby stay idle; then replica-a sends its last keep-alive and dies:
    its record expires LIFETIME later with nothing more written, and the standby takes over
    on its own clock."""
    async with aiohttp.ClientSession(base_url=str(cluster.url)) as session:
        async with session.post(PEERINGS, json={
                "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                "metadata": {"name": "finetune-operator"},
                "status": {"replica-a": keep_alive(lifetime=3600)}}) as response:
            assert response.status == 200, await response.text()
    standby = Operator(cluster, rank0, Peering("finetune-operator", priority=100,
                                               lifetime=60, identity="replica-b"))
    await standby.start()
    testbed = EmulatedTestbed(cluster, kubelet, standby, rank0)
    try:
        await testbed.apply(testbed.manifest())
        await testbed.until(lambda: "replica-b" in cluster.get(
            "kopf.dev/v1/clusterkopfpeerings", None, "finetune-operator")["status"],
            "the standby's own record beside replica-a's")
        await asyncio.sleep(LIFETIME / 2)
        assert testbed.status() == {}, "the standby acted while a higher-priority peer lived"

        # replica-a's last keep-alive: once its record expires, replica-b takes over
        async with aiohttp.ClientSession(base_url=str(cluster.url)) as session:
            async with session.patch(f"{PEERINGS}/finetune-operator", json={"status": {
                    "replica-a": keep_alive(lifetime=LIFETIME)}},
                    headers={"Content-Type": "application/merge-patch+json"}) as response:
                assert response.status == 200, await response.text()
        await testbed.until_phase("Running")
        assert testbed.jobs_created("demo") == 1
    finally:
        await standby.stop()


def keep_alive(lifetime: int) -> dict:
    """replica-a's record as it writes it now: priority 200, alive for `lifetime` seconds."""
    return {"priority": 200, "lifetime": lifetime,
            "lastseen": datetime.datetime.now(datetime.UTC).isoformat()}


async def test_without_the_peering_object_a_replica_stops_and_says_why(cluster, rank0):
    """Otherwise kopf waits, idle and silent, for an object nobody creates."""
    replica = Operator(cluster, rank0, Peering("finetune-operator", identity="replica-b"))
    with pytest.raises(Exception, match="handlers failed") as failure:  # kopf's ActivityError
        await asyncio.wait_for(reconcilers.run(
            replica.runtime, kubeconfig=replica.kubeconfig, spare=NotKopfs(),
            peering=replica.peering),
            timeout=waits.seconds_left())
    message = " ".join(str(o.exception) for o in failure.value.outcomes.values())
    assert "no ClusterKopfPeering 'finetune-operator' (cluster-wide)" in message
    assert "the Helm chart does when replicas > 1" in message


async def test_a_replica_that_loses_the_lead_stops_acting(cluster, kubelet, rank0, caplog):
    """A rolling update starts a replica with a higher priority: the one that led stands by,
    and no timer of its own (rank 0's progress is polled) makes it act beside the new one."""
    async with aiohttp.ClientSession(base_url=str(cluster.url)) as session:
        async with session.post(PEERINGS, json={
                "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                "metadata": {"name": "finetune-operator"}}) as response:
            assert response.status == 200, await response.text()
    caplog.set_level(logging.INFO, logger="finetune_operator")
    leader = Operator(cluster, rank0, Peering("finetune-operator", priority=100, lifetime=60,
                                              identity="replica-b"))
    await leader.start()
    testbed = EmulatedTestbed(cluster, kubelet, leader, rank0)
    try:
        await testbed.apply(testbed.manifest())
        await testbed.until_phase("Running")
        rank0.publish(progress(10))
        await testbed.until(lambda: testbed.status().get("progress", {}).get("step") == 10,
                            "progress polled while leading")

        async with aiohttp.ClientSession(base_url=str(cluster.url)) as session:
            async with session.patch(f"{PEERINGS}/finetune-operator", json={"status": {
                    "replica-a": keep_alive(lifetime=60)}},
                    headers={"Content-Type": "application/merge-patch+json"}) as response:
                assert response.status == 200, await response.text()
        await testbed.until(lambda: STANDING_BY in caplog.text, "the leader standing by")
        rank0.publish(progress(20))
        await asyncio.sleep(2)
        assert testbed.status()["progress"]["step"] == 10, "a standby went on acting"
    finally:
        await leader.stop()


def progress(step: int) -> ProgressRecord:
    return ProgressRecord(step=step, totalSteps=100, epoch=0.1, loss=1.0, learningRate=1e-4,
                          tokensPerSecond=1000.0, etaSeconds=60)


async def test_who_leads_follows_kopfs_rule():
    now = datetime.datetime(2026, 11, 23, 12, 0, tzinfo=datetime.UTC)
    fresh, stale = "2026-11-23T11:59:50+00:00", "2026-11-23T11:58:00Z"

    def peer(priority: int, lastseen: str) -> dict:
        return {"priority": priority, "lifetime": 60, "lastseen": lastseen}

    assert reconcilers.leads(None, "b", 100, now)
    assert reconcilers.leads({"b": peer(100, fresh), "a": peer(50, fresh)}, "b", 100, now)
    assert not reconcilers.leads({"a": peer(200, fresh)}, "b", 100, now)
    assert not reconcilers.leads({"a": peer(100, fresh)}, "b", 100, now)  # kopf pauses both
    assert reconcilers.leads({"a": peer(200, stale)}, "b", 100, now)  # its record expired


async def test_a_standby_stops_at_once(cluster):
    """A reconciler of a standby that was handed a key waits to act again; a stop must not
    wait for that (a rolling update's grace period is 30 s)."""
    standby = reconcilers.Controller(reconcilers.Runtime.build(
        Kube(cluster.kubeconfig), OperatorSettings(), interval=0.3))
    standby.acting.clear()
    standby.start()
    standby.queue.add(("default", "demo"))
    await asyncio.sleep(0.1)  # a reconciler takes it, and waits for `acting`
    await asyncio.wait_for(standby.stop(), waits.seconds_left())


async def test_a_namespaced_replica_taking_over_lists_only_its_namespaces(cluster):
    """It listed every namespace, which a namespaced install may not: a 403 logged at each
    takeover."""
    standby = reconcilers.Controller(reconcilers.Runtime.build(
        Kube(cluster.kubeconfig), OperatorSettings(), interval=0.3))
    standby.acting.clear()
    asked = []

    async def listing(kind, namespace=None, **_):
        asked.append((kind, namespace))
        return []

    standby.runtime.kube.list = listing
    await standby.lead(("ml-team", "research"))
    assert asked == [("FineTuneJob", "ml-team"), ("FineTuneJob", "research"),
                     ("FineTuneSweep", "ml-team"), ("FineTuneSweep", "research")]
