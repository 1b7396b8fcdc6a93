"""Collective timings from stamps (queueing removed, exposed part found) and the NVML
series' translation — the parts of the metrics that need no second process or GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from finetune_trainer.collectives import CollectiveLog, merge
from finetune_trainer.gpu import GpuCollector


def stamped(log: CollectiveLog, op: str, size: int, start: float, end: float) -> None:
    record = log.start(op, size)
    record.start, record.end = start, end


def test_a_window_removes_queueing_and_finds_the_exposed_tail():
    log = CollectiveLog(torch.device("cpu"), world=4)
    log.clock.origin = 0.0
    stamped(log, "all_reduce", 100, 0.0, 1.0)
    stamped(log, "all_reduce", 300, 0.5, 3.0)  # queued behind the first until 1.0
    log.step_boundary()
    stamped(log, "all_reduce", 100, 10.0, 10.5)
    log.step_boundary()
    window = log.drain()
    totals = window.totals["all_reduce"]
    assert (totals.calls, totals.bytes) == (3, 500)
    assert totals.seconds == pytest.approx(1.0 + 2.0 + 0.5)
    assert window.exposed_seconds == pytest.approx(2.0 + 0.5)  # each step's last reduction
    assert window.bus_bandwidth(4)["all_reduce"] == pytest.approx(500 / 3.5 * 1.5)
    assert log.drain().totals == {}  # drained


def test_fsdp_first_gather_of_a_step_counts_as_exposed():
    log = CollectiveLog(torch.device("cpu"), world=2)
    log.clock.origin = 0.0
    stamped(log, "all_gather", 10, 0.0, 0.25)  # nothing to overlap the first gather with
    stamped(log, "all_gather", 10, 0.3, 0.5)  # prefetched under compute
    stamped(log, "reduce_scatter", 20, 1.0, 1.5)  # the step's last reduction
    log.step_boundary()
    window = merge([log.drain()])
    assert window.exposed_seconds == pytest.approx(0.25 + 0.5)
    assert set(window.totals) == {"all_gather", "reduce_scatter"}


class FakeNvml(SimpleNamespace):
    """pynvml's surface as GpuCollector uses it, answering like an H100 that is power-capped."""

    class NVMLError(Exception):
        pass

    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM, NVML_SUCCESS = 0, 1, 0
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139
    nvmlClocksEventReasonSwPowerCap, nvmlClocksEventReasonHwThermalSlowdown = 0x4, 0x40

    def __init__(self, nvlink: bool):
        super().__init__()
        self.nvlink = nvlink

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=87)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=60 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 650_000  # milliwatts

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 71

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return 1755  # MHz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 0x4

    def nvmlDeviceGetFieldValues(self, handle, fields):
        if not self.nvlink:
            raise self.NVMLError("not supported")
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=kib))
                for kib in (1000, 2000)]


def gpu_series(nvlink: bool) -> dict[tuple, float]:
    registry = CollectorRegistry()
    registry.register(GpuCollector(FakeNvml(nvlink), "handle", {"job": "j", "rank": "0"}, 3))
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("job", "rank")))): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples}


def test_nvml_readings_become_series_in_base_units():
    got = gpu_series(nvlink=True)
    gpu = (("gpu", "3"),)
    assert got[("finetune_gpu_utilization_ratio", gpu)] == 0.87
    assert got[("finetune_gpu_memory_used_bytes", gpu)] == 60 * 2**30
    assert got[("finetune_gpu_power_watts", gpu)] == 650.0
    assert got[("finetune_gpu_sm_clock_hertz", gpu)] == 1755e6
    assert got[("finetune_gpu_temperature_celsius", gpu)] == 71
    assert got[("finetune_gpu_throttled", (("gpu", "3"), ("reason", "sw_power_cap")))] == 1
    assert got[("finetune_gpu_throttled", (("gpu", "3"), ("reason", "hw_thermal")))] == 0
    assert got[("finetune_gpu_nvlink_bytes_total", (("direction", "rx"), ("gpu", "3")))] == \
        2000 * 1024


def test_a_reading_nvml_refuses_drops_only_that_series():
    got = gpu_series(nvlink=False)  # a PCIe card
    assert not any(name.startswith("finetune_gpu_nvlink") for name, _ in got)
    assert ("finetune_gpu_power_watts", (("gpu", "3"),)) in got


def test_no_gpu_means_no_gpu_series():
    from finetune_trainer.metrics import TrainerMetrics

    metrics = TrainerMetrics("j", "ns", 0, node="n", device=torch.device("cpu"))
    text = generate_latest(metrics.registry).decode()
    assert metrics.gpu is None and "finetune_gpu_" not in text
