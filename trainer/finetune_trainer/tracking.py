"""Rank 0's progress into Azure ML's own tracking (MLflow), so the Studio charts of the job
show loss, learning rate and throughput, and the operator can mirror them into the
FineTuneJob status (it reads the same metric names back: record.MLFLOW_METRICS).

Azure ML starts a job's processes with MLFLOW_TRACKING_URI and MLFLOW_RUN_ID pointing at
the job's own run; `mlflow.log_metrics` then lands there (the `azureml-mlflow` plugin
understands the azureml:// tracking URI). Anywhere else nothing is sent. Importable
without torch or mlflow: mlflow is imported only inside Azure ML.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from finetune_trainer.exits import EXIT_SETUP, NOT_RESTARTED
from finetune_trainer.record import MLFLOW_METRICS

if TYPE_CHECKING:
    from finetune_trainer.record import ProgressRecord


def in_azureml(environ: Mapping[str, str]) -> bool:
    """Azure ML sets both for every job; a plain MLFLOW_TRACKING_URI elsewhere is the
    user's own server, which this module leaves alone."""
    return bool(environ.get("MLFLOW_TRACKING_URI")) and bool(
        environ.get("AZUREML_RUN_ID") or environ.get("MLFLOW_RUN_ID"))


QUIET_AFTER_FAILURE = (60.0, 120.0, 300.0, 600.0)
"""Seconds without trying after the 1st, 2nd, 3rd, ... tracking failure in a row."""


class MlflowTracker:
    """Logs each published progress record as MLflow metrics at its step. A tracking
    failure costs the charts, never the training run: it is said once, and sending is tried
    again after a quiet spell (QUIET_AFTER_FAILURE). Muted for good, a passing outage left
    the operator, which follows the job by these metrics, reading no progress: its stall
    check then restarted a healthy job."""

    def __init__(self, mlflow: Any, clock: Callable[[], float] = time.monotonic):
        self.mlflow = mlflow
        self.clock = clock
        self.failures = 0
        self.quiet_until = 0.0

    def log(self, record: ProgressRecord) -> None:
        self._send(record.mlflow_metrics(), record.step)

    def evaluated(self, step: int, loss: float | None, figures: dict[str, float]) -> None:
        loss_metric = {} if loss is None else {MLFLOW_METRICS["eval_loss"]: loss}
        self._send({**loss_metric, **{name: value for name, value in figures.items()
                                      if math.isfinite(value)}}, step)

    def _send(self, metrics: dict[str, float], step: int) -> None:
        if self.clock() < self.quiet_until:
            return
        try:
            self.mlflow.log_metrics(metrics, step=step)
        except Exception as error:  # the tracking service, the network, the plugin
            quiet = QUIET_AFTER_FAILURE[min(self.failures, len(QUIET_AFTER_FAILURE) - 1)]
            self.failures += 1
            self.quiet_until = self.clock() + quiet
            if self.failures == 1:
                print(f"metrics not sent to Azure ML tracking ({error}); training goes on, "
                      f"and sending is tried again in {quiet:.0f}s", flush=True)
            return
        if self.failures:
            print(f"metrics reach Azure ML tracking again (from step {step})", flush=True)
        self.failures = 0

    def finish(self, final: ProgressRecord) -> None:
        try:
            self.mlflow.set_tag(PHASE_TAG, final.phase)
            if final.phase == "Succeeded" and final.eval_loss is not None:
                self.mlflow.set_tag(EXPORT_EVAL_LOSS_TAG, repr(final.eval_loss))
            if final.stopped_early:
                self.mlflow.set_tag(STOPPED_EARLY_TAG, final.stopped_early[:TAG_CHARACTERS])
        except Exception as error:
            print(f"final phase not sent to Azure ML tracking: {error}", flush=True)


PHASE_TAG = "finetune.phase"
STOPPED_EARLY_TAG = "finetune.stoppedEarly"
"""Why a finished run stopped before its last step (early stopping), for the status."""
EXPORT_EVAL_LOSS_TAG = "finetune.exportEvalLoss"
"""A finished run's export's eval loss (under early stopping the best evaluation's, where
the eval_loss metric's latest value is the last evaluation's): what a sweep ranks by."""


REFUSED_TAG = "finetune.refused"
"""`<exit code> <the worker's line>`: the model, the data (2) or checkpoints of other
settings (4) were refused, or the image cannot set the worker up (5): the same on every
attempt."""
FAILURE_TAG = "finetune.failure"
"""`rank <n>: <the worker's line>`: any other failure."""
TAG_CHARACTERS = 500  # what every MLflow tracking service takes in a tag value


def record_failure(text: str, code: int) -> None:
    """A worker's reason for failing, as a tag on the job's run: Azure ML starts the
    workers itself and keeps no termination message, and the operator reads these tags
    with the metrics. So a refusal fails the FineTuneJob at once, where it was submitted
    again backoffLimit times (each time provisioning the compute), and any other failure
    is quoted in its status. The tracking client, not the fluent API: no run is started
    or ended here. Inside Azure ML only; a tag not sent is said, never raised."""
    environ = os.environ
    if not in_azureml(environ):
        return
    run_id = environ.get("MLFLOW_RUN_ID") or environ["AZUREML_RUN_ID"]
    if code in (*NOT_RESTARTED, EXIT_SETUP):
        key, value = REFUSED_TAG, f"{code} {text}"
    else:
        key, value = FAILURE_TAG, f"rank {environ.get('RANK', '0')}: {text}"
    # the process is on its way out: a tracking service that does not answer must not
    # hold it for mlflow's default of 7 retries with backoff
    environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    try:
        from mlflow.tracking import MlflowClient  # an Azure ML image's only: may be missing

        MlflowClient().set_tag(run_id, key, value[:TAG_CHARACTERS])
    except Exception as error:  # mlflow missing, the service, the network, the plugin
        print(f"the failure was not sent to Azure ML tracking: {error}", flush=True)


def from_environment(environ: Mapping[str, str] | None = None) -> MlflowTracker | None:
    """A tracker when running inside Azure ML with mlflow installed, else None."""
    environ = os.environ if environ is None else environ
    if not in_azureml(environ):
        return None
    try:
        import mlflow  # an Azure ML image's only: may be missing
    except ImportError:
        print("metrics are not sent to Azure ML tracking: mlflow is not installed in this "
              "environment (pip install azureml-mlflow); Studio charts and the operator's "
              "status.progress stay empty", flush=True)
        return None
    return MlflowTracker(mlflow)
