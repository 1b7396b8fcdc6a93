"""Rank 0's progress: the HTTP endpoint the operator reads, and the files users read."""

from __future__ import annotations

import json
import socket
import urllib.request

from finetune_trainer.progress import ProgressServer, Reporter


def get(port: int, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
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
    from finetune_operator.backends.kubernetes import progress_from_record
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
