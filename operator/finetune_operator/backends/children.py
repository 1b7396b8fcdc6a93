"""What the operator's watches hold of every job's children: the kubernetes backend reads
its observations from here instead of asking the API server, as controller-runtime's
informers do.

The controller registers one `kopf.index` per child resource (`RESOURCES`), filtered by the
operator's managed-by label; kopf fills them from its watch streams (and lists them in full
before any FineTuneJob is handled, so a restarted operator never mistakes a child not yet
listed for one that is gone). Each index keeps a small projection of each object (`slim`),
keyed by (namespace, FineTuneJob name): what `kubernetes.observe` reads, nothing more.

A watch lags the writes it reports. Two expectations cover the operator's own writes until
the watch shows them (controller-runtime's ReplicaSet controller keeps the same kind):
a child just created counts as existing, and a Job whose deletion was just asked for counts
as being deleted, so a look in between neither creates twice nor restarts twice.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

from finetune_operator import naming

COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
CONTROLLER_UID_KEY = "batch.kubernetes.io/controller-uid"
"""The uid of the Job that made a pod (a label the Job controller sets): a gang restart's
new Job has the old one's name, never its uid."""
RESOURCES: dict[str, tuple[str, str, str]] = {  # kind: (group, version, plural)
    "Job": ("batch", "v1", "jobs"),
    "Pod": ("", "v1", "pods"),
    "Service": ("", "v1", "services"),
    "ConfigMap": ("", "v1", "configmaps"),
}
MANAGED = {naming.LABEL_MANAGED_BY: naming.MANAGER}
"""The label every child carries (pods through the Job's template): what the watches select."""
EXPECTATION_SECONDS = 60.0
"""How long an expectation holds without the watch confirming it (a lost event, a hand edit)."""

Key = tuple[str, str]  # (namespace, FineTuneJob name)


def owner_key(body: Mapping[str, Any]) -> Key | None:
    meta = body.get("metadata") or {}
    job = (meta.get("labels") or {}).get(naming.LABEL_JOB)
    return (meta.get("namespace") or "", job) if job else None


def _pick(source: Mapping[str, Any] | None, *keys: str) -> dict[str, Any]:
    return {k: source[k] for k in keys if source and source.get(k) is not None}


def owner_uid(body: Mapping[str, Any]) -> str | None:
    """The uid of the FineTuneJob a child belongs to (its controlling owner reference)."""
    refs = (body.get("metadata") or {}).get("ownerReferences") or []
    return next((r.get("uid") for r in refs if r.get("controller")), None)


ORPHANED = " (no owner)"
"""Marks a leftover that nothing will collect: its job was deleted with
`--cascade=orphan` (or Argo CD's PrunePropagationPolicy=orphan)."""


def foreign(children: Iterable[tuple[str, Mapping[str, Any]]], uid: str | None) -> list[str]:
    """`Kind name` of each of `children` (kind, object) that the job of `uid` does not
    control: an earlier job of the same name, deleted, whose children remain (ORPHANED
    where they have no owner at all: adopted, they ran the earlier job's config and were
    orphaned again when this one was deleted)."""
    if not uid:
        return []
    return [f"{kind} {child['metadata']['name']}{ORPHANED if owner is None else ''}"
            for kind, child in children if (owner := owner_uid(child)) != uid]


def slim(kind: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a child the observation reads (a Pod's spec, a Job's template and every
    managedFields entry stay out of memory)."""
    meta = body.get("metadata") or {}
    out: dict[str, Any] = {"kind": kind, "metadata": {
        **_pick(meta, "name", "namespace", "uid", "creationTimestamp", "deletionTimestamp"),
        "labels": _pick(meta.get("labels"), naming.LABEL_JOB, CONTROLLER_UID_KEY),
        "annotations": _pick(meta.get("annotations"), COMPLETION_INDEX_KEY)}}
    if (owner := owner_uid(body)) is not None:
        out["metadata"]["ownerReferences"] = [{"uid": owner, "controller": True}]
    status = body.get("status") or {}
    if kind == "Job":
        out["spec"] = _pick(body.get("spec"), "suspend")
        out["status"] = {"conditions": [_pick(c, "type", "status", "reason", "message")
                                        for c in status.get("conditions") or []]}
    elif kind == "Pod":
        out["spec"] = _pick(body.get("spec"), "nodeName")
        out["status"] = {
            **_pick(status, "phase", "reason", "message", "podIP"),
            "conditions": [_pick(c, "type", "status", "reason", "message")
                           for c in status.get("conditions") or []],
            **{field: [_pick(c, "name", "state") for c in status.get(field) or []]
               for field in ("initContainerStatuses", "containerStatuses")}}
    return out


class Children:
    """The children of every FineTuneJob as the watches last reported them, plus the
    operator's own writes they have not reported yet."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.indexes: dict[str, Mapping[Key, Any]] = {}
        """kind → kopf's index of that kind (set by the controller once kopf runs)."""
        self.clock = clock
        self._created: dict[tuple[str, str, str], tuple[float, dict[str, Any]]] = {}
        self._deleting: dict[tuple[str, str, str], tuple[float, str | None]] = {}

    @property
    def ready(self) -> bool:
        """Every child resource is watched: read from here, not from the API server."""
        return all(kind in self.indexes for kind in RESOURCES)

    def indexer(self, kind: str, changed: Callable[[Key], None] | None = None
                ) -> Callable[..., Awaitable[dict[Key, dict[str, Any]] | None]]:
        """The kopf.index function of `kind`: its objects by owning FineTuneJob. It also
        calls `changed(key)` when what the observation reads of the object changed (most
        watch events of a pod change only what `slim` leaves out), so one handler per event
        both indexes and wakes. Async: kopf runs a sync handler in a thread."""
        async def index(body: Mapping[str, Any], **_: Any
                        ) -> dict[Key, dict[str, Any]] | None:
            key = owner_key(body)
            if key is None:
                return None
            projection = slim(kind, body)
            if changed is not None and projection not in self._indexed(kind, key):
                changed(key)  # kopf stores the projection before the woken worker looks
            return {key: projection}
        return index

    def _indexed(self, kind: str, key: Key) -> Collection[dict[str, Any]]:
        index = self.indexes.get(kind)
        return index.get(key, ()) if index is not None else ()

    def of(self, kind: str, namespace: str, job: str) -> list[dict[str, Any]]:
        """`kind` children of one FineTuneJob (by its label), expectations applied."""
        found = [dict(o) for o in self.indexes[kind].get((namespace, job), ())]
        names = {o["metadata"]["name"] for o in found}
        now = self.clock()
        for (ns, k, name), (when, obj) in list(self._created.items()):
            if ns != namespace or k != kind or obj["metadata"]["labels"].get(
                    naming.LABEL_JOB) != job:
                continue
            if name in names or now - when > EXPECTATION_SECONDS:
                del self._created[ns, k, name]  # the watch has shown it (or never will)
            else:
                found.append(obj)
        for i, obj in enumerate(found):
            meta = obj["metadata"]
            expected = self._deleting.get((namespace, kind, meta["name"]))
            if expected is None:
                continue
            when, uid = expected
            if meta.get("deletionTimestamp") or uid != meta.get("uid") or (
                    now - when > EXPECTATION_SECONDS):
                del self._deleting[namespace, kind, meta["name"]]
            else:
                found[i] = {**obj, "metadata": {**meta, "deletionTimestamp": "expected"}}
        return found

    def foreign(self, namespace: str, job: str, uid: str | None) -> list[str]:
        """Children of an earlier FineTuneJob of the same name (deleted and made again
        before the garbage collector removed them): `Kind name` of each."""
        return foreign(((kind, o) for kind in ("Job", "Service", "ConfigMap")
                        for o in self.of(kind, namespace, job)), uid)

    def get(self, kind: str, namespace: str, job: str, name: str) -> dict[str, Any] | None:
        return next((o for o in self.of(kind, namespace, job)
                     if o["metadata"]["name"] == name), None)

    def created(self, obj: Mapping[str, Any]) -> None:
        """The operator created (or found) `obj`: it exists, whatever the watch says yet."""
        meta = obj["metadata"]
        self._deleting.pop((meta["namespace"], obj["kind"], meta["name"]), None)
        self._created[meta["namespace"], obj["kind"], meta["name"]] = (
            self.clock(), slim(obj["kind"], obj))

    def deleted(self, kind: str, namespace: str, job: str, name: str) -> None:
        """The operator asked for the deletion of the child it sees now."""
        self._created.pop((namespace, kind, name), None)
        current = self.get(kind, namespace, job, name)
        if current is not None:
            self._deleting[namespace, kind, name] = (self.clock(),
                                                     current["metadata"].get("uid"))

    def forget(self, namespace: str, job: str) -> None:
        """The FineTuneJob is gone: drop what was expected of its children."""
        for store in (self._created, self._deleting):
            for key in [k for k in store if k[0] == namespace and (
                    k[2] in (naming.worker_job(job), naming.headless_service(job),
                             naming.trainer_config_map(job)))]:
                del store[key]
