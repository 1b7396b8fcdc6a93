"""The trainer's metrics into Azure ML's MLflow tracking, and the rank env Azure ML sets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest

from finetune_trainer import tracking
from finetune_trainer.progress import Reporter
from finetune_trainer.record import ProgressRecord
from tests.support import waits

AZUREML_ENV = {"MLFLOW_TRACKING_URI": "azureml://westeurope.api.azureml.ms/mlflow/v1.0/x",
               "MLFLOW_RUN_ID": "demo-0b5e6c7e1234", "AZUREML_RUN_ID": "demo-0b5e6c7e1234"}


class FakeMlflow(types.SimpleNamespace):
    """Records what the tracker sends, as mlflow's fluent API would receive it."""

    def __init__(self, fail: bool = False):
        super().__init__(logged=[], tags={}, fail=fail)

    def log_metrics(self, metrics, step=None):
        if self.fail:
            raise ConnectionError("tracking service unreachable")
        self.logged.append((step, metrics))

    def set_tag(self, key, value):
        self.tags[key] = value


def record(step: int, loss: float | None = 1.25) -> ProgressRecord:
    return ProgressRecord(step=step, totalSteps=100, epoch=0.4, loss=loss, learningRate=1e-4,
                          tokensPerSecond=52000.0, etaSeconds=600)


def test_metric_names_and_values():
    assert record(40).mlflow_metrics() == {
        "loss": 1.25, "learning_rate": 1e-4, "tokens_per_second": 52000.0, "epoch": 0.4,
        "total_steps": 100.0, "eta_seconds": 600.0}
    assert "loss" not in record(40, loss=None).mlflow_metrics()
    assert "loss" not in record(40, loss=float("nan")).mlflow_metrics()


def test_an_objectives_figures_are_logged_under_trls_names_and_read_back():
    dpo = record(40).model_copy(update={"objective_metrics": {
        "rewards/chosen": 0.5, "rewards/rejected": -0.25, "rewards/margins": 0.75,
        "rewards/accuracies": float("nan")}})
    metrics = dpo.mlflow_metrics()
    assert {k: v for k, v in metrics.items() if k.startswith("rewards/")} == {
        "rewards/chosen": 0.5, "rewards/rejected": -0.25, "rewards/margins": 0.75}
    logged = [{"key": k, "value": v, "step": 40} for k, v in metrics.items()]
    # an older step's value, and MLflow's own system metrics, are not read
    logged += [{"key": "rewards/chosen", "value": 9.0, "step": 39},
               {"key": "system/cpu_utilization_percentage", "value": 50.0, "step": 40}]
    back = ProgressRecord.from_mlflow(logged)
    assert back.objective_metrics == {"rewards/chosen": 0.5, "rewards/rejected": -0.25,
                                      "rewards/margins": 0.75}
    assert back.step == 40 and back.loss == 1.25
    assert ProgressRecord.from_mlflow([{"key": k, "value": v, "step": 40} for k, v in
                                       record(40).mlflow_metrics().items()]
                                      ).objective_metrics is None


def test_only_inside_azure_ml():
    assert tracking.in_azureml(AZUREML_ENV)
    assert not tracking.in_azureml({"MLFLOW_TRACKING_URI": "http://my-mlflow:5000"})
    assert tracking.from_environment({}) is None


def test_without_mlflow_it_says_so_and_trains_on(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert tracking.from_environment(AZUREML_ENV) is None
    assert "pip install azureml-mlflow" in capsys.readouterr().out


def test_reporter_logs_each_record_at_its_step(tmp_path):
    mlflow = FakeMlflow()
    reporter = Reporter(tmp_path, total_steps=100, start_step=0, enabled=True,
                        trackers=(tracking.MlflowTracker(mlflow),))
    reporter.step_done(1000)
    reporter.report(10, 0.1, 2.5, 1e-4)
    reporter.report(20, 0.2, 2.0, 9e-5, grad_norm=0.75)
    reporter.evaluated(20, 2.25)
    reporter.finish("Succeeded")
    assert [step for step, _ in mlflow.logged] == [10, 20, 20]
    assert mlflow.logged[1][1]["loss"] == 2.0 and mlflow.logged[1][1]["total_steps"] == 100
    assert mlflow.logged[1][1]["grad_norm"] == 0.75
    assert mlflow.logged[2][1] == {"eval_loss": 2.25}
    # no stoppedEarly: it ran to the end; the export is the last step's
    assert mlflow.tags == {"finetune.phase": "Succeeded", "finetune.exportEvalLoss": "2.25"}


def test_a_tracking_outage_is_said_once_never_stops_training_and_passes(tmp_path, capsys):
    """The operator follows an Azure ML job by these metrics: muted for good after one
    failure, a passing outage made a healthy job look hung to its stall check."""
    now = [0.0]
    mlflow = FakeMlflow(fail=True)
    reporter = Reporter(tmp_path, total_steps=100, start_step=0, enabled=True,
                        trackers=(tracking.MlflowTracker(mlflow, clock=lambda: now[0]),))
    reporter.report(10, 0.1, 2.5, 1e-4)
    reporter.report(20, 0.2, 2.0, 1e-4)  # within the quiet spell: not even tried
    now[0] = 61.0
    reporter.report(30, 0.3, 1.9, 1e-4)  # tried again, still down: quiet for longer
    out = capsys.readouterr().out
    assert out.count("metrics not sent to Azure ML tracking") == 1
    assert "tried again in 60s" in out
    assert (tmp_path / "progress.json").is_file()

    mlflow.fail = False
    now[0] = 61.0 + 100.0
    reporter.report(40, 0.4, 1.8, 1e-4)  # 120 s quiet after the second failure
    assert mlflow.logged == []
    now[0] = 61.0 + 121.0
    reporter.report(50, 0.5, 1.7, 1e-4)
    assert [step for step, _ in mlflow.logged] == [50]
    assert "reach Azure ML tracking again (from step 50)" in capsys.readouterr().out
    reporter.finish("Succeeded")
    assert mlflow.tags["finetune.phase"] == "Succeeded"


WORKER = """
import torch, torch.distributed as dist
from finetune_trainer.parallel import init_distributed
device = init_distributed()
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {value.item()}")
dist.destroy_process_group()
"""


@pytest.mark.process
def test_the_trainer_joins_with_the_rank_env_azure_ml_sets(tmp_path):
    """Azure ML's PyTorch distribution starts every process itself with these variables
    (no torchrun): init_distributed must form the world from them alone."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workers = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
               "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""}
        workers.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [w.communicate(timeout=waits.seconds_left()) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    assert sorted(out.strip() for out, _ in outputs) == ["rank 0 of 2: 3.0", "rank 1 of 2: 3.0"]


@pytest.fixture()
def job_run(tmp_path, monkeypatch) -> dict[str, str]:
    """A run in a local MLflow store, and the environment Azure ML gives a job's workers,
    pointing at it (Azure ML's run id is the job's name; here the store's id)."""
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3's local store
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("finetune")).info.run_id
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run_id, "AZUREML_RUN_ID": run_id}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(name, "")  # the failing process sets them: removed again after
        monkeypatch.delenv(name)
    return env


def run_tags(env: dict[str, str]) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(env["MLFLOW_RUN_ID"]).data.tags
    return {key: value for key, value in tags.items() if key.startswith("finetune.")}


@pytest.mark.process
def test_a_worker_that_refuses_its_data_says_so_on_the_job_run(job_run, tiny_model_dir,
                                                              tmp_path):
    """A worker as Azure ML starts it (its rank environment, no torchrun) on a data file with
    a broken line: it exits 2, and the job's run carries its line, where the operator reads
    why the job failed (Azure ML keeps no termination message)."""
    from finetune_operator.local.config import local_config, write_config
    from finetune_operator.validation import parse_job
    from tests.trainer.test_training import manifest

    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n')
    job = manifest(tiny_model_dir, tmp_path / "out", steps=2, processes=1)
    job["spec"]["dataset"]["uri"] = str(data)
    config, _ = local_config(parse_job(job), tmp_path)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "CUDA_VISIBLE_DEVICES": ""}
    worker = subprocess.run(
        [sys.executable, "-m", "finetune_trainer", "--config",
         str(write_config(config, tmp_path / "out"))],
        env=env, capture_output=True, text=True, timeout=waits.seconds_left())
    assert worker.returncode == 2, worker.stderr[-3000:]
    said = worker.stderr.strip().splitlines()[-1]
    assert said.startswith(f"finetune-train: {data}:2: is not valid JSON"), said
    assert run_tags(job_run) == {
        tracking.REFUSED_TAG: "2 " + said.removeprefix("finetune-train: ")}


def test_what_the_image_cannot_set_up_is_tagged_as_the_same_on_every_attempt(job_run):
    """Exit 5 (errors.setup_failure): the operator submits the job again once at most."""
    tracking.record_failure("op 'deepspeed_shm_comm' could not be built in this image: "
                            "/bin/sh: 1: c++: not found", 5)
    assert run_tags(job_run) == {tracking.REFUSED_TAG: "5 op 'deepspeed_shm_comm' could not "
                                 "be built in this image: /bin/sh: 1: c++: not found"}


def test_any_other_failure_names_the_rank_and_a_silent_service_costs_seconds(
        job_run, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    tracking.record_failure("OutOfMemoryError: CUDA out of memory. " + "x" * 2000, 1)
    said = run_tags(job_run)[tracking.FAILURE_TAG]
    assert said.startswith("rank 3: OutOfMemoryError: CUDA out of memory. xxx")
    assert len(said) == tracking.TAG_CHARACTERS
    # a tracking service that does not answer: said, not raised, and not waited out
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    started = time.monotonic()
    tracking.record_failure("RuntimeError: boom", 1)
    assert "the failure was not sent to Azure ML tracking" in capsys.readouterr().out
    assert time.monotonic() - started < 30
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"


def test_outside_azure_ml_no_failure_is_sent(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # would raise on import
    tracking.record_failure("RuntimeError: boom", 1)
