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
