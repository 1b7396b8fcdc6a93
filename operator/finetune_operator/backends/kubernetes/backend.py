"""The kubernetes backend: the pure parts (`workers`, `states`) plus the API calls."""

from __future__ import annotations

import asyncio
import logging
import posixpath
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import aiohttp

from finetune_operator import naming
from finetune_operator.api import FineTuneJob, Progress
from finetune_operator.backends import BackendContext, LaunchBlocked
from finetune_operator.backends.children import Children, foreign, owner_uid
from finetune_operator.backends.kubernetes.states import (
    creation_failure,
    mount_failure,
    mounting,
    named_by_field,
    needs_creation_events,
    observe,
    output_claim_problem,
    progress_from_record,
    queue_state,
    waiting_for_leftovers,
)
from finetune_operator.backends.kubernetes.workers import (
    COMPLETION_INDEX_KEY,
    mount,
    render,
    validate,
)
from finetune_operator.kube import KUEUE_JOB_UID_LABEL, KubeError, timestamp
from finetune_operator.output_folders import folder_key
from finetune_operator.reconcile import Observation, queued
from finetune_operator.validation import Problem
from finetune_trainer.uris import Location

logger = logging.getLogger("finetune_operator.kubernetes")
CREATION_GRACE_SECONDS = 3.0
"""How long a Job may lack pods before the operator asks the events why."""
CREATION_EVENTS_SECONDS = 10.0
"""How long one read of a namespace's FailedCreate (or pods' Warning) events serves every
job in it that waits for pods: a burst of a thousand Jobs the Job controller is slow to fill
costs one list per namespace this often, not one per job."""
MOUNT_GRACE_SECONDS = 10.0
"""How long a scheduled pod may be on its way (its volumes mounting) before the operator
asks the kubelet's events why (a ConfigMap or Secret the namespace lacks, a disk attached
to another node): nothing in the pod's status says so."""
JOB_WARNINGS = "involvedObject.kind=Job,reason=FailedCreate"
POD_WARNINGS = "involvedObject.kind=Pod,type=Warning"
QUEUE_LOOK_SECONDS = 120.0
"""How often a queued Job's Kueue Workload is read once the Job is older than that: its
message (why Kueue waits) changes seldom, admission itself arrives through the Job's watch,
and a read every look would cost 1,000 queued jobs 100 requests/s at the default interval."""


def output_folder(job: FineTuneJob) -> str | None:
    """The claim and path the workers write: a pvc:// output, or an absolute path on a claim
    of `spec.kubernetes.volumes`; None for a path on the pod's own disk (no other job's)."""
    location = job.spec.output.location
    if location.scheme == "pvc":
        return folder_key("pvc", job.namespace, location.uri.pvc_claim, location.uri.pvc_subpath)
    if location.scheme != "path" or job.spec.kubernetes is None:
        return None
    path = posixpath.normpath(location.raw)
    for volume in job.spec.kubernetes.volumes:
        mounted = posixpath.normpath(volume.mount_path)
        if volume.persistent_volume_claim is not None and (
                path == mounted or path.startswith(mounted.rstrip("/") + "/")):
            return folder_key("pvc", job.namespace, volume.persistent_volume_claim.claim_name,
                              posixpath.relpath(path, mounted))
    return None


# --- the backend: the pure parts of `workers` and `states`, plus the API calls ----------

class KubernetesBackend:
    """torchrun pods in an Indexed Job on this cluster."""

    name = "kubernetes"
    cleanup_on_delete = False
    """Every child is owned by its FineTuneJob: the garbage collector removes them, and a
    deleted job needs no finalizer (nor this operator running) to go."""

    def __init__(self, context: BackendContext):
        self.settings = context.settings
        self.kube = context.kube  # None offline: then only validate and render are used
        self.progress_port = context.progress_port or context.settings.metrics_port
        self._queue_looks: dict[str, tuple[float, bool | None, str | None, str | None]] = {}
        """Job uid → (when, active, waiting, evicted) of its Kueue Workload's last read."""
        self._events: dict[tuple[str, str], tuple[float, asyncio.Future]] = {}
        """(namespace, field selector) → (when, the read) of those events (`_warnings`)."""
        self.children = Children()
        """The workers as the operator's watches see them; until the controller attaches its
        indexes (and outside the operator), `observe` asks the API server instead."""

    def mount(self, location: Location) -> str:
        return mount(location)

    def validate(self, job: FineTuneJob) -> list[Problem]:
        return validate(job, self.settings)

    def output_folder(self, job: FineTuneJob) -> str | None:
        return output_folder(job)

    def render(self, job: FineTuneJob) -> list[dict[str, Any]]:
        return render(job, self.settings)

    async def launch(self, job: FineTuneJob) -> None:
        if (unshared := output_claim_problem(job, await self._output_claim(job))) is not None:
            raise LaunchBlocked(unshared, retry_after=300)
        config_map, service, workload = self.render(job)
        # the pods mount the ConfigMap and resolve rank 0 through the Service: both first
        await asyncio.gather(self._create(job, config_map), self._create(job, service))
        await self._create(job, workload)

    async def _create(self, job: FineTuneJob, obj: dict[str, Any]) -> None:
        created = await self.kube.create(obj)
        if not created and obj["kind"] == "ConfigMap":
            await self._refresh_config(job, obj)
        self.children.created(obj)
        logger.info("%s %s %s/%s", "created" if created else "found", obj["kind"],
                    job.namespace, obj["metadata"]["name"])

    async def _refresh_config(self, job: FineTuneJob, config_map: dict[str, Any]) -> None:
        """A relaunch finds the job's ConfigMap from before: the workers get the trainer
        config rendered now (the spec as launched after a restart, the edited one after an
        edit before any worker ran)."""
        name = config_map["metadata"]["name"]
        current = await self.kube.get("ConfigMap", job.namespace, name)
        if current is None or owner_uid(current) != job.metadata.uid or (
                current.get("data") == config_map["data"]):
            return
        await self.kube.patch("ConfigMap", job.namespace, name, {"data": config_map["data"]})
        logger.info("updated ConfigMap %s/%s to the config launched now", job.namespace, name)

    async def _output_claim(self, job: FineTuneJob) -> dict[str, Any] | None:
        """The output's PersistentVolumeClaim of a multi-node job (None otherwise, or when it
        cannot be read: the pods then say what is wrong with it)."""
        uri = job.spec.output.location.uri
        if job.spec.resources.nodes < 2 or uri.scheme != "pvc":
            return None
        try:
            return await self.kube.get("PersistentVolumeClaim", job.namespace, uri.pvc_claim)
        except KubeError as error:
            logger.warning("cannot read claim %s/%s (%s): launching without checking that it "
                           "is ReadWriteMany", job.namespace, uri.pvc_claim, error)
            return None

    async def observe(self, job: FineTuneJob) -> Observation:
        seen = await (self._observe_watched(job) if self.children.ready
                      else self._observe_asking(job))
        return replace(seen, waiting=named_by_field(job, seen.waiting)) if seen.waiting else seen

    async def _observe_asking(self, job: FineTuneJob) -> Observation:
        """The observation read from the API server: until the watches are up, and outside
        the operator."""
        children = (("Job", naming.worker_job(job.name)),
                    ("Service", naming.headless_service(job.name)),
                    ("ConfigMap", naming.trainer_config_map(job.name)))
        workload, *others = await asyncio.gather(
            *(self.kube.get(kind, job.namespace, name) for kind, name in children))
        found = [(kind, obj) for (kind, _), obj in zip(children, (workload, *others),
                                                        strict=True) if obj is not None]
        if leftovers := foreign(found, job.metadata.uid):
            return waiting_for_leftovers(job, leftovers)
        if workload is None:
            return Observation()
        selector = f"{naming.LABEL_JOB}={job.name}"
        pods = [p for p in await self.kube.pods(job.namespace, selector)
                if p["metadata"].get("labels", {}).get(naming.LABEL_JOB) == job.name]
        nodes = job.spec.resources.nodes
        not_created = None
        if needs_creation_events(workload, pods, nodes):
            not_created = creation_failure(await self.kube.events(
                job.namespace, "Job", naming.worker_job(job.name),
                workload["metadata"].get("uid")))
        not_mounted = await self._not_mounted(job.namespace, pods)
        seen = await self._with_queue(job, workload, observe(
            workload, pods, nodes, await self.progress(pods), not_created, not_mounted,
            now=datetime.now(UTC)))
        missing = tuple(f"{kind} {name}" for (kind, name), found
                        in zip(children[1:], others, strict=True) if found is None)
        return replace(seen, missing=missing) if missing and not seen.deleting else seen

    async def _observe_watched(self, job: FineTuneJob) -> Observation:
        """The same observation from the watches: no API call, except the Job controller's
        events while pods are missing (nothing else says why) and rank 0's /progress."""
        children, ns = self.children, job.namespace
        if leftovers := children.foreign(ns, job.name, job.metadata.uid):
            return waiting_for_leftovers(job, leftovers)  # their deletion wakes it
        workload = children.get("Job", ns, job.name, naming.worker_job(job.name))
        if workload is None:
            return Observation()
        pods = children.of("Pod", ns, job.name)
        nodes = job.spec.resources.nodes
        not_created, polled = None, False
        if needs_creation_events(workload, pods, nodes):
            # the Job controller creates pods within a second; later, only its events say why
            # not (a refused PriorityClass, a quota), and no watch event says when to ask
            polled = True
            if self._age(workload) > CREATION_GRACE_SECONDS:
                failed = await self._warnings(ns, JOB_WARNINGS)
                not_created = creation_failure(failed.get(workload["metadata"].get("uid"), []))
        # nor does a watch event say when the kubelet gives up on a pod's volumes
        polled = polled or any(map(mounting, pods))
        not_mounted = await self._not_mounted(ns, pods)
        progress = await self.progress(pods)
        seen = await self._with_queue(job, workload, observe(
            workload, pods, nodes, progress, not_created, not_mounted, now=datetime.now(UTC)))
        missing = tuple(f"{kind} {name}" for kind, name in (
            ("Service", naming.headless_service(job.name)),
            ("ConfigMap", naming.trainer_config_map(job.name)))
            if children.get(kind, ns, job.name, name) is None)
        # rank 0's progress is read, never told: look again while it can be read
        polled = polled or seen.polled or (
            (seen.running or progress is not None) and not seen.succeeded)
        seen = replace(seen, polled=polled)
        return replace(seen, missing=missing) if missing and not seen.deleting else seen

    async def _not_mounted(self, namespace: str, pods: list[dict[str, Any]]) -> str | None:
        """Why the first pod on its way for MOUNT_GRACE_SECONDS cannot mount its volumes,
        from its Warning events (one list per namespace, `_warnings`)."""
        late = [p for p in pods if mounting(p) and self._age(p) > MOUNT_GRACE_SECONDS
                and not p["metadata"].get("deletionTimestamp")]
        if not late:
            return None
        warnings = await self._warnings(namespace, POD_WARNINGS)
        return next((why for pod in late if (why := mount_failure(
            pod, warnings.get(pod["metadata"].get("uid"), [])))), None)

    async def _warnings(self, namespace: str, fields: str
                        ) -> dict[str | None, list[dict[str, Any]]]:
        """The events in `namespace` that `fields` selects (the Job controller's
        FailedCreate, the pods' Warnings), by the uid of their object: one list, shared by
        every look within CREATION_EVENTS_SECONDS (and by the looks that ask while it is on
        its way)."""
        now = time.monotonic()
        cached = self._events.get((namespace, fields))
        if cached is None or now - cached[0] > CREATION_EVENTS_SECONDS or (
                cached[1].done() and cached[1].exception() is not None):
            cached = (now, asyncio.ensure_future(self._read_events(namespace, fields)))
            self._events[namespace, fields] = cached
        return await asyncio.shield(cached[1])

    async def _read_events(self, namespace: str, fields: str
                           ) -> dict[str | None, list[dict[str, Any]]]:
        events = await self.kube.list("Event", namespace, fields=fields,
                                      action=f"list the events of {namespace} ({fields})")
        by_uid: dict[str | None, list[dict[str, Any]]] = {}
        for event in events:
            by_uid.setdefault((event.get("involvedObject") or {}).get("uid"), []).append(event)
        return by_uid

    async def _with_queue(self, job: FineTuneJob, workload: dict[str, Any],
                          seen: Observation) -> Observation:
        """Add Kueue's word while it matters: the job waits to be admitted, or is to be
        suspended (one API call; the Workload is not watched)."""
        if not queued(job) or seen.deleting:
            return seen
        uid, now = workload["metadata"]["uid"], time.monotonic()
        if not (seen.suspended or job.spec.run_policy.suspend):
            # admitted: what Kueue said before is old news when it evicts the job
            self._queue_looks.pop(uid, None)
            return seen
        last = self._queue_looks.get(uid)
        if last is None or job.spec.run_policy.suspend or now - last[0] > QUEUE_LOOK_SECONDS \
                or self._age(workload) < QUEUE_LOOK_SECONDS:
            try:
                found = await self.kube.kueue_workload(job.namespace, uid)
            except KubeError as error:  # 403: a chart without the Workload rule
                logger.warning("cannot read the Kueue Workload of %s/%s: %s", job.namespace,
                               job.name, error)
                return seen
            last = (now, *queue_state(found, self._age(workload)))
            self._queue_looks[uid] = last
        # no watch event says when Kueue's answer changes: look again while it is awaited
        return replace(seen, queue_active=last[1], queue_message=last[2], queue_evicted=last[3],
                       polled=seen.polled or not job.spec.run_policy.suspend)

    async def _kueue_workload(self, job: FineTuneJob) -> dict[str, Any] | None:
        if not queued(job):
            return None
        name = naming.worker_job(job.name)
        workload = (self.children.get("Job", job.namespace, job.name, name)
                    if self.children.ready else await self.kube.get("Job", job.namespace, name))
        if workload is None:
            return None
        return await self.kube.kueue_workload(job.namespace, workload["metadata"]["uid"])

    def _forget_queue_look(self, job: FineTuneJob) -> None:
        """The Job goes (a restart, a deletion): its Workload's last read with it."""
        workload = self.children.get("Job", job.namespace, job.name, naming.worker_job(job.name))
        if workload is not None:
            self._queue_looks.pop(workload["metadata"]["uid"], None)

    @staticmethod
    def _age(obj: dict[str, Any]) -> float:
        created = timestamp(obj["metadata"].get("creationTimestamp"))
        return (datetime.now(UTC) - created).total_seconds() if created else 0.0

    async def progress(self, pods: list[dict[str, Any]]) -> Progress | None:
        """Rank 0's latest progress record, or None when it cannot be read right now."""
        rank0 = next((p for p in pods
                      if p["metadata"].get("annotations", {}).get(COMPLETION_INDEX_KEY) == "0"
                      and p.get("status", {}).get("phase") in ("Running", "Succeeded")
                      and p.get("status", {}).get("podIP")), None)
        if rank0 is None:
            return None
        url = f"http://{rank0['status']['podIP']}:{self.progress_port}/progress"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
                async with session.get(url) as response:
                    if response.status != 200:
                        return None
                    # a record that is no ProgressRecord (another version's): ValueError
                    return progress_from_record(await response.json())
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            logger.debug("progress of %s not readable: %s", rank0["metadata"]["name"], error)
            return None

    async def suspend(self, job: FineTuneJob) -> None:
        """A queued job is suspended through Kueue's own switch: Kueue unsuspends an admitted
        Job that anyone else suspends, and only a deactivated Workload frees its quota."""
        await self._switch(job, run=False)

    async def resume(self, job: FineTuneJob) -> None:
        """A queued job goes back into its queue; Kueue unsuspends the Job on admission."""
        await self._switch(job, run=True)

    async def _switch(self, job: FineTuneJob, run: bool) -> None:
        """The Workload's `spec.active` where Kueue has one, else the Job's `suspend`."""
        if (kueue_workload := await self._kueue_workload(job)) is not None:
            await self.kube.activate_kueue_workload(
                job.namespace, kueue_workload["metadata"]["name"], run)
            self._queue_looks.pop(kueue_workload["metadata"]["labels"][KUEUE_JOB_UID_LABEL],
                                  None)
            return
        await self.kube.suspend_job(job.namespace, naming.worker_job(job.name), not run)

    async def restart(self, job: FineTuneJob) -> None:
        # Foreground: the Job stays (deleting) until its pods are gone, so the next gang
        # never meets the old one's hostnames
        self._forget_queue_look(job)
        await self.kube.delete("Job", job.namespace, naming.worker_job(job.name))
        self.children.deleted("Job", job.namespace, job.name, naming.worker_job(job.name))

    def forget(self, namespace: str, name: str) -> None:
        """The FineTuneJob is gone: what the backend remembered of it goes too."""
        workload = self.children.get("Job", namespace, name, naming.worker_job(name)) \
            if self.children.ready else None
        if workload is not None:
            self._queue_looks.pop(workload["metadata"].get("uid"), None)
        self.children.forget(namespace, name)

    async def cancel(self, job: FineTuneJob) -> None:
        """Owner references would collect these too; deleting them now frees the name."""
        self._forget_queue_look(job)
        await self.kube.delete("Job", job.namespace, naming.worker_job(job.name))
        await self.kube.delete("Service", job.namespace, naming.headless_service(job.name),
                               "Background")
        await self.kube.delete("ConfigMap", job.namespace, naming.trainer_config_map(job.name),
                               "Background")
        self.children.forget(job.namespace, job.name)
