"""The operator's own Prometheus metrics, on `GET /metrics` of `--metrics-port`.

What a platform team alerts on and plots beside the trainers' series: jobs by phase, gang
restarts by cause, the time from `kubectl apply` to Running, how long a reconcile takes and
how often a backend's API refuses a call. Names follow Prometheus conventions (base units,
`_total` counters); labels stay low-cardinality (no job names: those are the trainers').
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Iterator
from datetime import datetime
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from finetune_operator.api import Phase

RESTART_CAUSES = ("worker", "preempted", "stopped")
"""Failure kinds that restart the gang (the reconciler's delete-workload reasons)."""
MINUTES = (10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)


class _JobsByPhase(Collector):
    """A gauge computed at scrape time from the last phase seen of each job, so a deleted
    job stops counting at once and every phase has a series (0 included) to alert on."""

    def __init__(self, metrics: OperatorMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("finetune_operator_jobs",
                                   "FineTuneJobs this operator serves, by phase and backend",
                                   labels=["phase", "backend"])
        with self.metrics.lock:
            counts = Tally(self.metrics.phases.values())
            jobs = sorted(self.metrics.phases.items())
            backends = {backend for _phase, backend in counts} | self.metrics.backends
        for backend in sorted(backends):
            for phase in get_args(Phase):
                family.add_metric([phase, backend], counts.get((phase, backend), 0))
        yield family
        # per job, like kube-state-metrics: alerts can name the job that failed or restarts
        current = GaugeMetricFamily("finetune_operator_job_phase", "1 for each FineTuneJob's "
                                    "current phase", labels=["namespace", "finetunejob",
                                                             "backend", "phase"])
        restarts = GaugeMetricFamily("finetune_operator_job_restarts", "Gang restarts of "
                                     "each FineTuneJob so far (status.restarts)",
                                     labels=["namespace", "finetunejob", "backend"])
        for (namespace, name), (phase, backend) in jobs:
            current.add_metric([namespace, name, backend, phase], 1)
            restarts.add_metric([namespace, name, backend], self.metrics.restart_counts.get(
                (namespace, name), 0))
        yield current
        yield restarts


class OperatorMetrics:
    def __init__(self, backends: set[str] | None = None,
                 registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.lock = threading.Lock()
        self.backends = set(backends or ())
        self.phases: dict[tuple[str, str], tuple[str, str]] = {}
        """(namespace, name) → (phase, backend)"""
        self.restart_counts: dict[tuple[str, str], int] = {}
        self.restarts = Counter(
            "finetune_operator_restarts", "Gang restarts, by cause (worker failures use the "
            "restart budget; preemptions and stops do not)", ["backend", "cause"],
            registry=self.registry)
        self.time_to_running = Histogram(
            "finetune_operator_time_to_running_seconds", "From the FineTuneJob's creation to "
            "its workers first running (scheduling, image pulls, rendezvous)", ["backend"],
            buckets=MINUTES, registry=self.registry)
        self.reconcile_seconds = Histogram(
            "finetune_operator_reconcile_duration_seconds", "One reconcile: observe the "
            "backend, decide, act, patch the status", ["backend"], registry=self.registry)
        self.backend_errors = Counter(
            "finetune_operator_backend_errors", "Calls to a backend's API that failed (and "
            "will be retried)", ["backend", "operation"], registry=self.registry)
        self.queue_depth = Gauge(
            "finetune_operator_workqueue_depth", "FineTuneJobs waiting for a reconciler (a "
            "lasting depth: more jobs change than --reconcilers keep up with)",
            registry=self.registry)
        self.queue_busy = Gauge(
            "finetune_operator_workqueue_busy", "FineTuneJobs being reconciled now (at most "
            "--reconcilers)", registry=self.registry)
        self.launches_waiting = Gauge(
            "finetune_operator_launches_waiting", "FineTuneJobs acknowledged and waiting for "
            "their turn to launch (--launch-rate, --launch-burst)", registry=self.registry)
        self.registry.register(_JobsByPhase(self))
        for backend in self.backends:  # series from the start, so rate() has a baseline
            for cause in RESTART_CAUSES:
                self.restarts.labels(backend, cause)

    def job_seen(self, namespace: str, name: str, backend: str, old: dict, new: dict,
                 created: datetime | None, now: datetime) -> None:
        """Record a reconcile's outcome: `old` and `new` are the status before and after."""
        phase = new.get("phase") or "Pending"
        with self.lock:
            self.phases[(namespace, name)] = (phase, backend)
            self.restart_counts[(namespace, name)] = int(new.get("restarts") or 0)
        if phase == "Running" and old.get("phase") != "Running" and created is not None \
                and _first_run(old):
            self.time_to_running.labels(backend).observe((now - created).total_seconds())

    def watch_queue(self, queue: Any, launches: Any) -> None:
        """Report the controller's work queue and launch turns at each scrape."""
        self.queue_depth.set_function(lambda: len(queue))
        self.queue_busy.set_function(lambda: queue.busy)
        self.launches_waiting.set_function(lambda: launches.waiting)

    def restarted(self, backend: str, cause: str) -> None:
        self.restarts.labels(backend, cause).inc()

    def job_gone(self, namespace: str, name: str) -> None:
        with self.lock:
            self.phases.pop((namespace, name), None)
            self.restart_counts.pop((namespace, name), None)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics from a thread; returns the port (0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]


def _first_run(status: dict) -> bool:
    """No attempt ran before: no restarts, no resumes, no progress ever reported."""
    return not status.get("restarts") and not status.get("progress") and not any(
        c.get("type") == "Running" and c.get("reason") in ("Suspended", "Restarting")
        for c in status.get("conditions") or [])
