"""This rank's GPU through NVML, read at scrape time (never from the training loop).

Where NVML is missing (no GPU, no driver), nothing is registered and no finetune_gpu_*
series appear — dashboards and alerts treat their absence as "not a GPU job". A single
reading NVML refuses (a counter this GPU lacks, e.g. NVLink on a PCIe card) drops only
that series.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

THROTTLE_REASONS = {
    # NVML's clocks-event bits → the `reason` label (idle and app-clock settings left out:
    # they are not slowdowns)
    "nvmlClocksEventReasonSwPowerCap": "sw_power_cap",
    "nvmlClocksEventReasonHwSlowdown": "hw_slowdown",
    "nvmlClocksEventReasonSyncBoost": "sync_boost",
    "nvmlClocksEventReasonSwThermalSlowdown": "sw_thermal",
    "nvmlClocksEventReasonHwThermalSlowdown": "hw_thermal",
    "nvmlClocksEventReasonHwPowerBrakeSlowdown": "hw_power_brake",
}


class GpuCollector:
    """A prometheus-client collector for one GPU; `nvml` is the pynvml module."""

    def __init__(self, nvml, handle, labels: dict[str, str], index: int) -> None:
        self.nvml, self.handle = nvml, handle
        self.labels = {**labels, "gpu": str(index)}

    def collect(self) -> Iterator:
        nvml, handle = self.nvml, self.handle
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, text: str, read) -> Iterator[GaugeMetricFamily]:
            try:
                value = read()
            except nvml.NVMLError:
                return
            family = GaugeMetricFamily(name, text, labels=names)
            family.add_metric(values, value)
            yield family

        yield from gauge("finetune_gpu_utilization_ratio",
                         "Fraction of the last sample period a kernel ran on the GPU",
                         lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
        memory = None
        with contextlib.suppress(nvml.NVMLError):
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        if memory is not None:
            yield from gauge("finetune_gpu_memory_used_bytes", "GPU memory in use (all "
                             "processes)", lambda: float(memory.used))
            yield from gauge("finetune_gpu_memory_total_bytes", "GPU memory installed",
                             lambda: float(memory.total))
        yield from gauge("finetune_gpu_power_watts", "Power draw",
                         lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        yield from gauge("finetune_gpu_temperature_celsius", "Core temperature",
                         lambda: float(nvml.nvmlDeviceGetTemperature(
                             handle, nvml.NVML_TEMPERATURE_GPU)))
        yield from gauge("finetune_gpu_sm_clock_hertz", "Streaming multiprocessor clock",
                         lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM) * 1e6)
        yield from self._throttling(names, values)
        yield from self._nvlink(names, values)

    def _throttling(self, names, values) -> Iterator[GaugeMetricFamily]:
        nvml = self.nvml
        try:
            active = nvml.nvmlDeviceGetCurrentClocksEventReasons(self.handle)
        except nvml.NVMLError:
            return
        family = GaugeMetricFamily("finetune_gpu_throttled", "1 while clocks are held down "
                                   "for this reason", labels=[*names, "reason"])
        for constant, reason in THROTTLE_REASONS.items():
            bit = getattr(nvml, constant, None)
            if bit is not None:
                family.add_metric([*values, reason], 1.0 if active & bit else 0.0)
        yield family

    def _nvlink(self, names, values) -> Iterator[CounterMetricFamily]:
        nvml = self.nvml
        fields = [getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", None),
                  getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", None)]
        if None in fields:
            return
        try:
            readings = nvml.nvmlDeviceGetFieldValues(self.handle, fields)
        except nvml.NVMLError:
            return
        if any(r.nvmlReturn != nvml.NVML_SUCCESS for r in readings):
            return  # no NVLink on this GPU
        family = CounterMetricFamily("finetune_gpu_nvlink_bytes", "NVLink payload bytes "
                                     "(all links)", labels=[*names, "direction"])
        for direction, reading in zip(("tx", "rx"), readings, strict=True):
            family.add_metric([*values, direction], reading.value.ullVal * 1024.0)  # KiB
        yield family


def register(registry, labels: dict[str, str], device) -> GpuCollector | None:
    """Add this rank's GPU to `registry`; None (and nothing registered) without NVML."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    try:
        import pynvml as nvml  # NVML: a GPU machine's; a CPU run has no driver for it

        nvml.nvmlInit()
        handle = _handle(nvml, device)
    except Exception:  # no library, no driver, or a GPU NVML cannot see: no GPU series
        return None
    collector = GpuCollector(nvml, handle, labels, device.index or 0)
    registry.register(collector)
    return collector


def _handle(nvml, device):
    """NVML numbers GPUs by PCI order and CUDA may not (CUDA_VISIBLE_DEVICES, fastest
    first): match them by UUID."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except nvml.NVMLError:
            pass
    return nvml.nvmlDeviceGetHandleByIndex(device.index or 0)
