"""Where the scenarios run: KMock's emulator with a simulated kubelet and the operator in
this process, or a real cluster (KUBECONFIG) with the operator installed by the chart.

The scenarios speak to a `Testbed` only: the Kubernetes API (`get`, `apply`, ...), the
workers (`fail`, `preempt`, ...) and the operator (`kill`, `start`). On the emulator those
are simulated; on a real cluster the workers are real torchrun pods of the CPU trainer image
(examples/06-kind-e2e.yaml) and each fault is made the way it happens there: a worker's
trainer processes are SIGKILLed through the exec API, a pod is evicted through the Eviction
API, the operator's pod is deleted.

A real cluster is used only when both KUBECONFIG and FINETUNE_E2E_NAMESPACE are set: the
tests create and delete FineTuneJobs in that namespace, so pointing at one is a choice.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from finetune_trainer.progress import ProgressServer
from finetune_trainer.record import ProgressRecord
from tests.conftest import REPO, minimal_job
from tests.support import waits
from tests.support.emulator import COMPLETION_INDEX, ApiServer, Kubelet

API = "finetune.dev/v1alpha1/finetunejobs"
ENDED = ("Succeeded", "Failed")
"""Phases a job does not leave unless its spec is edited."""
REAL_CLUSTER_ENV = ("KUBECONFIG", "FINETUNE_E2E_NAMESPACE")
REAL_CLUSTER_SKIP = ("no real cluster chosen: set KUBECONFIG and FINETUNE_E2E_NAMESPACE, "
                     "with the chart installed (make kind-e2e does)")


def merged(base: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(base)
    doc["spec"].update(copy.deepcopy(spec))
    return doc


async def eventually(check: Callable[[], object], what: str = "", poll: float = 0.05,
                     blocking: bool = False) -> None:
    """Wait for `check()` to be true, as long as the test may run (tests/support/waits.py: a
    busy machine makes the event late, never absent); a `blocking` check (synchronous API
    calls) runs in a thread, so an API server in this event loop can answer it."""
    def guarded() -> object:  # StopIteration cannot cross from a thread into a future
        try:
            return check()
        except StopIteration as error:
            raise KeyError("not there yet") from error

    bound = waits.seconds_left()
    deadline = time.monotonic() + bound
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if await asyncio.to_thread(guarded) if blocking else check():
                return
        except (KeyError, StopIteration, TypeError, AssertionError) as error:
            last_error = error
        await asyncio.sleep(poll)
    raise AssertionError(f"not within {bound:.0f} s (the test's time): {what or check}; "
                         f"last error: {last_error!r}")


def condition_in(status: dict[str, Any], type_: str, name: str) -> dict[str, Any]:
    """The condition of `type_` in a FineTuneJob's status; a KeyError saying what is there
    while it has none (what a wait that ran out reports as its last error)."""
    for found in status.get("conditions", []):
        if found["type"] == type_:
            return found
    raise KeyError(f"{name} has no {type_} condition yet (phase {status.get('phase')!r}, "
                   f"conditions {[c['type'] for c in status.get('conditions', [])]})")


class Testbed:
    """One cluster, its workers and the operator, as the scenarios see them."""

    real: bool
    namespace: str
    poll: float
    blocking = False
    """Reads are synchronous API calls (run checks in a thread)."""

    # --- the Kubernetes API -------------------------------------------------------------
    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def event_reasons(self) -> list[str]:
        raise NotImplementedError

    async def apply(self, doc: dict[str, Any]) -> None:
        raise NotImplementedError

    async def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        raise NotImplementedError

    async def delete(self, name: str) -> None:
        raise NotImplementedError

    def manifest(self, name: str = "demo", **spec: Any) -> dict[str, Any]:
        raise NotImplementedError

    # --- the workers --------------------------------------------------------------------
    def jobs_created(self, name: str) -> int:
        """How many distinct Jobs named `name` this test has seen (gang restarts + 1)."""
        raise NotImplementedError

    def running_pods(self, name: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def create_attempts(self, resource: str, name: str) -> int | None:
        """How many creates of `resource` (plural) named `name` reached the API server,
        refused ones (409) included; None where no audit log can tell."""
        return None

    async def fail_worker(self, name: str, index: int, message: str,
                          exit_code: int = 1) -> None:
        raise NotImplementedError

    async def preempt_worker(self, name: str, index: int) -> None:
        raise NotImplementedError

    async def finish(self, name: str, final: ProgressRecord | None = None) -> None:
        """Let every worker of `name` succeed, rank 0 leaving `final` as its termination
        message, as the trainer does (a real trainer gets there by itself, with its own)."""

    async def report_progress(self, name: str) -> ProgressRecord | None:
        """Make rank 0 publish a record and return it; None where the real trainer reports."""
        return None

    def hold_garbage_collection(self, held: bool) -> bool:
        """Stop (or restart) the garbage collector, where the test plays it; False where a
        real one runs."""
        return False

    def unpullable(self, doc: dict[str, Any]) -> dict[str, Any]:
        """`doc`, changed so its pods stay waiting on an image pull."""
        raise NotImplementedError

    def pulls_again(self) -> None:
        """Where the test plays the kubelet: the image it was stuck on is fixed. A real
        cluster pulls the fixed image by itself."""

    # --- the operator -------------------------------------------------------------------
    async def kill_operator(self) -> None:
        raise NotImplementedError

    async def start_operator(self) -> None:
        raise NotImplementedError

    # --- helpers ------------------------------------------------------------------------
    def ftj(self, name: str = "demo") -> dict[str, Any] | None:
        return self.get(API, name)

    def status(self, name: str = "demo") -> dict[str, Any]:
        return (self.ftj(name) or {}).get("status", {})

    def condition(self, type_: str, name: str = "demo") -> dict[str, Any]:
        return condition_in(self.status(name), type_, name)

    async def until(self, check: Callable[[], object], what: str = "") -> None:
        await eventually(check, what, self.poll, self.blocking)

    async def until_phase(self, phase: str, name: str = "demo") -> None:
        """Until the job is in `phase`; a job that comes to an end in another meanwhile fails
        the wait at once, with its status (it would never come). An end it was in when the
        wait began does not (an edited job leaves it)."""
        began: list[str | None] = []  # the first look's phase (read where `until` reads)

        def there() -> bool:
            status = self.status(name)
            began[:] = began or [status.get("phase")]
            if status.get("phase") in ENDED and status.get("phase") not in (phase, *began):
                raise RuntimeError(f"{name} ended {status.get('phase')} while waiting for "
                                   f"{phase}: {status}")
            return status.get("phase") == phase

        await self.until(there, f"{name} {phase}")


class EmulatedTestbed(Testbed):
    real = False
    namespace = "default"
    poll = 0.05

    def __init__(self, server: ApiServer, kubelet: Kubelet, operator: Any,
                 rank0: ProgressServer):
        self.server, self.kubelet, self.operator, self.rank0 = server, kubelet, operator, rank0

    def _url(self, name: str | None = None) -> str:
        url = f"{str(self.server.url).rstrip('/')}/apis/{API.rsplit('/', 1)[0]}/namespaces/" \
              f"{self.namespace}/finetunejobs"
        return f"{url}/{name}" if name else url

    async def _send(self, method: str, url: str, **kwargs: Any) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.request(method, url, **kwargs) as response:
                assert response.status == 200, await response.text()

    def get(self, resource, name):
        return self.server.get(resource, self.namespace, name)

    def event_reasons(self):
        return [e.get("reason") for e in self.server.live("v1/events")]

    async def apply(self, doc):
        await self._send("POST", self._url(), json=doc)

    async def patch_spec(self, name, spec):
        await self._send("PATCH", self._url(name), json={"spec": spec},
                         headers={"Content-Type": "application/merge-patch+json"})

    async def delete(self, name):
        await self._send("DELETE", self._url(name))

    def manifest(self, name="demo", **spec):
        # a folder of its own, as the operator runs one live job per output folder
        doc = minimal_job(**{"resources": {"nodes": 2, "gpusPerNode": 8},
                             "output": {"uri": f"pvc://ckpt/{name}"}, **spec})
        doc["metadata"] = {"name": name, "namespace": self.namespace}
        return doc

    def jobs_created(self, name):
        return self.kubelet.created_jobs.count(name)

    def running_pods(self, name):
        return self.kubelet.running_pods(name, self.namespace)

    async def fail_worker(self, name, index, message, exit_code=1):
        await self.kubelet.fail(name, index, exit_code=exit_code, message=message,
                                namespace=self.namespace)

    async def preempt_worker(self, name, index):
        await self.kubelet.preempt(name, index, namespace=self.namespace)

    async def finish(self, name, final=None):
        await self.kubelet.succeed(name, self.namespace,
                                   final.as_termination_message() if final else "")

    async def report_progress(self, name):
        record = ProgressRecord(step=40, totalSteps=100, epoch=0.4, loss=1.25, learningRate=1e-4,
                                tokensPerSecond=52000.0, etaSeconds=600)
        self.rank0.publish(record)
        return record

    def hold_garbage_collection(self, held):
        self.kubelet.collecting = not held
        return True

    def unpullable(self, doc):
        self.kubelet.stuck_reason = ("ImagePullBackOff",
                                     'Back-off pulling image "trainer:typo"')
        return merged(doc, {"runPolicy": {"startupDeadlineSeconds": 2}})

    def pulls_again(self):
        self.kubelet.stuck_reason = None

    async def kill_operator(self):
        await self.operator.kill()

    async def start_operator(self):
        await self.operator.start()


# The trainer processes on a worker, SIGKILLed after the message is left where each reports
# its failure (torchrun's error file, errors.record_failure): what an uncaught CUDA error
# does to a real worker, as finetune_trainer.launch then says it in the termination message.
KILL_TRAINER = """
import json, os, signal, sys, time
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ")
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
    except OSError:
        continue
    if (b"-m finetune_trainer " not in cmdline or b"finetune_trainer.launch" in cmdline
            or int(pid) == os.getpid()):
        continue
    for entry in environ:
        if entry.startswith(b"TORCHELASTIC_ERROR_FILE="):
            with open(entry.split(b"=", 1)[1], "w") as error_file:
                json.dump({"message": sys.argv[1], "timestamp": int(time.time())}, error_file)
    os.kill(int(pid), signal.SIGKILL)
"""


class RealTestbed(Testbed):
    """A cluster reached through KUBECONFIG, with the chart's operator already running."""

    real = True
    poll = 1.0
    blocking = True

    def __init__(self, dynamic_client: Any, namespace: str) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.operator_namespace = os.environ.get("FINETUNE_E2E_OPERATOR_NAMESPACE",
                                                 "finetune-system")
        self.dynamic = dynamic_client
        self.core = client.CoreV1Api(dynamic_client.client)
        self.seen_jobs: dict[str, set[str]] = {}
        self._watcher: asyncio.Task | None = None

    @classmethod
    async def connect(cls, kubeconfig: str | None = None, namespace: str | None = None,
                      **kwargs: Any) -> Any:
        """Connected as kubectl is (API discovery is a blocking call, so in a thread); by
        default to KUBECONFIG and FINETUNE_E2E_NAMESPACE."""
        from kubernetes import config, dynamic

        api = config.new_client_from_config(kubeconfig or os.environ["KUBECONFIG"])
        return cls(await asyncio.to_thread(dynamic.DynamicClient, api),
                   namespace or os.environ["FINETUNE_E2E_NAMESPACE"], **kwargs)

    def _resource(self, resource: str):
        group_version, plural = resource.rsplit("/", 1)
        return self.dynamic.resources.get(api_version=group_version, name=plural)

    def get(self, resource, name):
        from kubernetes.dynamic.exceptions import NotFoundError

        try:
            return self._resource(resource).get(name=name, namespace=self.namespace).to_dict()
        except NotFoundError:
            return None

    def _list(self, resource: str, **selectors: str) -> list[dict[str, Any]]:
        listed = self._resource(resource).get(namespace=self.namespace, **selectors).to_dict()
        return listed.get("items", [])

    def event_reasons(self):
        return [e.get("reason") for e in self._list("v1/events")]

    async def apply(self, doc):
        await asyncio.to_thread(lambda: self._resource(API).create(body=doc,
                                                                   namespace=self.namespace))

    async def patch_spec(self, name, spec):
        await asyncio.to_thread(lambda: self._resource(API).patch(
            name=name, namespace=self.namespace, body={"spec": spec},
            content_type="application/merge-patch+json"))

    async def delete(self, name):
        await asyncio.to_thread(lambda: self._resource(API).delete(name=name,
                                                                   namespace=self.namespace))

    def manifest(self, name="demo", **spec):
        doc = yaml.safe_load(Path(REPO / "examples/06-kind-e2e.yaml").read_text())
        doc["metadata"] = {"name": name, "namespace": self.namespace}
        # long enough on two CPU pods for a fault to land while it trains
        doc["spec"]["hyperparameters"]["maxSteps"] = 400
        doc["spec"]["output"] = {"uri": f"pvc://finetune-e2e/scenarios/{name}",
                                 "checkpointEverySteps": 50}
        return merged(doc, spec)

    async def watch_jobs(self) -> None:
        """Remember every Job uid, so a delete-and-recreate is counted even between looks."""
        while True:
            for job in await asyncio.to_thread(self._list, "batch/v1/jobs"):
                meta = job["metadata"]
                self.seen_jobs.setdefault(meta["name"], set()).add(meta["uid"])
            await asyncio.sleep(0.5)

    def jobs_created(self, name):
        return len(self.seen_jobs.get(name, ()))

    def _pods(self, name: str) -> list[dict[str, Any]]:
        return self._list("v1/pods", label_selector=f"batch.kubernetes.io/job-name={name}")

    def running_pods(self, name):
        return [p for p in self._pods(name) if p["status"].get("phase") == "Running"]

    def _pod_name(self, name: str, index: int) -> str:
        return next(p["metadata"]["name"] for p in self.running_pods(name)
                    if p["metadata"]["annotations"][COMPLETION_INDEX] == str(index))

    async def fail_worker(self, name, index, message, exit_code=1):
        from kubernetes.stream import stream

        if exit_code != 1:
            import pytest

            pytest.skip("real trainer pods fail by SIGKILL here, not with a chosen exit code")
        pod = await asyncio.to_thread(self._pod_name, name, index)
        await asyncio.to_thread(
            stream, self.core.connect_get_namespaced_pod_exec, pod, self.namespace,
            command=["python", "-c", KILL_TRAINER, message], container="trainer",
            stderr=True, stdout=True, stdin=False, tty=False)

    async def preempt_worker(self, name, index):
        from kubernetes import client

        pod = await asyncio.to_thread(self._pod_name, name, index)
        eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod,
                                                                  namespace=self.namespace))
        await asyncio.to_thread(self.core.create_namespaced_pod_eviction, pod, self.namespace,
                                eviction)

    def unpullable(self, doc):
        return merged(doc, {
            "kubernetes": {"image": "registry.invalid/finetune/trainer:typo",
                           "imagePullPolicy": "IfNotPresent"},
            "runPolicy": {"startupDeadlineSeconds": 45}})

    def _operator_pods(self) -> list[Any]:
        return self.core.list_namespaced_pod(
            self.operator_namespace,
            label_selector="app.kubernetes.io/name=finetune-operator").items

    async def kill_operator(self):
        for pod in await asyncio.to_thread(self._operator_pods):
            await asyncio.to_thread(self.core.delete_namespaced_pod, pod.metadata.name,
                                    self.operator_namespace, grace_period_seconds=0)

    async def start_operator(self):
        """The Deployment starts a new pod: wait until it is ready."""
        def ready() -> bool:
            return any(not pod.metadata.deletion_timestamp and any(
                c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
                for pod in self._operator_pods())
        await self.until(ready, "a ready operator pod")

    async def start(self) -> None:
        self._watcher = asyncio.create_task(self.watch_jobs())

    async def clean(self) -> None:
        """Delete this test's FineTuneJobs and wait until the operator has let them go."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        for job in await asyncio.to_thread(self._list, API):
            await self.delete(job["metadata"]["name"])
        await self.until(lambda: not self._list(API), "FineTuneJobs deleted")
