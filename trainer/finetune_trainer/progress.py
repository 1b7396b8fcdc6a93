"""What rank 0 tells people and the operator: log lines, a progress bar, progress.json."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tqdm import tqdm

from finetune_trainer import errors
from finetune_trainer.layout import HISTORY_FILE, PROGRESS_FILE
from finetune_trainer.record import ProgressRecord, format_duration, headline


class Tracker(Protocol):
    """Somewhere else the records go (Azure ML's MLflow run, TensorBoard event files)."""

    def log(self, record: ProgressRecord) -> None: ...

    def evaluated(self, step: int, loss: float | None, figures: dict[str, float]) -> None: ...

    def finish(self, final: ProgressRecord) -> None: ...


class Reporter:
    """Rank 0's progress: every log step a line on stdout, progress.json (the latest record,
    replaced atomically) and a line of progress.jsonl (the history) in the output folder;
    a progress bar on stderr when it is a terminal; and to each tracker."""

    def __init__(self, output_dir: Path, total_steps: int, start_step: int, enabled: bool,
                 server: ProgressServer | None = None, trackers: tuple[Tracker, ...] = ()):
        self.server = server
        self.trackers = trackers
        self.path = output_dir / PROGRESS_FILE
        self.history = output_dir / HISTORY_FILE
        self.total_steps = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self.window_start = time.perf_counter()
        self.window_tokens = 0
        self.window_inputs = 0
        self.window_steps = 0
        self.bar = None
        self.last: ProgressRecord | None = None
        self.preflight: dict | None = None  # published with every record
        self.eval_loss: float | None = None  # the latest evaluation's, likewise
        self.eval_figures: dict[str, float] = {}
        """The latest evaluation's figures as `eval_<name>` (TRL's names), in every record
        after it among the objective's figures."""
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stderr)

    def step_done(self, label_tokens: int, input_tokens: int | None = None) -> None:
        """`input_tokens`: tokens through the model (prompts too), where known."""
        self.window_tokens += label_tokens
        self.window_inputs += input_tokens or 0
        self.window_steps += 1
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, epoch: float, loss: float | None, lr: float,
               mfu: float | None = None, mfu_full_rows: float | None = None,
               peak_memory: int | None = None,
               grad_norm: float | None = None,
               objective_metrics: dict[str, float] | None = None) -> ProgressRecord:
        """Close the current window and publish it (`step` counts completed steps)."""
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        tokens_per_second = self.window_tokens / elapsed
        step_seconds = elapsed / self.window_steps if self.window_steps else None
        eta = None if step_seconds is None else int(step_seconds * (self.total_steps - step))
        record = ProgressRecord(
            step=step, total_steps=self.total_steps, epoch=round(epoch, 4), loss=loss,
            learning_rate=lr, grad_norm=grad_norm, eval_loss=self.eval_loss,
            objective_metrics=_rounded({**(objective_metrics or {}), **self.eval_figures}),
            tokens_per_second=round(tokens_per_second, 1), eta_seconds=eta,
            input_tokens_per_second=(round(self.window_inputs / elapsed, 1)
                                     if self.window_inputs else None),
            mfu=None if mfu is None else round(mfu, 4),
            mfu_full_rows=None if mfu_full_rows is None else round(mfu_full_rows, 4),
            step_seconds=None if step_seconds is None else round(step_seconds, 6),
            peak_memory_bytes=peak_memory, preflight=self.preflight,
            update_time=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        if self.enabled:
            loss_text = "n/a" if loss is None else f"{loss:.4f}"
            line = (f"step {step}/{self.total_steps} | epoch {epoch:.2f} | loss {loss_text} | "
                    f"lr {lr:.2e} | {tokens_per_second:,.0f} tok/s | eta {format_duration(eta)}"
                    + ("" if mfu is None else f" | MFU {mfu:.1%}")
                    + "".join(f" | {label} {shown.format(value)}" for label, value, shown
                              in headline(objective_metrics)))
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)
            self._write(record)
            with self.history.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record.as_json(history=True)) + "\n")
            for tracker in self.trackers:
                tracker.log(record)
        self.window_start, self.window_tokens, self.window_steps = time.perf_counter(), 0, 0
        self.window_inputs = 0
        self.last = record
        return record

    def evaluated(self, step: int, loss: float | None,
                  figures: dict[str, float] | None = None) -> None:
        """The evaluation at `step`, its loss and figures (`Evaluation`): in the latest
        record and every one after it."""
        if loss is not None:
            self.eval_loss = loss
        self.eval_figures = {f"eval_{name}": value for name, value in (figures or {}).items()}
        if not self.enabled:
            return
        if self.last is not None:
            self.last.eval_loss = self.eval_loss
            self.last.objective_metrics = _rounded({**(self.last.objective_metrics or {}),
                                                    **self.eval_figures})
            self._write(self.last)
        for tracker in self.trackers:
            tracker.evaluated(step, loss, self.eval_figures)

    def conclude(self, stopped_early: str | None = None, eval_loss: float | None = None,
                 exporting: bool = False) -> None:
        """The steps are over: the record with the run's final figures (what the model card
        reads, before any push takes the card along), phase Exporting where rank 0 pushes
        the model next (`output.export`): a 16 GB push can outlast `stallTimeoutSeconds`,
        which counts from the last step."""
        if self.enabled:
            record = (self.last or self._untrained()).model_copy()
            record.eta_seconds, record.stopped_early = 0, stopped_early
            if eval_loss is not None:
                record.eval_loss = eval_loss
            if exporting:
                record.phase = "Exporting"
            self._write(record)

    def finish(self, phase: str, stopped_early: str | None = None,
               eval_loss: float | None = None,
               exports: list[dict[str, str]] | None = None) -> None:
        """Publish the final phase with the last figures (no log line), and why the run
        stopped before its last step; `eval_loss`: the export's, where it is not the last
        evaluation's (early stopping exports the best one's weights), so a sweep ranks a
        trial by the model it keeps. A Succeeded record is also the pod's termination
        message, the operator's one way to read it once the trainer has gone."""
        if self.enabled:
            final = self.last or self._untrained()
            final.phase, final.eta_seconds, final.stopped_early = phase, 0, stopped_early
            if eval_loss is not None:
                final.eval_loss = eval_loss
            if exports:
                final.exports = exports
            self._write(final)
            if phase == "Succeeded":
                errors.termination_message(final.as_termination_message())
            for tracker in self.trackers:
                tracker.finish(final)
        self.close()

    def _untrained(self) -> ProgressRecord:
        """The record of a run that trained no step (a rerun of a finished one): the one it
        left in the output folder where that is of this step, else the step alone."""
        try:
            before = ProgressRecord.model_validate_json(self.path.read_text())
        except (OSError, ValueError):
            before = None
        if before is not None and before.step == self.start_step:
            return before
        return ProgressRecord(step=self.start_step, total_steps=self.total_steps,
                              eval_loss=self.eval_loss,
                              objective_metrics=_rounded(self.eval_figures))

    def _write(self, record: ProgressRecord) -> None:
        if self.server is not None:
            self.server.publish(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record.as_json()))
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class ProgressServer:
    """A rank's HTTP endpoint on the metrics port: `GET /metrics` (Prometheus, every rank),
    `GET /progress` (rank 0's latest record, which the operator reads into the FineTuneJob
    status) and `GET /healthz`. A port that cannot be bound costs only this endpoint, never
    the training run. `reuse_port`: listen beside the socket holding the port for this
    process (`metrics.reusePort`)."""

    def __init__(self, port: int, host: str = "0.0.0.0", registry=None,
                 reuse_port: bool = False):
        self.record: dict | None = None
        self.registry = registry
        """Prometheus registry served on /metrics (every rank has one)."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._send(200, b"ok\n", "text/plain")
                elif self.path == "/progress" and server.record is not None:
                    self._send(200, json.dumps(server.record).encode(), "application/json")
                elif self.path == "/progress":
                    self._send(204, b"", "application/json")
                elif self.path == "/metrics" and server.registry is not None:
                    self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # keep the training log clean
                pass

        class Server(ThreadingHTTPServer):
            def server_bind(self) -> None:
                if reuse_port:
                    self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                super().server_bind()

        try:
            self.httpd: ThreadingHTTPServer | None = Server((host, port), Handler)
        except OSError as error:
            print(f"progress endpoint not served: port {port}: {error.strerror}", flush=True)
            self.httpd = None
            return
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True,
                         name="progress-server").start()

    def publish(self, record: ProgressRecord) -> None:
        self.record = record.as_json()

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


def _rounded(figures: dict[str, float]) -> dict[str, float] | None:
    """The objective's figures as a record holds them (None: it has none)."""
    return {name: round(value, 6) for name, value in figures.items()} or None
