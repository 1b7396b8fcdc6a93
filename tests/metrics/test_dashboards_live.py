"""The dashboards' queries on a real Prometheus.

Both dashboards against a Prometheus that scrapes a real 2-process `finetune run` and the
real operator (against the emulated cluster): every panel's query returns series. One
FineTuneJob name for both sides, so the job dashboard's operator panels (phase, restarts)
find the job its trainer series come from. The shipped alert rules are loaded too: they
must evaluate without errors on real series.

The GPU panels, which a CPU run leaves empty, against fixture series: the trainer's NVML
gauges where it has them, else the DCGM exporter's series of the job's pods only.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from finetune_operator.backends import BackendError
from tests.support import waits
from tests.support.emulator import ApiServer
from tests.support.monitoring import (
    PROMETHEUS,
    RULES,
    Prometheus,
    dashboard,
    panels,
    substitute,
    targets,
    variable_queries,
)
from tests.trainer.test_metrics import metrics_ports
from tests.trainer.test_training import finetune_run, manifest

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not on PATH (CI installs it; Debian/Ubuntu: "
    "apt-get install prometheus)")

BOARDS = ("finetune-job", "finetune-operator")
JOB, NAMESPACE = "dashboards", "default"  # the emulated testbed's namespace, and the trainer's
VARIABLES = {"namespace": NAMESPACE, "job": JOB, "backend": "kubernetes",
             "__rate_interval": "30s", "__interval": "15s", "__range": "5m"}

# Panels that have no series in the CPU run, each with the reason; every other panel must.
GPU_ONLY = {
    # NVML gauges of the trainer, or DCGM exporter series: there is no GPU here (the test
    # below shows them on fixture series)
    ("finetune-job", "GPU utilisation"), ("finetune-job", "GPU memory"),
    ("finetune-job", "GPU power"), ("finetune-job", "GPU temperature"),
    ("finetune-job", "GPU SM clock"), ("finetune-job", "GPU throttling"),
    ("finetune-job", "NVLink traffic"),
    # MFU needs the GPU's peak FLOPs
    ("finetune-job", "MFU"),
}
NOT_IN_THIS_RUN = {  # and so must be empty here
    # set only after a resume from a checkpoint (0 before: the panel shows only > 0); this
    # run starts fresh
    ("finetune-job", "Checkpoint load time"),
    # DPO and GRPO jobs only (finetune_objective_metric): this run is supervised
    # fine-tuning; the series and its names are checked in tests/trainer/test_metrics.py
    ("finetune-job", "Preference rewards (DPO)"),
    ("finetune-job", "Rewards (GRPO)"),
}
EXCEPTED = GPU_ONLY | NOT_IN_THIS_RUN


def start_trainer(model_dir, where, port: int) -> subprocess.Popen:
    job = manifest(model_dir, where / "out", steps=2000, checkpoint_every=10)
    job["metadata"] = {"name": JOB, "namespace": NAMESPACE}
    return finetune_run(job, where, "--metrics-port", str(port), wait=False)


def stop(process: subprocess.Popen) -> str:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # the workers checkpoint and exit
    try:
        return process.communicate(timeout=waits.seconds_left())[0]
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()[0]


async def drive_the_operator(testbed) -> None:
    """A job that runs, loses a worker (a counted gang restart), runs again, and meets one
    refused backend call."""
    await testbed.apply(testbed.manifest(JOB))
    await testbed.until_phase("Running", JOB)
    await testbed.fail_worker(JOB, 1, "RuntimeError: NCCL error")
    await testbed.until(lambda: testbed.status(JOB).get("restarts") == 1, "restart counted")
    await testbed.until_phase("Running", JOB)

    backend = testbed.operator.runtime.backends["kubernetes"]
    observe = backend.observe

    async def refused(job):
        del backend.observe  # once
        raise BackendError("injected: the API server answered 503", retry_after=0.5)

    backend.observe = refused
    await testbed.until(lambda: "observe" not in vars(backend), "a refused observe")
    assert backend.observe == observe


async def until(check, what: str, share: float = 1.0) -> bool:
    """Until the blocking `check()` is true (True), or `share` of the test's time left has
    passed: an AssertionError naming `what`, or with `share` < 1 False (the caller says
    what is missing)."""
    timeout = waits.seconds_left() * share
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            assert share < 1, f"not within {timeout:.0f}s: {what}"
            return False
        await asyncio.sleep(0.5)
    return True


@needs_prometheus
@pytest.mark.kmock(cls=ApiServer)
@pytest.mark.asyncio
async def test_every_panel_of_both_dashboards_has_series(emulated_testbed, tiny_model_dir,
                                                          tmp_path):
    testbed = emulated_testbed
    operator_port = testbed.operator.runtime.metrics.serve(0, host="127.0.0.1")
    trainer_port = metrics_ports(2)  # local rank k on trainer_port + k
    trainer_ports = (trainer_port, trainer_port + 1)
    scraped = {"trainer": [f"127.0.0.1:{port}" for port in trainer_ports],
               "operator": [f"127.0.0.1:{operator_port}"]}
    trainer = start_trainer(tiny_model_dir, tmp_path / "run", trainer_port)
    try:
        with Prometheus(tmp_path / "prometheus", scraped, rule_files=(RULES,)) as prometheus:
            await drive_the_operator(testbed)

            def trained() -> bool:
                assert trainer.poll() is None, "the trainer exited"
                steps = prometheus.query(f'finetune_step{{job="{JOB}"}} >= 12')
                return len(steps) == len(trainer_ports)

            # a dozen logged steps on both ranks (a checkpoint among them), seen over 5s
            await until(trained, "both ranks past step 12 in Prometheus")
            await asyncio.sleep(5)
            answers = {}

            def answered() -> bool:  # every panel has series, every rule was evaluated
                assert trainer.poll() is None, "the trainer exited"
                answers["panels"] = query_both_dashboards(prometheus)
                answers["rules"] = {rule["name"]: (rule["health"], rule.get("lastError")
                                                   or None) for rule in prometheus.rules()}
                return not empty_panels(answers["panels"][0]) and all(
                    health == ("ok", None) for health in answers["rules"].values())

            # on a busy machine a scrape or a rule evaluation comes late: half the time
            # left for them, the rest to stop the trainer
            await until(answered, "", share=0.5)
            (results, variables), rule_health = answers["panels"], answers["rules"]
        await testbed.delete(JOB)  # the operator stops with nothing left to look at
        await testbed.until(lambda: testbed.ftj(JOB) is None, "deleted")
    finally:
        print(stop(trainer)[-3000:])  # shown when the test fails

    titles = {(name, panel["title"]) for name in BOARDS for panel in panels(dashboard(name))}
    assert titles >= EXCEPTED, f"excepted panels that no longer exist: {EXCEPTED - titles}"
    empty = empty_panels(results)
    assert not empty, "panels without series:\n  " + "\n  ".join(empty)
    shown = sorted(title for (name, title, _ref), series in results.items()
                   if series and (name, title) in NOT_IN_THIS_RUN)
    assert not shown, f"data where this run has none (drop them from NOT_IN_THIS_RUN?): {shown}"

    assert NAMESPACE in variables["namespace"]
    assert JOB in variables["job"]
    assert "kubernetes" in variables["backend"]
    assert rule_health and all(health == ("ok", None) for health in rule_health.values()), \
        rule_health


def empty_panels(results: dict) -> list[str]:
    """The panels of query_both_dashboards' results without series, but those excepted."""
    return sorted(f"{name} / {title} ({ref})" for (name, title, ref), series in results.items()
                  if not series and (name, title) not in EXCEPTED)


def query_both_dashboards(prometheus: Prometheus) -> tuple[dict, dict]:
    """(board, panel title, refId) → the series of that target now, and variable name → the
    values Grafana would offer. Annotation queries must parse; they may well be empty."""
    results, variables = {}, {}
    for name in BOARDS:
        board = dashboard(name)
        for title, target in targets(board):
            results[(name, title, target["refId"])] = prometheus.query(
                substitute(target["expr"], VARIABLES))
        for annotation in board["annotations"]["list"]:
            if "expr" in annotation:
                prometheus.query(substitute(annotation["expr"], VARIABLES))
        for variable, query in variable_queries(board).items():
            variables[variable] = label_values(prometheus, query)
    return results, variables


def label_values(prometheus: Prometheus, query: str) -> list[str]:
    """Grafana's `label_values(selector, label)` variable query, through the labels API."""
    inner = query.removeprefix("label_values(").removesuffix(")")
    selector, _, label = inner.rpartition(",")
    return prometheus.label_values(label.strip(), substitute(selector.strip(), VARIABLES))


# --- the GPU panels on fixture series ------------------------------------------------------

GPU_NAMESPACE = "ml"
NVML_JOB, DCGM_JOB = "on-nvml", "on-dcgm"
DCGM_PODS = {  # pod → (namespace, node): the DCGM exporter's `pod`, `namespace`, `Hostname`
    f"{DCGM_JOB}-0-x1y2z": (GPU_NAMESPACE, "node-b"),
    f"{DCGM_JOB}-1-q3w4e": (GPU_NAMESPACE, "node-c"),
    f"{NVML_JOB}-0-a1b2c": (GPU_NAMESPACE, "node-a"),  # NVML's figures win for this job
    f"{DCGM_JOB}-extra-0-m5n6p": (GPU_NAMESPACE, "node-d"),  # another job, a similar name
    f"{DCGM_JOB}-0-r7s8t": ("elsewhere", "node-e"),  # the same name in another namespace
}


def gpu_fixture_series() -> CollectorRegistry:
    """Two ranks of one job with the trainer's NVML gauges (and DCGM series it outranks);
    a job whose GPUs only DCGM reports; DCGM series of other pods."""
    registry = CollectorRegistry()
    labels = ["job", "namespace", "rank", "node", "gpu"]

    def gauge(name: str, value: float, extra: dict | None = None) -> None:
        metric = Gauge(name, name, labels + list(extra or {}), registry=registry)
        for rank in (0, 1):
            metric.labels(NVML_JOB, GPU_NAMESPACE, str(rank), "node-a", str(rank),
                          *(extra or {}).values()).set(value)

    gauge("finetune_gpu_utilization_ratio", 0.8)
    gauge("finetune_gpu_memory_used_bytes", 40e9)
    gauge("finetune_gpu_memory_total_bytes", 80e9)
    gauge("finetune_gpu_power_watts", 300)
    gauge("finetune_gpu_temperature_celsius", 60)
    gauge("finetune_gpu_sm_clock_hertz", 1.98e9)
    gauge("finetune_gpu_throttled", 0, {"reason": "hw_thermal"})
    nvlink = Counter("finetune_gpu_nvlink_bytes", "", [*labels, "direction"],
                     registry=registry)
    for rank in (0, 1):
        for direction in ("tx", "rx"):
            nvlink.labels(NVML_JOB, GPU_NAMESPACE, str(rank), "node-a", str(rank),
                          direction).inc(1e9)
    Gauge("finetune_mfu", "", labels[:4], registry=registry).labels(
        NVML_JOB, GPU_NAMESPACE, "0", "node-a").set(0.45)

    dcgm = {"DCGM_FI_DEV_GPU_UTIL": 50, "DCGM_FI_DEV_FB_USED": 1024,
            "DCGM_FI_DEV_FB_FREE": 3072, "DCGM_FI_DEV_POWER_USAGE": 250,
            "DCGM_FI_DEV_GPU_TEMP": 70, "DCGM_FI_DEV_SM_CLOCK": 1410}
    for name, value in dcgm.items():
        metric = Gauge(name, name, ["gpu", "Hostname", "namespace", "pod"], registry=registry)
        for pod, (namespace, node) in DCGM_PODS.items():
            for gpu in ("0", "1"):
                metric.labels(gpu, node, namespace, pod).set(value)
    return registry


@pytest.fixture(scope="module")
def gpu_prometheus(tmp_path_factory):
    server, thread = start_http_server(0, addr="127.0.0.1", registry=gpu_fixture_series())
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        with Prometheus(tmp_path_factory.mktemp("prometheus"), {"exporters": [address]}
                        ) as prometheus:
            deadline = time.monotonic() + waits.seconds_left()
            # two scrapes at least: rate() needs them
            while not prometheus.query("count_over_time(finetune_gpu_nvlink_bytes_total[1m])"
                                       " >= 2"):
                assert time.monotonic() < deadline, "the fixture series were not scraped"
                time.sleep(0.5)
            yield prometheus
    finally:
        server.shutdown()
        thread.join()


def gpu_panel_series(prometheus: Prometheus, job: str) -> dict[str, list[dict]]:
    """title → the series of every target of each GPU-only panel, for `job`."""
    values = {**VARIABLES, "namespace": GPU_NAMESPACE, "job": job}
    found: dict[str, list[dict]] = {}
    for title, target in targets(dashboard("finetune-job")):
        if ("finetune-job", title) in GPU_ONLY:
            found.setdefault(title, []).extend(
                prometheus.query(substitute(target["expr"], values)))
    return found


def value_of(series: list[dict]) -> set[float]:
    return {float(s["value"][1]) for s in series}


@pytest.mark.process
@needs_prometheus
def test_the_gpu_panels_show_the_trainers_nvml_series_where_it_has_them(gpu_prometheus):
    found = gpu_panel_series(gpu_prometheus, NVML_JOB)
    assert {title for _board, title in GPU_ONLY} == set(found)
    for title, series in found.items():
        assert series, f"{title}: no series"
        assert not any("Hostname" in s["metric"] for s in series), f"{title}: DCGM's too"
    assert value_of(found["GPU utilisation"]) == {0.8}
    assert value_of(found["GPU memory"]) == {40e9, 80e9}  # used per GPU, capacity


@pytest.mark.process
@needs_prometheus
def test_the_gpu_panels_fall_back_to_dcgm_for_the_jobs_pods_only(gpu_prometheus):
    found = gpu_panel_series(gpu_prometheus, DCGM_JOB)
    for title, series in found.items():
        expressions = [t["expr"] for panel_title, t in targets(dashboard("finetune-job"))
                       if panel_title == title]
        if not any("DCGM_" in expr for expr in expressions):
            assert not series, f"{title} has no DCGM source, yet shows {series}"
            continue
        hosts = {s["metric"].get("Hostname") for s in series}
        # capacity is one line, summed over the pods' GPUs by max()
        assert hosts <= {"node-b", "node-c", None} and series, f"{title}: {series}"
    assert {(s["metric"]["Hostname"], s["metric"]["gpu"])
            for s in found["GPU utilisation"]} == {
        ("node-b", "0"), ("node-b", "1"), ("node-c", "0"), ("node-c", "1")}
    # DCGM's units, converted: percent → ratio, MiB → bytes, MHz → Hz
    assert value_of(found["GPU utilisation"]) == {0.5}
    assert value_of(found["GPU memory"]) == {1024 * 2**20, 4096 * 2**20}
    assert value_of(found["GPU SM clock"]) == {1410e6}
    assert value_of(found["GPU power"]) == {250} and value_of(found["GPU temperature"]) == {70}
