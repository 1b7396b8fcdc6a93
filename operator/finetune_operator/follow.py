"""`finetune status` and `finetune logs`: one job followed from a terminal, on a cluster (any
kubeconfig) or in the output folder of `finetune run`.

What is shown is built by pure functions from what was read (the FineTuneJob and its
events, or progress.json), so the terminal view is tested without a terminal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic
import yaml

from finetune_operator.api import (
    KIND,
    SWEEP_KIND,
    FineTuneJob,
    FineTuneJobStatus,
    FineTuneSweep,
    FineTuneSweepStatus,
    Progress,
)
from finetune_operator.local.lock import holder, ran_here
from finetune_operator.manifests import MANIFEST_SUFFIXES, one_document
from finetune_trainer.layout import LOCAL_CONFIG, PROGRESS_FILE, RUN_LOG, resolve_output
from finetune_trainer.record import ProgressRecord, format_duration, headline
from finetune_trainer.uris import UriError

if TYPE_CHECKING:  # `finetune run` follows a local run: no Kubernetes client to import
    from collections.abc import Collection

    from finetune_operator.kube import Kube

FINISHED = {"Succeeded": 0, "Failed": 1, "Stopped": 1}
"""Phases after which nothing changes, and the exit code `--watch` ends with."""
EVENTS_SHOWN = 5


@dataclass
class JobView:
    """One job as the terminal shows it."""

    name: str
    phase: str | None
    message: str | None = None
    progress: Progress | None = None
    restarts: int = 0
    conditions: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(type, status, reason, message)"""
    events: list[tuple[str, str, str]] = field(default_factory=list)
    """(type, reason, message), oldest first."""
    where: str | None = None
    """The backend's own object (and its Studio link), or the output folder."""
    details: list[str] | None = None
    """Lines shown instead of the progress bar (a sweep's trials and best)."""

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED


NOT_SEEN = ("no operator has acted on it yet — is one running, and watching this namespace? "
            "`kubectl get pods -A -l app.kubernetes.io/name=finetune-operator` lists them; "
            "`helm install` installs one (charts/finetune-operator)")
"""Said of a FineTuneJob with no status at all: an operator sets phase Pending within a
second of seeing one, so none has (none installed, stopped, or watching other namespaces)."""


def seen_by_an_operator(obj: dict[str, Any]) -> bool:
    return bool((obj.get("status") or {}).get("phase"))


def view_of_job(obj: dict[str, Any], events: list[dict[str, Any]]) -> JobView:
    """A FineTuneJob as read from the API server, with the events about it."""
    if not seen_by_an_operator(obj):
        return JobView(name=obj["metadata"]["name"], phase=None, message=NOT_SEEN,
                       details=[], events=_last_events(events))  # details: no progress bar
    status = FineTuneJobStatus.model_validate(obj.get("status") or {})
    ref = status.backend_ref
    where = None if ref is None else f"{ref.kind} {ref.name}" + (f" ({ref.url})" if ref.url
                                                                  else "")
    return JobView(
        name=obj["metadata"]["name"], phase=status.phase, message=status.message,
        progress=status.progress, restarts=status.restarts, where=where,
        conditions=[(c.type, c.status, c.reason or "", c.message or "")
                    for c in status.conditions],
        events=_last_events(events))


def view_of_sweep(obj: dict[str, Any], events: list[dict[str, Any]]) -> JobView:
    """A FineTuneSweep as read from the API server: a line per trial (phase, step, the
    objective, its values) and the best trial so far, with the events about it."""
    status = FineTuneSweepStatus.model_validate(obj.get("status") or {})
    spec = obj.get("spec") or {}
    metric = (spec.get("objective") or {}).get("metric", "evalLoss")
    made = f"trials: {status.trial_count}" + (f" of {spec['maxTrials']}" if spec.get(
        "maxTrials") else "") + f", {status.running_trials} running"
    width = max((len(t.name) for t in status.trials), default=0)
    details = [made] + [
        f"  {t.name:<{width}}  {t.phase:<9}  step {_figure(t.step, '{}'):>6}  "
        f"{metric} {_figure(t.objective, '{:.4f}'):>7}  {_values(t.params)}"
        + (f"  ({t.message})" if t.message and t.phase != "Succeeded" else "")
        for t in status.trials]
    if (best := status.best) is not None:
        details.append(f"best: {best.name} {metric} {best.objective:.4f} "
                       f"({_values(best.params)}), model in {best.output}")
    return JobView(name=obj["metadata"]["name"], phase=status.phase, message=status.message,
                   details=details, events=_last_events(events))


def _last_events(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The last EVENTS_SHOWN events, oldest first, as (type, reason, message). Timestamps
    have whole seconds: events of one second are in the order the API server stored them
    (the later a write, the larger its resourceVersion, etcd's revision)."""
    def when(event: dict[str, Any]) -> tuple[str, int]:
        version = str((event.get("metadata") or {}).get("resourceVersion") or "0")
        return (event.get("lastTimestamp") or event.get("eventTime") or "",
                int(version) if version.isdigit() else 0)

    ordered = sorted(events, key=when)
    return [(e.get("type") or "", e.get("reason") or "", (e.get("message") or "").strip())
            for e in ordered[-EVENTS_SHOWN:]]


def _figure(value: float | int | None, shown: str) -> str:
    return "-" if value is None else shown.format(value)


def _values(params: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}"
                     for key, value in params.items())


def view_of_output(name: str, folder: Path) -> JobView:
    """A `finetune run` from its output folder: progress.json, as rank 0 last wrote it; a
    run that says Running with no `finetune run` left holding the folder was stopped."""
    record = read_progress(folder)
    if record is None:
        if not ran_here(folder):
            if folder.is_dir() and any(folder.iterdir()):  # a model's folder, say
                raise NotARun(f"{folder}: not a `finetune run` output folder (no "
                              f"{PROGRESS_FILE}, no run lock in logs/): name a run's output "
                              "folder or its manifest")
            return JobView(name=name, phase="Pending", where=str(folder), message=(
                "no `finetune run` has written here yet"))  # --watch waits for one
        if holder(folder) is None:
            return JobView(name=name, phase="Stopped", where=str(folder), message=(
                "ended before its first step (interrupted); the same `finetune run` starts "
                "again"))
        return JobView(name=name, phase="Pending", where=str(folder),
                       message=f"no {PROGRESS_FILE} yet: the run has not logged a step")
    phase, message = record.phase, None
    if phase == "Failed":  # the run, its fetch or its checks of the model and data
        message = (f"`finetune logs {folder}` shows why; once mended, the same `finetune "
                   "run` starts again (from the newest checkpoint, if any)")
    if phase == "Running" and ran_here(folder) and holder(folder) is None:
        phase, message = "Stopped", (
            "no `finetune run` is writing here: it ended without finishing (killed, or the "
            "machine restarted); the same `finetune run` resumes from the newest checkpoint")
    return JobView(name=name, phase=phase, message=message, where=str(folder),
                   progress=Progress.from_record(record))


def read_progress(output_dir: Path) -> ProgressRecord | None:
    """A `finetune run` output folder's progress.json as rank 0 last wrote it (None: none
    yet, or unreadable)."""
    try:
        return ProgressRecord.model_validate_json((output_dir / PROGRESS_FILE).read_bytes())
    except (OSError, ValueError):
        return None


def _job_name(folder: Path) -> str:
    """The job a `finetune run` output folder belongs to, as its trainer config names it;
    the folder's name where it has none (not written by `finetune run`)."""
    try:
        return yaml.safe_load((folder / LOCAL_CONFIG).read_text())["job"]["name"]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, TypeError, KeyError):
        return folder.name


class NotARun(Exception):
    """A NAME that can only mean this machine (a path) and names no `finetune run`."""


class OnItsCluster(NotARun):
    """A manifest whose job runs on a cluster (its output is there, or it is a sweep): with
    no cluster named, said so; with `-n` or `--kubeconfig`, its cluster is asked for it."""

    def __init__(self, message: str, kind: str, name: str, namespace: str) -> None:
        super().__init__(message)
        self.kind, self.name, self.namespace = kind, name, namespace


def looks_local(target: str) -> bool:
    """A path, never an object's name: it holds a `/` or ends in a manifest's suffix."""
    return "/" in target or Path(target).suffix.lower() in MANIFEST_SUFFIXES


def output_folder(target: str) -> tuple[str, Path] | None:
    """(name, output folder) when `target` means this machine: a `finetune run` output
    folder, or the manifest it ran (its spec.output.uri, relative to the manifest); None
    for a FineTuneJob's name. NotARun where it is a path (a `/` or a manifest's suffix:
    never a FineTuneJob's name) to nothing or to a manifest that does not parse: asking a
    cluster about it would only say the kubeconfig's problem; OnItsCluster for a manifest
    of a job that runs on a cluster."""
    path = Path(target)
    if path.is_dir():
        return _job_name(path.resolve()), path.resolve()
    if path.is_file():
        kind = None
        try:  # read as `validate` reads it, and kubectl
            document = one_document(path.read_text())
            kind = document.get("kind") if isinstance(document, dict) else None
            if kind == SWEEP_KIND:
                sweep = FineTuneSweep.model_validate(document)
                raise OnItsCluster(
                    f"{target}: FineTuneSweep {sweep.namespace}/{sweep.name} runs on a "
                    "cluster only (`finetune run` takes a FineTuneJob) — add `-n "
                    f"{sweep.namespace}` to ask its cluster",
                    SWEEP_KIND, sweep.name, sweep.namespace)
            job = FineTuneJob.model_validate(document)
            output = job.spec.output.location
        except (OSError, UnicodeDecodeError, yaml.YAMLError, pydantic.ValidationError,
                UriError):
            if looks_local(target):
                raise NotARun(f"{target}: not a valid {kind if kind == SWEEP_KIND else KIND} "
                              f"manifest — `finetune validate {target}` says why") from None
            return None  # not a manifest: NAME is a FineTuneJob's name after all
        if output.scheme not in ("path", "relative"):  # a cluster's job: its folder is there
            raise OnItsCluster(f"{target}: FineTuneJob {job.namespace}/{job.name} writes "
                               f"{output.raw}, which is not on this machine — add `-n "
                               f"{job.namespace}` to ask its cluster",
                               KIND, job.name, job.namespace)
        return job.name, resolve_output(output.raw, path.resolve().parent)
    if looks_local(target):
        raise NotARun(f"{target}: no such file or folder (a `finetune run` output folder "
                      "or its manifest; or a FineTuneJob's name, which has no / or suffix)")
    return None


def progress_bar(progress: Progress | None, width: int = 30, running: bool = True) -> str:
    """`[#########.....] 120/400  30% | loss 1.2345 | eval 1.3010 | 5,120 tok/s | eta 0:12:00`
    (the objective's headline figures after eval, DPO's reward margin and preference
    accuracy, GRPO's reward; no eta unless
    `running`: a stopped or finished run's last record has a stale one)"""
    if progress is None or progress.step is None or not (progress.step
                                                         or progress.total_steps):
        return "[" + "." * width + "] no step yet"  # (step 0 of ?: a run failed before one)
    total = progress.total_steps or 0
    done = min(progress.step / total, 1.0) if total else 0.0
    filled = round(done * width)
    parts = [f"[{'#' * filled}{'.' * (width - filled)}] {progress.step}/{total or '?'} "
             f"{done:4.0%}"]
    for label, value, shown in (("loss", progress.loss, "{:.4f}"),
                                ("eval", progress.eval_loss, "{:.4f}"),
                                *((label, value, shown) for label, value, shown
                                  in headline(progress.objective_metrics)),
                                ("", progress.tokens_per_second, "{:,.0f} tok/s"),
                                ("MFU", progress.mfu, "{:.1%}")):
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(f"{label} {shown.format(value)}".strip())
    if progress.eta_seconds is not None and running:
        parts.append(f"eta {format_duration(progress.eta_seconds)}")
    return " | ".join(parts)


def render(view: JobView, now: datetime | None = None) -> list[str]:
    """The lines `finetune status` prints for one look at the job."""
    lines = [f"{view.name}  {view.phase or 'Unknown'}" + (f"  {view.message}"
                                                          if view.message else "")]
    if view.details is not None:
        lines += ["  " + line for line in view.details]
    else:
        lines.append("  " + progress_bar(view.progress, running=view.phase == "Running"))
    if view.restarts:
        lines.append(f"  restarts: {view.restarts}")
    if view.where:
        lines.append(f"  where: {view.where}")
    if view.conditions:
        lines.append("  conditions:")
        lines += [f"    {kind:<22} {status:<7} {reason:<22} {message}".rstrip()
                  for kind, status, reason, message in view.conditions]
    if view.events:
        lines.append("  events:")
        lines += [f"    {kind:<8} {reason:<22} {message}".rstrip()
                  for kind, reason, message in view.events]
    stamp = (now or datetime.now(timezone.utc)).strftime("%H:%M:%S")
    lines.append(f"  (as of {stamp} UTC)")  # --watch redraws: when this look was
    return lines


def as_json(view: JobView) -> dict[str, Any]:
    """What `finetune status -o json` prints for one look: `render`'s facts as data, the
    progress under the names `status.progress` has (camelCase, unset ones left out)."""
    return {
        "name": view.name, "phase": view.phase, "message": view.message,
        "progress": view.progress.to_dict() if view.progress is not None else None,
        "restarts": view.restarts, "where": view.where,
        "conditions": [{"type": kind, "status": status, "reason": reason, "message": message}
                       for kind, status, reason, message in view.conditions],
        "events": [{"type": kind, "reason": reason, "message": message}
                   for kind, reason, message in view.events],
        **({"details": view.details} if view.details else {}),  # a sweep's trials
    }


def run_log(output_dir: Path) -> Path:
    return output_dir / RUN_LOG


def mark_failed(output_dir: Path) -> None:
    """After a failed `finetune run`: progress.json says so (rank 0 could not), so a
    `finetune status --watch` of it ends."""
    path = output_dir / PROGRESS_FILE
    record = read_progress(output_dir) or ProgressRecord(step=0)
    record.phase, record.eta_seconds = "Failed", None
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record.as_json()))
        tmp.replace(path)
    except OSError:  # a full or read-only volume: the run's own error says why it failed
        tmp.unlink(missing_ok=True)


# --- the cluster: what is read through any kubeconfig ------------------------------------

async def look(kube: Kube, namespace: str, name: str) -> JobView | None:
    """The FineTuneJob of that name, else the FineTuneSweep, and the events about it;
    None when there is neither."""
    for kind, view in ((KIND, view_of_job), (SWEEP_KIND, view_of_sweep)):
        obj = await kube.get(kind, namespace, name)
        if obj is not None:
            events = await kube.events(namespace, kind, name, obj["metadata"].get("uid"))
            return view(obj, events)
    return None


async def namespaces_holding(kube: Kube, kinds: tuple[str, ...], name: str,
                             asked: str | None) -> list[str]:
    """The other namespaces that hold an object of `kinds` named `name`: a name asked for in
    the wrong namespace (the kubeconfig's, no -n) is said where it is. One list across all
    namespaces per kind; none where that is not allowed (403: a role of one namespace) or
    the kind is not installed (404)."""
    from finetune_operator.kube import KubeError  # only a cluster's name is looked for

    found: set[str] = set()
    for kind in kinds:
        try:
            items = await kube.list(kind, fields=f"metadata.name={name}")
        except KubeError as error:
            if error.status in (403, 404):
                continue
            raise
        found.update(item["metadata"].get("namespace") or "" for item in items)
    return sorted(found - {asked, ""})


def elsewhere(namespaces: list[str]) -> str:
    """What the line saying a name is not in the namespace asked adds: where it is."""
    if not namespaces:
        return ""
    if len(namespaces) == 1:
        return f" — it is in namespace {namespaces[0]}: add -n {namespaces[0]}"
    return f" — it is in namespaces {', '.join(namespaces)}: add -n and one of them"


def newest_pod(pods: list[dict[str, Any]], node_rank: int, index_key: str
               ) -> dict[str, Any] | None:
    """The latest pod of one node rank (a restart makes new ones; the newest is current)."""
    mine = [pod for pod in pods
            if (pod["metadata"].get("annotations") or {}).get(index_key) == str(node_rank)
            or (pod["metadata"].get("labels") or {}).get(index_key) == str(node_rank)]
    return max(mine, key=lambda pod: pod["metadata"].get("creationTimestamp") or "",
               default=None)


def log_to_read(pod: dict[str, Any], container: str, read: Collection[str] = ()
                ) -> tuple[str | None, str | None]:
    """Whose log says what the pod does now: `container` once it has started; before that,
    an init container that runs (the model's download) or failed (a refusal), other than
    those `read` already. Else (None, why nothing has started: `not_started`)."""
    status = pod.get("status") or {}
    if _started(status.get("containerStatuses"), container):
        return container, None
    for init in status.get("initContainerStatuses") or []:
        state = init.get("state") or {}
        if init.get("name") not in read and ("running" in state or (
                state.get("terminated") or {}).get("exitCode") not in (None, 0)):
            return init["name"], None
    return None, not_started(pod, container)


def _started(statuses: list[dict[str, Any]] | None, container: str) -> bool:
    return any("running" in (s.get("state") or {}) or "terminated" in (s.get("state") or {})
               for s in statuses or [] if s.get("name") == container)


def not_started(pod: dict[str, Any], container: str) -> str | None:
    """Why `container` of `pod` has no log yet (the pod waits for a node, an image, a
    volume, an init container), or None once it has started."""
    status = pod.get("status") or {}
    if _started(status.get("containerStatuses"), container):
        return None
    for init in status.get("initContainerStatuses") or []:  # they run first, in order
        waiting = (init.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") not in (None, "PodInitializing", "ContainerCreating"):
            return f"init container {init.get('name')} waiting: {waiting['reason']}" + (
                f" ({waiting['message']})" if waiting.get("message") else "")
    for state in ((s.get("state") or {}) for s in status.get("containerStatuses") or []
                  if s.get("name") == container):
        waiting = state.get("waiting") or {}
        if waiting.get("reason"):
            return f"waiting: {waiting['reason']}" + (
                f" ({waiting['message']})" if waiting.get("message") else "")
    if status.get("phase") in ("Running", "Succeeded", "Failed"):
        return None  # the container's own status is not there yet: try to read it
    unscheduled = next((c for c in status.get("conditions") or []
                        if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
    if unscheduled is not None:
        return f"not on a node: {unscheduled.get('reason')}: {unscheduled.get('message')}"
    return status.get("phase") or "Pending"
