"""The operator's metrics as Prometheus reads them (the text exposition format)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from finetune_operator.metrics import OperatorMetrics

T0 = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


def samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def jobs(metrics: OperatorMetrics, phase: str, backend: str = "kubernetes") -> float:
    return samples(metrics)[("finetune_operator_jobs",
                             (("backend", backend), ("phase", phase)))]


def test_jobs_by_phase_follow_each_jobs_latest_phase_and_forget_deleted_ones():
    metrics = OperatorMetrics(backends={"kubernetes"})
    assert jobs(metrics, "Failed") == 0  # every phase has a series before anything happens
    metrics.job_seen("a", "one", "kubernetes", {}, {"phase": "Launching"}, T0, T0)
    metrics.job_seen("a", "two", "kubernetes", {}, {"phase": "Launching"}, T0, T0)
    metrics.job_seen("a", "one", "kubernetes", {"phase": "Launching"}, {"phase": "Running"},
                     T0, T0 + timedelta(seconds=90))
    assert (jobs(metrics, "Launching"), jobs(metrics, "Running")) == (1, 1)
    metrics.job_gone("a", "one")
    assert (jobs(metrics, "Launching"), jobs(metrics, "Running")) == (1, 0)


def test_time_to_running_counts_the_first_run_only():
    metrics = OperatorMetrics(backends={"kubernetes"})
    launching = {"phase": "Launching", "restarts": 0}
    metrics.job_seen("a", "j", "kubernetes", launching, {"phase": "Running"}, T0,
                     T0 + timedelta(seconds=75))
    # after a gang restart it runs again: not a new apply-to-Running
    metrics.job_seen("a", "j", "kubernetes", {"phase": "Launching", "restarts": 1},
                     {"phase": "Running"}, T0, T0 + timedelta(seconds=900))
    got = samples(metrics)
    key = ("finetune_operator_time_to_running_seconds_count", (("backend", "kubernetes"),))
    assert got[key] == 1
    assert got[("finetune_operator_time_to_running_seconds_sum",
                (("backend", "kubernetes"),))] == 75


def test_restarts_have_a_series_per_cause_from_the_start():
    metrics = OperatorMetrics(backends={"kubernetes"})
    metrics.restarted("kubernetes", "preempted")
    got = samples(metrics)
    assert got[("finetune_operator_restarts_total",
                (("backend", "kubernetes"), ("cause", "preempted")))] == 1
    assert got[("finetune_operator_restarts_total",
                (("backend", "kubernetes"), ("cause", "worker")))] == 0


def test_each_job_has_its_phase_and_restarts_so_alerts_can_name_it():
    metrics = OperatorMetrics(backends={"kubernetes"})
    metrics.job_seen("ml", "llama", "kubernetes", {}, {"phase": "Restarting", "restarts": 2},
                     T0, T0)
    metrics.job_seen("ml", "qwen", "azureml", {}, {"phase": "Failed", "restarts": 3}, T0, T0)
    got = samples(metrics)
    llama = (("backend", "kubernetes"), ("finetunejob", "llama"), ("namespace", "ml"))
    qwen = (("backend", "azureml"), ("finetunejob", "qwen"), ("namespace", "ml"))
    assert got[("finetune_operator_job_phase", (*llama[:2], llama[2], ("phase", "Restarting")))] \
        == 1
    assert got[("finetune_operator_job_phase", (*qwen, ("phase", "Failed")))] == 1
    assert got[("finetune_operator_job_restarts", llama)] == 2
    assert not any(name == "finetune_operator_job_phase" and ("phase", "Running") in labels
                   for name, labels in got)  # only the current phase is exported
    metrics.job_gone("ml", "qwen")
    assert ("finetune_operator_job_restarts", qwen) not in samples(metrics)
