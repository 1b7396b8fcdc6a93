"""KMock's Kubernetes emulator, made to behave like an API server where kopf cares, and a
simulator that plays the Job controller and the kubelet (the emulator has neither).

What the emulator lacks and is added here:
- server-side metadata (resourceVersion, uid, creationTimestamp, generation) on every
  stored version: kopf guards its finalizer patches with a resourceVersion test;
- generateName (kopf posts its events with it), and 422 for a failed JSON-patch test.
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import k8s_views

REQUESTS_KEPT = 40
VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
RESOURCES = [  # (group/version/plural, kind, namespaced, subresources)
    ("finetune.dev/v1alpha1/finetunejobs", "FineTuneJob", True, {"status"}),
    ("batch/v1/jobs", "Job", True, {"status"}),
    ("v1/pods", "Pod", True, {"status"}),
    ("v1/services", "Service", True, set()),
    ("v1/configmaps", "ConfigMap", True, set()),
    ("v1/events", "Event", True, set()),
    ("v1/namespaces", "Namespace", False, set()),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False,
     {"status"}),
    ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False, set()),
    ("kopf.dev/v1/kopfpeerings", "KopfPeering", True, set()),
]

KINDS = {path: kind for path, kind, _namespaced, _subresources in RESOURCES}


class _Revisions:
    """The cluster-wide resourceVersion counter (etcd's revision)."""

    last = 999

    @classmethod
    def next(cls) -> str:
        cls.last += 1
        return str(cls.last)


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StampedObject(kmock.Object):
    """An object whose every stored version carries what a real API server adds."""

    def __init__(self, history: Any = (), /, *, namespace: str | None = None) -> None:
        super().__init__(history)
        self._namespace = namespace
        if not self.deleted:
            self._stamp(None)

    def create(self, changes: Mapping[str, Any] | None = None, /, **kwargs: Any) -> None:
        before = None if self.deleted else self.last
        super().create(changes, **kwargs)
        self._stamp(before)

    def patch(self, changes: Any = None, /, **kwargs: Any) -> None:
        before = None if self.deleted else self.last
        super().patch(changes, **kwargs)
        self._stamp(before)

    def _stamp(self, before: Any) -> None:
        new = self.last
        old_meta = before.raw.get("metadata", {}) if before is not None else {}
        meta = dict(new.raw.get("metadata") or {})
        meta["resourceVersion"] = _Revisions.next()
        meta["uid"] = old_meta.get("uid") or meta.get("uid") or str(uuid.uuid4())
        meta["creationTimestamp"] = (old_meta.get("creationTimestamp")
                                     or meta.get("creationTimestamp") or _now())
        if before is None:
            meta["generation"] = 1
        elif before.raw.get("spec") != new.raw.get("spec"):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        else:
            meta["generation"] = old_meta.get("generation", 1)
        if self._namespace and not meta.get("namespace"):
            meta["namespace"] = self._namespace
        new["metadata"] = meta


@attrs.frozen(eq=False, order=False)
class StampingObjects(kmock.ObjectsArray):
    def __setitem__(self, key: Any, value: Any, /) -> None:
        if len(key) == 3:  # (resource, namespace, name): a new object
            resource = k8s_views._parse_resource(key[0])
            self._objects[resource, key[1], key[2]] = StampedObject(value, namespace=key[1])
        else:
            super().__setitem__(key, value)


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    _objects: kmock.ObjectsArray = attrs.field(factory=StampingObjects, init=False)
    kubeconfig: str | None = attrs.field(default=None, init=False)
    """A kubeconfig file for this server: how the operator and the tests reach it."""

    async def _handle(self, request: kmock.Request) -> Any:
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        try:
            return await super()._handle(request)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as error:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(error)) from None
        finally:
            # KMock keeps every request and scans them all on each new one (quadratic); these
            # tests assert on objects, not requests, so only the recent ones are kept.
            del self._requests[:-REQUESTS_KEPT]

    async def _serve_list(self, request: kmock.Request) -> Any:
        # a real resourceVersion, read before the snapshot: a racing write is re-sent, not lost
        version = str(_Revisions.last)
        result = await super()._serve_list(request)
        result["metadata"]["resourceVersion"] = version
        resource = request.resource  # kind and apiVersion, as clients that type lists expect
        group_version = f"{resource.group}/{resource.version}" if resource.group else \
            resource.version
        result["apiVersion"] = group_version
        result["kind"] = KINDS[f"{group_version}/{resource.plural}"] + "List"
        return result

    async def _serve_watch(self, request: kmock.Request) -> Any:
        """Honour ?resourceVersion=N as an API server does: KMock re-sends every object as
        ADDED after kopf's list, and kopf then acts on a stale copy (422s and stalls)."""
        yield b""
        since = request.params.get("resourceVersion", "")
        since_version = int(since) if since.isdigit() else None
        bus = self._buses[request.resource]
        async with self._lock:
            marker = await bus.mark()
            snapshot = [{"type": "ADDED", "object": obj.raw}
                        for (resource, namespace, name), obj in self._objects.items()
                        if not obj.deleted and self._selects(request, resource, namespace, name)
                        and (since_version is None or int(obj.get("metadata", {}).get(
                            "resourceVersion", 0)) > since_version)]
        try:
            for event in snapshot:
                yield event
            async for event in bus.stream(since=marker):
                meta = event.get("object", {}).get("metadata", {})
                if self._selects(request, request.resource, meta.get("namespace"),
                                 meta.get("name")):
                    yield event
        finally:
            await bus.unmark(marker)

    @staticmethod
    def _selects(request: kmock.Request, resource: Any, namespace: str | None,
                 name: str | None) -> bool:
        return (resource == request.resource
                and (request.namespace is None or namespace == request.namespace)
                and (request.name is None or name == request.name))

    def declare_resources(self) -> None:
        for key, kind, namespaced, subresources in RESOURCES:
            self.resources[key] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=namespaced, verbs=VERBS,
                subresources=subresources)

    def live(self, resource: str) -> list[dict[str, Any]]:
        """Every stored, not deleted object of `resource` (e.g. "batch/v1/jobs")."""
        wanted = k8s_views._parse_resource(resource)
        return [obj.raw for key, obj in list(self.objects.items())
                if key[0] == wanted and not obj.deleted]

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        return next((o for o in self.live(resource) if o["metadata"]["name"] == name
                     and o["metadata"].get("namespace") == namespace), None)


# --- the Job controller and kubelet, played by the test ----------------------------------

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
GC_OWNERS = ("finetune.dev/v1alpha1/finetunejobs", "batch/v1/jobs")
GC_DEPENDENTS = ("batch/v1/jobs", "v1/services", "v1/configmaps")


class Kubelet:
    """Turns Jobs into pods and pods into states, as a cluster would, under test control.

    By default pods start running a moment after they appear. A test can hold them
    pending with a reason (`stuck`), fail one (`fail`), preempt one (`preempt`) or let
    all of them succeed (`succeed`); Job conditions follow the pods (backoffLimit 0).

    It also plays kube-controller-manager's garbage collector (a stand-in, named so): an
    object whose owner reference names a uid that no longer exists is deleted, as the
    collector does with the children of a deleted FineTuneJob.
    """

    def __init__(self, server: ApiServer):
        self.server = server
        self.base = str(server.url).rstrip("/")
        self.stuck_reason: tuple[str, str] | None = None
        self.collecting = True
        """The garbage collector runs (a test holds it to stand in for a slow one)."""
        self.created_jobs: list[str] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Kubelet:
        self.session = aiohttp.ClientSession(base_url=self.base)
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.session.close()

    async def _loop(self) -> None:
        seen: set[str] = set()
        while True:
            await self.tick(seen)
            await asyncio.sleep(0.1)

    def pods_by_job(self) -> dict[str | None, list[dict[str, Any]]]:
        """Pods by the uid of the Job that made them (its controller-uid label): a Job
        recreated under the same name does not inherit the old one's pods."""
        grouped: dict[str | None, list[dict[str, Any]]] = {}
        for pod in self.server.live("v1/pods"):
            grouped.setdefault(pod["metadata"].get("labels", {}).get(CONTROLLER_UID),
                               []).append(pod)
        return grouped

    def pods_of(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        return self.pods_by_job().get(job["metadata"]["uid"], [])

    async def collect_garbage(self) -> None:
        """Delete the objects whose every owner is gone (the collector's background
        propagation)."""
        owners = {o["metadata"]["uid"] for resource in GC_OWNERS
                  for o in self.server.live(resource)}
        for resource in GC_DEPENDENTS:
            for obj in self.server.live(resource):
                refs = obj["metadata"].get("ownerReferences") or []
                if refs and not any(r.get("uid") in owners for r in refs):
                    await self._delete(resource, obj)

    async def _delete(self, resource: str, obj: dict[str, Any]) -> None:
        group_version, plural = resource.rsplit("/", 1)
        prefix = "/api/" if group_version == "v1" else "/apis/"
        meta = obj["metadata"]
        url = f"{prefix}{group_version}/namespaces/{meta['namespace']}/{plural}/{meta['name']}"
        async with self.session.delete(url) as response:
            if response.status not in (200, 404):
                response.raise_for_status()

    async def tick(self, seen: set[str]) -> None:
        if self.collecting:
            await self.collect_garbage()
        jobs = self.server.live("batch/v1/jobs")
        pods = self.pods_by_job()
        live = {j["metadata"]["uid"] for j in jobs}
        for owner, orphans in pods.items():  # garbage-collect the pods of deleted Jobs
            if owner not in live:
                for pod in orphans:
                    await self._delete_pod(pod)
        for job in jobs:
            uid = job["metadata"]["uid"]
            if uid not in seen:
                seen.add(uid)
                self.created_jobs.append(job["metadata"]["name"])
            await self._drive(job, pods.get(uid, []))

    async def _drive(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        conditions = {c["type"] for c in job.get("status", {}).get("conditions", [])}
        if conditions & {"Complete", "Failed"}:
            return
        if job["spec"].get("suspend"):
            for pod in pods:
                await self._delete_pod(pod)
            return
        if not pods:
            for index in range(job["spec"]["completions"]):
                await self._create_pod(job, index)
            return
        for pod in pods:
            if pod["status"].get("phase") == "Pending" and self.stuck_reason is None:
                await self._set_pod(pod, {"phase": "Running", "podIP": "127.0.0.1"})
            elif pod["status"].get("phase") == "Pending" and not pod["status"].get(
                    "containerStatuses"):
                await self._set_pod(pod, self._stuck_status(pod))
        phases = [p["status"].get("phase") for p in pods]
        if "Failed" in phases:
            await self._set_job(job, "Failed", "BackoffLimitExceeded",
                                "Job has reached the specified backoff limit")
        elif phases and all(p == "Succeeded" for p in phases):
            await self._set_job(job, "Complete", "CompletionsReached", "")

    def _stuck_status(self, pod: dict[str, Any]) -> dict[str, Any]:
        """As a kubelet: the first init container waits for the stuck reason (they run in
        order, all in the trainer's image here), the rest and the containers wait
        PodInitializing; without init containers, the containers wait for it."""
        reason, message = self.stuck_reason
        stuck = {"waiting": {"reason": reason, "message": message}}
        initializing = {"waiting": {"reason": "PodInitializing"}}
        inits = [c["name"] for c in pod["spec"].get("initContainers") or []]
        containers = [c["name"] for c in pod["spec"]["containers"]]
        return {
            "initContainerStatuses": [{"name": name, "state": initializing if index else stuck}
                                      for index, name in enumerate(inits)],
            "containerStatuses": [{"name": name, "state": initializing if inits else stuck}
                                  for name in containers]}

    async def _create_pod(self, job: dict[str, Any], index: int) -> None:
        template = job["spec"]["template"]
        name = f"{job['metadata']['name']}-{index}-{uuid.uuid4().hex[:5]}"
        labels = {**template["metadata"].get("labels", {}),
                  "batch.kubernetes.io/job-name": job["metadata"]["name"],
                  CONTROLLER_UID: job["metadata"]["uid"]}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": job["metadata"]["namespace"],
                            "labels": labels,
                            "annotations": {COMPLETION_INDEX: str(index)}},
               "spec": template["spec"], "status": {"phase": "Pending"}}
        async with self.session.post(f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods",
                                     json=pod) as response:
            response.raise_for_status()

    async def _set_pod(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        async with self.session.patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                json={"status": status},
                headers={"Content-Type": "application/merge-patch+json"}) as response:
            if response.status != 404:  # deleted meanwhile: a kubelet moves on
                response.raise_for_status()

    async def _set_job(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = job["metadata"]
        condition = {"type": type_, "status": "True", "reason": reason, "message": message}
        async with self.session.patch(
                f"/apis/batch/v1/namespaces/{meta['namespace']}/jobs/{meta['name']}/status",
                json={"status": {"conditions": [condition]}},
                headers={"Content-Type": "application/merge-patch+json"}) as response:
            if response.status != 404:  # deleted meanwhile (a gang restart): the Job
                response.raise_for_status()  # controller moves on; this loop must too

    async def _delete_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        async with self.session.delete(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}") as response:
            if response.status not in (200, 404):
                response.raise_for_status()

    # --- what a test can make happen ---

    def running_pods(self, job_name: str, namespace: str = "default") -> list[dict[str, Any]]:
        job = self.server.get("batch/v1/jobs", namespace, job_name)
        if job is None:
            return []
        return [p for p in self.pods_of(job) if p["status"].get("phase") == "Running"]

    async def fail(self, job_name: str, index: int, exit_code: int = 1, message: str = "",
                   namespace: str = "default") -> None:
        pod = self._pod(job_name, index, namespace)
        await self._set_pod(pod, {"phase": "Failed", "containerStatuses": [{
            "name": "trainer", "state": {"terminated": {
                "exitCode": exit_code, "reason": "Error", "message": message}}}]})

    async def preempt(self, job_name: str, index: int, namespace: str = "default") -> None:
        pod = self._pod(job_name, index, namespace)
        await self._set_pod(pod, {"phase": "Failed", "conditions": [{
            "type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
            "message": "preempted by a higher-priority workload"}]})

    async def succeed(self, job_name: str, namespace: str = "default",
                      message: str = "") -> None:
        """Every pod ends Succeeded; rank 0's trainer with `message` as its termination
        message (what a finished trainer leaves there: its final progress record)."""
        job = self.server.get("batch/v1/jobs", namespace, job_name)
        for pod in self.pods_of(job):
            said = message if pod["metadata"]["annotations"][COMPLETION_INDEX] == "0" else ""
            await self._set_pod(pod, {"phase": "Succeeded", "containerStatuses": [{
                "name": "trainer", "state": {"terminated": {
                    "exitCode": 0, "reason": "Completed", "message": said}}}]})

    def _pod(self, job_name: str, index: int, namespace: str) -> dict[str, Any]:
        job = self.server.get("batch/v1/jobs", namespace, job_name)
        return next(p for p in self.pods_of(job)
                    if p["metadata"]["annotations"][COMPLETION_INDEX] == str(index))
