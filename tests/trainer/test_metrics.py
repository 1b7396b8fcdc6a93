"""Every rank's /metrics: the series a Prometheus scrape reads from a real 2-process run."""

from __future__ import annotations

import http.client
import re
import signal
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from finetune_trainer.metrics import TrainerMetrics
from finetune_trainer.progress import ProgressServer
from tests.support import waits
from tests.trainer.test_tensorboard import scalars
from tests.trainer.test_training import finetune_run, manifest


def metrics_ports(count: int = 2) -> int:
    """The first of `count` consecutive ports nothing listens on (local rank k serves on
    port + k), for `finetune run --metrics-port`: from the ephemeral range, which the
    default ports (9108 and up: a free pair taken by each run) never reach, so a run beside
    this one never takes them."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count <= 65536 and all(_bindable(first + k) for k in range(count)):
            return first


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def served_from(process) -> int:
    """The first of the ports a `finetune run` started with wait=False (2 processes, its
    default ports) said it serves on: process k on that port + k. Chosen by the run, which
    holds them for its workers from the moment it names them (`local.PortHold`): a port
    chosen here and passed with --metrics-port could be taken before the run held it (a
    connection's local port: the kernel hands out ports from the range a probe's come from)."""
    said = lines_until(process, "metrics: ")
    line = said.splitlines()[-1] if said else ""
    found = re.fullmatch(r"metrics: http://127\.0\.0\.1:(\d+)/metrics, one per process: ports "
                         r"(\d+)-(\d+)( \(ports 9108-9109 held by another process\))?", line)
    assert found, said
    first = int(found[1])
    assert (int(found[2]), int(found[3])) == (first, first + 1), line
    assert (first == 9108) == (found[4] is None), line  # the default, else said why not
    return first


def lines_until(process, prefix: str) -> str:
    """What a `finetune run` started with wait=False printed up to its first line that
    starts with `prefix`, that line included."""
    said = []
    for line in process.stdout:
        said.append(line)
        if line.startswith(prefix):
            break
    return "".join(said)


def scrape(port: int) -> dict[str, dict]:
    """name → {rank: (labels, value)} for each sample; {} while nothing listens (or the
    process serving it exits mid-answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException):
        return {}
    return {sample.name: {"labels": sample.labels, "value": sample.value}
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_series_carry_job_rank_and_node_and_follow_the_log_step():
    metrics = TrainerMetrics("demo", "ml-team", rank=1, node="aks-gpu-0")
    server = ProgressServer(0, host="127.0.0.1", registry=metrics.registry)
    try:
        metrics.tokens.inc(1200)
        metrics.logged(step=5, total=100, epoch=0.05, loss=1.5, lr=2e-4,
                       tokens_per_second=3100.0, device=None)
        got = scrape(server.port)
    finally:
        server.close()
    assert got["finetune_step"]["labels"] == {"job": "demo", "namespace": "ml-team",
                                              "rank": "1", "node": "aks-gpu-0"}
    assert got["finetune_step"]["value"] == 5 and got["finetune_total_steps"]["value"] == 100
    assert got["finetune_loss"]["value"] == 1.5
    assert got["finetune_tokens_total"]["value"] == 1200
    assert got["finetune_peak_memory_bytes"]["value"] > 10 * 2**20  # this process's RSS


def test_an_objectives_figures_are_a_series_by_name_on_the_log_step():
    metrics = TrainerMetrics("demo", "ml-team", rank=0, node="aks-gpu-0")
    server = ProgressServer(0, host="127.0.0.1", registry=metrics.registry)
    try:
        metrics.logged(step=5, total=100, epoch=0.05, loss=0.6, lr=2e-4,
                       tokens_per_second=3100.0, device=None)
        assert samples(server.port, "finetune_objective_metric") == {}  # SFT: none
        metrics.logged(step=10, total=100, epoch=0.1, loss=0.6, lr=2e-4,
                       tokens_per_second=3100.0, device=None,
                       objective_metrics={"rewards/chosen": 0.5, "rewards/margins": 0.75,
                                          "reward": 0.25, "kl": float("nan")})
        got = samples(server.port, "finetune_objective_metric")
    finally:
        server.close()
    # DPO's and GRPO's by TRL's names; a NaN (no reward applied) is left out
    assert got == {"rewards/chosen": 0.5, "rewards/margins": 0.75, "reward": 0.25}


def samples(port: int, name: str) -> dict[str, float]:
    """The samples of one labelled series, keyed by their one extra label's value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                timeout=waits.seconds_left()) as response:
        text = response.read().decode()
    common = {"job", "namespace", "rank", "node"}
    return {next(v for k, v in s.labels.items() if k not in common): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


@pytest.mark.process
def test_both_ranks_of_a_real_run_serve_their_series(tiny_model_dir, tmp_path):
    # steps enough never to end first: the run is stopped below once the series are seen
    # (400 steps ended while rank 1's port, chosen here and taken by then, served nothing on a
    # busy machine, 11-28: the run chooses and holds its ports now)
    job = manifest(tiny_model_dir, tmp_path / "out", steps=100_000, checkpoint_every=100_000)
    job["spec"]["dataset"]["evalFraction"] = 0.25
    job["spec"]["hyperparameters"]["evalEverySteps"] = 2
    process = finetune_run(job, tmp_path, wait=False)
    try:
        port = served_from(process)
        deadline, seen = time.monotonic() + waits.seconds_left(), {}
        while time.monotonic() < deadline and process.poll() is None:
            seen = {rank: scrape(port + rank) for rank in (0, 1)}
            if all(s.get("finetune_step", {}).get("value", 0) >= 2 for s in seen.values()):
                break
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()[0][-3000:]
        for rank in (0, 1):
            series = seen[rank]
            assert series, f"rank {rank} serves no metrics on {port + rank}"
            assert series["finetune_step"]["labels"]["rank"] == str(rank)
            assert series["finetune_step"]["labels"]["job"] == job["metadata"]["name"]
            assert series["finetune_step"]["value"] >= 2
            assert series["finetune_tokens_total"]["value"] > 0
            assert series["finetune_loss"]["value"] > 0
            assert series["finetune_tokens_per_second"]["value"] > 0
            assert series["finetune_samples_per_second"]["value"] > 0
            assert series["finetune_samples_total"]["value"] > 0
            assert series["finetune_grad_norm"]["value"] > 0
            assert series["finetune_restarts"]["value"] == 0
            # the step-time split and the DDP hook's all-reduce timings
            phases = samples(port + rank, "finetune_step_phase_seconds")
            assert set(phases) == {"data", "forward_backward", "optimizer", "collective_wait"}
            assert all(v >= 0 for v in phases.values()) and phases["forward_backward"] > 0
            busbw = samples(port + rank, "finetune_collective_bus_bandwidth_bytes_per_second")
            assert busbw["all_reduce"] > 0
            assert samples(port + rank, "finetune_collective_bytes_total")["all_reduce"] > 0
            # CPU: no GPU series and no MFU (no peak to measure against)
            assert not any(name.startswith("finetune_gpu_") for name in series)
            assert "finetune_mfu" not in series
        preflight = samples(port, "finetune_preflight_bus_bandwidth_bytes_per_second")
        assert len(preflight) >= 4 and all(v > 0 for v in preflight.values())
        assert samples(port, "finetune_preflight_slow_node") == {"localhost": 0.0} or \
            len(samples(port, "finetune_preflight_slow_node")) == 1  # one node: nothing to compare
        assert "finetune_preflight_bus_bandwidth_bytes_per_second" not in seen[1]  # rank 0 only
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=waits.seconds_left())
    # and rank 0's TensorBoard event files, flushed at each record and closed on SIGTERM
    seen = scalars(tmp_path / "out")
    assert {1, 2} <= set(seen["train/loss"]) and 2 in seen["eval/loss"]
    assert all(v > 0 for v in seen["train/grad_norm"].values())


@pytest.mark.process
@pytest.mark.parametrize(("strategy", "ops"), [
    ("fsdp", {"all_gather", "reduce_scatter"}),  # FSDP2's own collectives, timed every step
    ("zero2", None),  # DeepSpeed's comms logger on sampled steps (ops are DeepSpeed's choice)
])
def test_sharded_strategies_time_their_collectives(tiny_model_dir, tmp_path, strategy, ops):
    # steps enough never to end first: the run is stopped below once the series are seen
    # (400 steps ended before ZeRO-2's sampled step was scraped on a busy machine, 11-28)
    job = manifest(tiny_model_dir, tmp_path / "out", strategy=strategy, method="full",
                   steps=100_000, checkpoint_every=100_000)
    process = finetune_run(job, tmp_path, wait=False)
    try:
        port = served_from(process)
        deadline, busbw, phases = time.monotonic() + waits.seconds_left(), {}, {}
        while time.monotonic() < deadline and process.poll() is None:
            try:
                busbw = samples(port + 1, "finetune_collective_bus_bandwidth_bytes_per_second")
                phases = samples(port + 1, "finetune_step_phase_seconds")
            except (OSError, http.client.HTTPException):  # not serving yet
                pass
            if busbw and "collective_wait" in phases:
                break
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert busbw and all(v > 0 for v in busbw.values()), busbw
        if ops is not None:
            assert set(busbw) == ops
        assert phases["collective_wait"] > 0
        calls = samples(port + 1, "finetune_collective_calls_total")
        assert all(calls[op] >= 1 for op in busbw)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=waits.seconds_left())
