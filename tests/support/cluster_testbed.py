"""The scenarios on the real control plane: the real API server, scheduler, Job and garbage
collectors, KWOK as the kubelets, and `finetune operator` as a process of its own.

The API half is `RealTestbed`'s (the one used on kind or AKS). What differs is what KWOK
plays: a worker fails when its pod is labelled so (cluster/kwok-stages.yaml), finishes when
labelled to, and rank 0's /progress is a test server bound to the pod's loopback IP. Each
test gets a namespace of its own, with the volumes the jobs mount.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

from finetune_trainer.progress import ProgressServer
from finetune_trainer.record import ProgressRecord
from tests.conftest import minimal_job
from tests.support.emulator import COMPLETION_INDEX
from tests.support.testbed import RealTestbed, merged

OUTCOME = "fake.finetune.dev/outcome"
RUN_TIME = "fake.finetune.dev/run-time"
MESSAGE = "fake.finetune.dev/message"
CLAIMS = ("data", "ckpt")  # what minimal_job's pvc:// locations mount


class ControlPlaneTestbed(RealTestbed):
    real = True
    poll = 0.25
    blocking = True

    def __init__(self, dynamic_client: Any, namespace: str, *, installation: Any,
                 operator: Any, progress_port: int) -> None:
        super().__init__(dynamic_client, namespace)
        self.installation, self.operator = installation, operator
        self.progress_port = progress_port
        self.rank0: list[ProgressServer] = []
        self._audit_read = 0
        """Bytes of the session's audit log read so far (audit())."""
        self._audit_events: list[dict[str, Any]] = []
        self._volumes: list[str] = []
        """The PersistentVolumes made for this namespace's claims (make_claims)."""

    @classmethod
    async def open(cls, installation: Any, operator: Any, progress_port: int
                   ) -> ControlPlaneTestbed:
        namespace = f"t-{uuid.uuid4().hex[:8]}"
        return await cls.connect(str(installation.plane.admin_kubeconfig), namespace,
                                 installation=installation, operator=operator,
                                 progress_port=progress_port)

    # --- what the namespace holds ---------------------------------------------------------
    async def start(self) -> None:
        audit = self._audit_path()
        self._audit_read = audit.stat().st_size if audit.exists() else 0
        await asyncio.to_thread(self.installation.kubectl, "create", "namespace", self.namespace)
        await self.make_claims(*CLAIMS)
        # no Job watcher (RealTestbed.start): the audit log counts creates (jobs_created)

    async def make_claims(self, *claims: str, mode: str = "ReadWriteMany") -> None:
        """Claims in this namespace, each bound to a volume made for it (that holds nothing:
        no kubelet mounts it), in one apply; the volumes go with the namespace (clean)."""
        items: list[dict[str, Any]] = []
        for claim in claims:
            volume = f"{self.namespace}-{claim}"
            self._volumes.append(volume)
            items += [
                {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
                 "spec": {"capacity": {"storage": "1Ti"}, "accessModes": [mode],
                          "hostPath": {"path": f"/fake/{volume}"}, "storageClassName": "",
                          "claimRef": {"namespace": self.namespace, "name": claim}}},
                {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                 "metadata": {"name": claim, "namespace": self.namespace},
                 "spec": {"accessModes": [mode], "storageClassName": "", "volumeName": volume,
                          "resources": {"requests": {"storage": "1Ti"}}}}]
        await asyncio.to_thread(self.installation.kubectl, "apply", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": items}))

    async def clean(self) -> None:
        for server in self.rank0:
            server.close()
        await super().clean()
        kubectl = self.installation.kubectl
        await asyncio.to_thread(kubectl, "delete", "namespace", self.namespace, "--wait=false")
        await asyncio.to_thread(kubectl, "delete", "pv", "--wait=false", *self._volumes)

    def manifest(self, name="demo", **spec):
        """2 nodes x 8 GPUs (the ndasrv4 pool); pods run until told otherwise."""
        doc = minimal_job(**{"resources": {"nodes": 2, "gpusPerNode": 8},
                             "kubernetes": {"annotations": {RUN_TIME: "1h"}},
                             "output": {"uri": f"pvc://ckpt/{name}"}})  # one job a folder
        doc["metadata"] = {"name": name, "namespace": self.namespace}
        return merged(doc, spec)

    async def until_waiting_says(self, words: str, name: str = "demo") -> None:
        """Until the job's Running condition says `words` of its workers, as they wait (the
        job Launching, not failed)."""
        await self.until(lambda: words in self.condition("Running", name).get("message", ""),
                         f"{words!r} in the Running condition")
        assert self.status(name)["phase"] == "Launching", self.status(name)

    # --- the Kubernetes API, as a user reaches it -----------------------------------------
    async def apply(self, doc):
        await asyncio.to_thread(self.installation.kubectl, "apply", "-f", "-",
                                input=json.dumps(doc))

    def create_attempts(self, resource: str, name: str) -> int:
        """Every create of `resource` (plural, e.g. "jobs") named `name` in this namespace that
        reached the API server, answered or refused (a 409 counts): from its audit log."""
        return len(self._creates(resource, name))

    def jobs_created(self, name):
        return self.created("jobs", name)

    def created(self, resource: str, name: str) -> int:
        """Creates of `resource` named `name` that the API server answered 201 (Created)."""
        return sum(e.get("responseStatus", {}).get("code") == 201
                   for e in self._creates(resource, name))

    def _creates(self, resource: str, name: str) -> list[dict[str, Any]]:
        wanted = {"resource": resource, "namespace": self.namespace, "name": name}
        return [e for e in self.audit() if e.get("verb") == "create" and all(
            e.get("objectRef", {}).get(k) == v for k, v in wanted.items())]

    def operator_denials(self) -> list[str]:
        """Calls of the operator that RBAC refused since this test began: the chart's Role
        must let it do everything it does."""
        user = f"system:serviceaccount:finetune-system:{self.installation.service_account}"
        return [f"{e['verb']} {e.get('requestURI')}" for e in self.audit()
                if e.get("user", {}).get("username") == user
                and e.get("responseStatus", {}).get("code") == 403]

    def audit(self) -> list[dict[str, Any]]:
        """The audit log's events since this test began. The log is the whole session's and
        tests poll it several times a second, so each call reads on from where the last one
        stopped; a line the API server is still writing waits for the next call."""
        path = self._audit_path()
        if not path.exists():
            return self._audit_events
        with path.open("rb") as log:
            log.seek(self._audit_read)
            chunk = log.read()
        whole = chunk.rfind(b"\n") + 1
        self._audit_read += whole
        self._audit_events += [json.loads(line) for line in chunk[:whole].splitlines()
                               if line.strip()]
        return self._audit_events

    def _audit_path(self) -> Path:
        return Path(self.installation.plane.folder) / "logs" / "audit.jsonl"

    # --- the workers: what KWOK plays -----------------------------------------------------
    def _pod(self, name: str, index: int) -> dict[str, Any]:
        return next(p for p in self.running_pods(name)
                    if p["metadata"]["annotations"][COMPLETION_INDEX] == str(index))

    async def _mark(self, pod: str, labels: dict[str, str],
                    annotations: dict[str, str] | None = None) -> None:
        patch = {"metadata": {"labels": labels, "annotations": annotations or {}}}
        await asyncio.to_thread(self.installation.kubectl, "patch", "pod", pod, "-n",
                                self.namespace, "--type=merge", "-p", json.dumps(patch))

    async def fail_worker(self, name, index, message, exit_code=1):
        pod = await asyncio.to_thread(self._pod, name, index)
        await self._mark(pod["metadata"]["name"], {OUTCOME: "fail"},
                         {MESSAGE: message, "fake.finetune.dev/exit-code": str(exit_code)})

    async def fail_init_container(self, name, index, container, message, exit_code=1):
        """KWOK plays an init container of node `index`'s pod ending with `exit_code` (the
        stage pod-fail-init): the pod fails before its trainer starts."""
        pod = await asyncio.to_thread(self._pod, name, index)
        await self._mark(pod["metadata"]["name"], {OUTCOME: "fail-init"},
                         {MESSAGE: message, "fake.finetune.dev/exit-code": str(exit_code),
                          "fake.finetune.dev/init-container": container})

    async def finish(self, name, final=None):
        """KWOK ends each pod Succeeded (the stage pod-complete), rank 0's with `final` as
        its termination message."""
        for pod in await asyncio.to_thread(self.running_pods, name):
            rank0 = pod["metadata"]["annotations"][COMPLETION_INDEX] == "0"
            said = {MESSAGE: final.as_termination_message()} if final and rank0 else {}
            await self._mark(pod["metadata"]["name"], {}, {RUN_TIME: "0s", **said})

    async def report_progress(self, name):
        """Rank 0's /progress, served on its pod's IP at the operator's progress port."""
        await self.until(lambda: self._pod(name, 0)["status"].get("podIP"), "rank 0 has an IP")
        ip = (await asyncio.to_thread(self._pod, name, 0))["status"]["podIP"]
        server = ProgressServer(self.progress_port, host=ip)
        self.rank0.append(server)
        record = ProgressRecord(step=40, totalSteps=100, epoch=0.4, loss=1.25, learningRate=1e-4,
                                tokensPerSecond=52000.0, etaSeconds=600)
        server.publish(record)
        return record

    def unpullable(self, doc):
        """KWOK plays an image pull that fails for any image on registry.invalid."""
        return merged(doc, {"kubernetes": {"image": "registry.invalid/finetune/trainer:typo",
                                           "annotations": {RUN_TIME: "1h"}},
                            "runPolicy": {"startupDeadlineSeconds": 4}})

    # --- the operator: a process of its own -----------------------------------------------
    async def kill_operator(self):
        await asyncio.to_thread(self.operator.kill)

    async def start_operator(self):
        await asyncio.to_thread(self.operator.start)

    async def delete(self, name):
        await asyncio.to_thread(self.installation.kubectl, "delete", "finetunejob", name,
                                "-n", self.namespace, "--wait=false")

    async def patch_spec(self, name, spec):
        await asyncio.to_thread(self.installation.kubectl, "patch", "finetunejob", name, "-n",
                                self.namespace, "--type=merge", "-p",
                                json.dumps({"spec": spec}))

