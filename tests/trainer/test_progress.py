"""Rank 0's progress: the HTTP endpoint the operator reads, and the files users read."""

from __future__ import annotations

import json
import socket
import urllib.request

from finetune_trainer.progress import ProgressServer, Reporter
from tests.support import waits


def get(port: int, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}",
                                timeout=waits.seconds_left()) as response:
        return response.status, response.read()


def test_progress_endpoint_serves_the_latest_record(tmp_path):
    server = ProgressServer(0, host="127.0.0.1")
    try:
        assert get(server.port, "/healthz") == (200, b"ok\n")
        assert get(server.port, "/progress")[0] == 204  # nothing reported yet
        reporter = Reporter(tmp_path, total_steps=10, start_step=0, enabled=True, server=server)
        reporter.step_done(1000)
        reporter.report(step=1, epoch=0.1, loss=2.5, lr=1e-4)
        status, body = get(server.port, "/progress")
        record = json.loads(body)
        assert status == 200 and record["step"] == 1 and record["loss"] == 2.5
        assert record["totalSteps"] == 10 and record["tokensPerSecond"] > 0
        reporter.finish("Succeeded")
        assert json.loads(get(server.port, "/progress")[1])["phase"] == "Succeeded"
        on_disk = json.loads((tmp_path / "progress.json").read_text())
        assert on_disk["phase"] == "Succeeded"
        assert len((tmp_path / "progress.jsonl").read_text().splitlines()) == 1
    finally:
        server.close()


def test_a_busy_port_costs_only_the_endpoint(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = ProgressServer(busy.getsockname()[1], host="127.0.0.1")
        assert server.httpd is None
        assert "progress endpoint not served" in capsys.readouterr().out
        server.close()


def test_every_backend_reads_the_record_the_trainer_writes(tmp_path):
    """#16: one progress model (finetune_trainer.record) from the trainer's files and
    endpoint, through Azure ML's MLflow metrics, to status.progress: the same figures
    whichever way they travel."""
    from finetune_operator.api import Progress
    from finetune_operator.backends.azureml.states import progress_from_metrics
    from finetune_operator.backends.kubernetes.states import progress_from_record
    from finetune_trainer.record import ProgressRecord

    reporter = Reporter(tmp_path, total_steps=40, start_step=0, enabled=True)
    reporter.step_done(5000)
    written = reporter.report(step=8, epoch=0.2, loss=1.75, lr=2e-4, mfu=0.41)
    on_disk = json.loads((tmp_path / "progress.json").read_text())
    assert ProgressRecord.model_validate(on_disk) == written
    history = json.loads((tmp_path / "progress.jsonl").read_text().splitlines()[-1])
    assert "preflight" not in history and history["learningRate"] == 2e-4

    from_pod = progress_from_record(on_disk)
    metrics = [{"key": name, "value": value, "step": written.step}
               for name, value in written.mlflow_metrics().items()]
    from_azureml = progress_from_metrics(metrics)
    assert from_pod == Progress.from_record(written)
    assert (from_pod.step, from_pod.total_steps, from_pod.loss, from_pod.eta_seconds) == (
        8, 40, 1.75, written.eta_seconds)
    assert from_azureml.model_dump(exclude={"mfu"}) == from_pod.model_dump(exclude={"mfu"})


def test_dpo_rewards_reach_the_status_whichever_way_the_record_travels(tmp_path, capsys):
    """A DPO run's rewards (TRL's `rewards/<name>`), from the trainer's record through the
    pod's /progress JSON and Azure ML's MLflow metrics to status.progress.objectiveMetrics."""
    from finetune_operator.api import Progress
    from finetune_operator.backends.azureml.states import progress_from_metrics
    from finetune_operator.backends.kubernetes.states import progress_from_record
    from finetune_trainer.objectives.dpo.objective import REWARDS
    from finetune_trainer.record import ProgressRecord

    rewards = dict(zip(REWARDS, (0.1234567891, -0.25, 0.3734567891, 0.75), strict=True))
    reporter = Reporter(tmp_path, total_steps=40, start_step=0, enabled=True)
    reporter.step_done(5000)
    written = reporter.report(step=8, epoch=0.2, loss=0.61, lr=2e-4,
                              objective_metrics=rewards)
    assert written.objective_metrics == {  # rounded to 6 places, as the others are
        "rewards/chosen": 0.123457, "rewards/rejected": -0.25, "rewards/margins": 0.373457,
        "rewards/accuracies": 0.75}
    assert "| margin 0.3735 | accuracy 75%" in capsys.readouterr().out
    on_disk = json.loads((tmp_path / "progress.json").read_text())
    assert on_disk["objectiveMetrics"] == written.objective_metrics
    assert ProgressRecord.model_validate(on_disk) == written

    metrics = written.mlflow_metrics()
    assert {name: metrics[name] for name in REWARDS} == written.objective_metrics
    from_pod = progress_from_record(on_disk)
    from_azureml = progress_from_metrics([{"key": name, "value": value, "step": 8}
                                          for name, value in metrics.items()])
    assert from_pod == Progress.from_record(written)
    assert from_pod.objective_metrics == written.objective_metrics
    assert from_azureml.objective_metrics == written.objective_metrics
    assert from_azureml.model_dump(exclude={"mfu"}) == from_pod.model_dump(exclude={"mfu"})
    # an SFT run's record has none, and neither has its status
    sft = Reporter(tmp_path / "sft", total_steps=40, start_step=0, enabled=True).report(
        step=8, epoch=0.2, loss=1.5, lr=2e-4)
    assert sft.objective_metrics is None and not any(k.startswith("rewards/")
                                                     for k in sft.mlflow_metrics())
    assert progress_from_metrics([{"key": k, "value": v, "step": 8} for k, v in
                                  sft.mlflow_metrics().items()]).objective_metrics is None


def test_a_finished_run_leaves_its_final_record_as_the_termination_message(tmp_path,
                                                                          monkeypatch):
    """In a pod the kubelet makes the file (terminationMessagePath) and keeps what the
    trainer wrote there once it exits: a Succeeded run's final record, which the operator
    reads when /progress has gone with the trainer. A run stopped by SIGTERM leaves it empty
    (its exit code says what happened); a rerun of a finished run, which trains nothing,
    leaves the record it finished with."""
    from finetune_trainer.exits import TERMINATION_LOG_ENV
    from finetune_trainer.record import ProgressRecord

    message = tmp_path / "termination-log"
    message.write_text("")
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(message))
    stopped = Reporter(tmp_path / "a", total_steps=20, start_step=0, enabled=True)
    stopped.report(step=2, epoch=0.1, loss=2.5, lr=1e-4)
    stopped.finish("Stopped")
    assert message.read_text() == ""

    reporter = Reporter(tmp_path / "b", total_steps=20, start_step=0, enabled=True)
    reporter.report(step=6, epoch=0.3, loss=1.9, lr=1e-4)
    reporter.evaluated(6, 2.2)
    reporter.finish("Succeeded", "stopped early at step 6 of 20: ...", eval_loss=2.1)
    final = ProgressRecord.model_validate_json(message.read_text())
    # the export's eval loss (the best evaluation's), not the last evaluation's
    assert (final.step, final.loss, final.eval_loss, final.phase, final.eta_seconds) == (
        6, 1.9, 2.1, "Succeeded", 0)
    assert final.stopped_early == "stopped early at step 6 of 20: ..."

    message.write_text("")
    rerun = Reporter(tmp_path / "b", total_steps=20, start_step=6, enabled=True)
    rerun.finish("Succeeded", "stopped early at step 6 of 20: ...")
    assert ProgressRecord.model_validate_json(message.read_text()) == final


def test_a_final_record_too_long_for_the_kubelet_still_reads_with_its_exports(tmp_path,
                                                                            monkeypatch):
    """The kubelet keeps 4 KB of a termination message: a GRPO run's many figures and eight
    failed pushes would pass that, and cut JSON reads as nothing. The figures the operator
    polled already go first, then the errors are shortened: the exports still arrive."""
    from finetune_trainer.exits import TERMINATION_LIMIT, TERMINATION_LOG_ENV
    from finetune_trainer.record import ProgressRecord

    message = tmp_path / "termination-log"
    message.write_text("")
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(message))
    reporter = Reporter(tmp_path / "out", total_steps=20, start_step=0, enabled=True)
    reporter.report(step=20, epoch=1.0, loss=0.1, lr=1e-5, objective_metrics={
        f"rewards/reward_{n}/mean": 0.5 for n in range(60)})
    exports = [{"uri": f"oci://registry-{n}.example.com/team/model:v1",
                "error": "the registry refused the push: " + "x" * 400} for n in range(8)]
    reporter.finish("Succeeded", exports=exports)
    text = message.read_text()
    assert len(text) <= TERMINATION_LIMIT
    final = ProgressRecord.model_validate_json(text)
    assert [e["uri"] for e in final.exports] == [e["uri"] for e in exports]
    assert all(e["error"].startswith("the registry refused the push") for e in final.exports)
    assert final.phase == "Succeeded" and final.step == 20
    full = json.loads((tmp_path / "out" / "progress.json").read_text())
    assert len(full["objectiveMetrics"]) == 60 and full["exports"] == exports  # all there


def test_the_push_after_the_last_step_is_said_as_exporting_then_the_run_ends(tmp_path):
    """Rank 0 pushes to `output.export` after the last step: the record says Exporting
    meanwhile (the operator's stall check waits on it; api.Progress.exporting), with the
    run's final figures (the model card, written before the push, reads them), then
    Succeeded with the outcome. Without targets it concludes still Running."""
    from finetune_operator.api import Progress
    from finetune_trainer.record import ProgressRecord

    reporter = Reporter(tmp_path, total_steps=20, start_step=0, enabled=True)
    reporter.report(step=20, epoch=1.0, loss=0.1, lr=1e-5)
    reporter.conclude("stopped early at step 20 of 40: ...", eval_loss=0.3, exporting=True)
    record = ProgressRecord.model_validate_json((tmp_path / "progress.json").read_text())
    assert (record.phase, record.step, record.loss, record.eval_loss) == (
        "Exporting", 20, 0.1, 0.3)
    assert record.stopped_early.startswith("stopped early") and record.eta_seconds == 0
    assert Progress.from_record(record).exporting
    reporter.finish("Succeeded", exports=[{"uri": "oci://r/m:v1", "pushed": "r/m:v1@sha256:0"}])
    final = ProgressRecord.model_validate_json((tmp_path / "progress.json").read_text())
    assert final.phase == "Succeeded" and not Progress.from_record(final).exporting
    quiet = Reporter(tmp_path / "b", total_steps=20, start_step=0, enabled=True)
    quiet.report(step=20, epoch=1.0, loss=0.1, lr=1e-5)
    quiet.conclude()
    assert ProgressRecord.model_validate_json(
        (tmp_path / "b" / "progress.json").read_text()).phase == "Running"
