"""The FineTuneSweeps' side of the controller: their watch cache and one look at a sweep.

A sweep shares the FineTuneJobs' work queue and reconcilers (its key is
`("FineTuneSweep", namespace, name)`), and reads its trials from the jobs' watch cache: a
change of a trial's FineTuneJob (its phase, its progress) wakes its sweep, as a change of a
Job or pod wakes its FineTuneJob. What to do is `sweep.decide`'s (pure); here it is done:
the status first (the journal: a trial is recorded before it is created, marked stopped
before it is deleted), then the creates and deletes, then the events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from finetune_operator.api import KIND, SWEEP_KIND, TERMINAL_PHASES, FineTuneSweep, TrialStatus
from finetune_operator.controller.workqueue import WorkQueue
from finetune_operator.kube import Kube, KubeError, merge_patch, newer, slim
from finetune_operator.reasons import SweepReason
from finetune_operator.reconcile import Event
from finetune_operator.sweep import (
    ENDED,
    LABEL,
    TRIAL_LABEL,
    Child,
    check_sweep,
    child_view,
    decide,
    trial_manifest,
)

logger = logging.getLogger("finetune_operator")

SweepKey = tuple[str, str, str]
"""("FineTuneSweep", namespace, name): a sweep's key in the work queue."""
SETTLE_SECONDS = 0.2
"""A sweep whose trials changed waits this long, so one look takes in a burst of them."""


def sweep_key(namespace: str, name: str) -> SweepKey:
    return (SWEEP_KIND, namespace, name)


class Sweeps:
    """The sweeps as the watch last showed them; `reconcile` is one look at one of them."""

    def __init__(self, kube: Kube, queue: WorkQueue, jobs: Mapping[tuple[str, str], Any],
                 backoff: Callable[[int, float | None], float]) -> None:
        self.kube, self.queue, self.jobs, self.backoff = kube, queue, jobs, backoff
        self.sweeps: dict[tuple[str, str], dict[str, Any]] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self.admitted: dict[tuple[str, str], tuple[Any, list[str]]] = {}
        """Per sweep, (uid, generation) and its errors: a spec is checked once."""

    # --- fed by the watches

    def seen(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if event_type == "DELETED":  # its trials go with it (owner references)
            self.sweeps.pop(key, None)
            self.failures.pop(key, None)
            self.admitted.pop(key, None)
            self.queue.forget(sweep_key(*key))
            return
        current, before = slim(body), self.sweeps.get(key)
        if before is not None and newer(before, current):
            return  # our own status patch showed us this and more
        self.sweeps[key] = current
        if before is None or before["metadata"].get("generation") != meta.get("generation"):
            self.queue.add(sweep_key(*key))

    def trial_changed(self, namespace: str, sweep: str) -> None:
        if (namespace, sweep) in self.sweeps:
            self.queue.add_after(sweep_key(namespace, sweep), SETTLE_SECONDS)

    def forget_all(self) -> None:
        for key in self.sweeps:
            self.queue.forget(sweep_key(*key))
        self.sweeps.clear()
        self.failures.clear()

    def trials(self, body: Mapping[str, Any], metric: str) -> dict[int, Child]:
        """The sweep's trials as the jobs' watch shows them, by number: FineTuneJobs in its
        namespace with its label and owned by it (not by an earlier sweep of that name)."""
        meta = body["metadata"]
        found = {}
        for (namespace, _name), job in list(self.jobs.items()):
            job_meta = job.get("metadata") or {}
            labels = job_meta.get("labels") or {}
            if namespace != meta["namespace"] or labels.get(LABEL) != meta["name"]:
                continue
            owners = {o.get("uid") for o in job_meta.get("ownerReferences") or ()}
            if meta.get("uid") in owners and str(labels.get(TRIAL_LABEL, "")).isdigit():
                found[int(labels[TRIAL_LABEL])] = child_view(job, metric)
        return found

    # --- one look

    async def reconcile(self, key: SweepKey) -> None:
        """One look; a call the API server refused is retried with a backoff."""
        _kind, namespace, name = key
        body = self.sweeps.get((namespace, name))
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            wake = await self._look(body)
        except KubeError as error:
            retry = self.failures.get((namespace, name), 0)
            self.failures[(namespace, name)] = retry + 1
            delay = self.backoff(retry, error.retry_after)
            logger.error("%s/%s: the API server refused a call (%s); retrying in %gs",
                         namespace, name, error, delay)
            self.queue.hold(key, delay)
            return
        self.failures.pop((namespace, name), None)
        if wake is not None:
            self.queue.add_after(key, wake)

    def _admit(self, body: dict[str, Any]) -> tuple[FineTuneSweep | None, list[str]]:
        """The sweep and its spec's errors (checked once per generation: setting every
        searched value into the template costs a validation each)."""
        meta = body["metadata"]
        key, version = (meta["namespace"], meta["name"]), (meta.get("uid"),
                                                             meta.get("generation"))
        known = self.admitted.get(key)
        if known is not None and known[0] == version and not known[1]:
            return FineTuneSweep.model_validate(body), []
        sweep, problems = check_sweep(body)
        errors = [str(p) for p in problems if p.severity == "error"]
        self.admitted[key] = (version, errors)
        return sweep, errors

    async def _look(self, body: dict[str, Any]) -> float | None:
        sweep, errors = self._admit(body)
        old = dict(body.get("status") or {})
        generation = body["metadata"].get("generation")
        edited = old.get("observedGeneration") not in (None, generation)
        if sweep is None or errors:
            message = "; ".join(errors)
            if old.get("phase") != "Failed" or old.get("message") != message:
                await self._patch(body, {**old, "phase": "Failed", "message": message,
                                         "observedGeneration": generation})
                await self._post(body, Event("Warning", SweepReason.INVALID, message))
            return None
        if old.get("phase") == "Failed" and not old.get("trials") and edited:
            # refused as invalid before any trial was made: the edit that fixed it starts it
            sweep, old = sweep.model_copy(update={"status": None}), {}
        elif old.get("phase") in TERMINAL_PHASES and edited:
            await self._patch(body, {**old, "observedGeneration": generation})
            await self._post(body, Event(
                "Warning", SweepReason.SPEC_CHANGE_IGNORED,
                f"the sweep has ended ({old['phase']}): a "
                "change of its spec starts nothing — create a FineTuneSweep of another name "
                "to search again (its trials and their models stay)"))
            return None
        metric = sweep.spec.objective.metric
        trials = self.trials(body, metric)
        for trial in sweep.status.trials if sweep.status else ():
            if trial.number not in trials and trial.phase not in ENDED | {"Creating"}:
                # not in the watch's cache: gone, or not listed yet (an operator just
                # started): only the API server can tell
                job = await self.kube.get(KIND, sweep.namespace, trial.name)
                if job is not None and sweep.metadata.uid in {
                        o.get("uid") for o in job["metadata"].get("ownerReferences") or ()}:
                    trials[trial.number] = child_view(job, metric)
        # optuna's TPE over hundreds of finished trials takes a while: off the event loop
        decision = await asyncio.to_thread(decide, sweep, trials, datetime.now(UTC))
        decision.status.observed_generation = generation
        new = decision.status.to_dict()
        if new != old:
            body = await self._patch(body, new) or body
        refused = [await self._create(sweep, trial) for trial in decision.create]
        if any(refused):
            status = decision.status.model_copy(deep=True)
            for trial, why in zip(decision.create, refused, strict=True):
                if why:
                    _refused(next(t for t in status.trials if t.number == trial.number), why)
                    decision.events.append(Event("Warning", SweepReason.TRIAL_REFUSED,
                                                 f"{trial.name}: {why}"))
            body = await self._patch(body, status.to_dict()) or body
        for trial_name in decision.delete:
            await self.kube.delete_finetunejob(sweep.namespace, trial_name)
        for event in decision.events:
            await self._post(body, event)
        return decision.wake_after

    async def _create(self, sweep: FineTuneSweep, trial: TrialStatus) -> str | None:
        """Create the trial's FineTuneJob (one that exists already: done); the API server's
        reason when it refuses the job itself (invalid: retrying cannot help)."""
        try:
            await self.kube.create(trial_manifest(sweep, trial))
        except KubeError as error:
            if error.status in (400, 422):
                return str(error)
            raise
        return None

    async def _patch(self, body: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
        meta = body["metadata"]
        patched = await self.kube.patch_status(SWEEP_KIND, meta["namespace"], meta["name"],
                                               merge_patch(dict(body.get("status") or {}), new))
        key = (meta["namespace"], meta["name"])
        if patched is not None and key in self.sweeps and newer(slim(patched),
                                                                self.sweeps[key]):
            self.sweeps[key] = slim(patched)
        return patched

    async def _post(self, body: dict[str, Any], event: Event) -> None:
        try:
            await self.kube.post_event(body, event.type, event.reason, event.message)
        except KubeError as error:
            logger.warning("%s/%s: event %s not posted: %s", body["metadata"].get("namespace"),
                           body["metadata"].get("name"), event.reason, error)


def _refused(trial: TrialStatus, why: str) -> None:
    trial.phase, trial.message = "Failed", f"the API server refused its FineTuneJob: {why}"
