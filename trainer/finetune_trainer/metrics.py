"""Every rank's Prometheus series (`GET /metrics` on the metrics port + local rank).

Updated only where the loop already holds host-side values (tokens per step, the figures
of a log step after the loss was read, checkpoint timings), so exporting adds no device
sync. Names are `finetune_*` in base units; labels say which job, rank and node a series
is from. GPU series come from NVML at scrape time (finetune_trainer.gpu).
"""

from __future__ import annotations

import math
import os
import resource
import socket
import sys

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from finetune_trainer import gpu
from finetune_trainer.collectives import Window
from finetune_trainer.network_preflight import PreflightResult

SECONDS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


def gang_restarts(environ) -> int:
    """Restarts before this run: FINETUNE_RESTARTS (the operator's, when it recreated the
    pods; `finetune run`'s, when it started torchrun again) plus TORCHELASTIC_RESTART_COUNT
    (torchrun's own, where someone runs it with --max-restarts)."""
    def count(name: str) -> int:
        try:
            return max(0, int(environ.get(name) or 0))
        except ValueError:
            return 0
    return count("FINETUNE_RESTARTS") + count("TORCHELASTIC_RESTART_COUNT")


class TrainerMetrics:
    def __init__(self, job: str, namespace: str, rank: int, node: str | None = None,
                 device=None):
        self.registry = CollectorRegistry()
        self.rank = rank
        labels = {"job": job, "namespace": namespace, "rank": str(rank),
                  "node": node or os.environ.get("NODE_NAME") or socket.gethostname()}
        names = list(labels)

        def gauge(name: str, text: str, extra: tuple[str, ...] = (), lazy: bool = False):
            """`lazy` (or with extra labels): no sample until first set — a series that
            does not apply here (MFU on CPU) is absent rather than 0."""
            metric = Gauge(name, text, [*names, *extra], registry=self.registry)
            return metric if extra or lazy else metric.labels(**labels)

        def counter(name: str, text: str, extra: tuple[str, ...] = ()) -> Counter:
            metric = Counter(name, text, [*names, *extra], registry=self.registry)
            return metric if extra else metric.labels(**labels)

        self.labels = labels
        self.step = gauge("finetune_step", "Optimizer steps completed")
        self.total_steps = gauge("finetune_total_steps", "Optimizer steps the run will take")
        self.epoch = gauge("finetune_epoch", "Epochs completed (fractional)")
        self.loss = gauge("finetune_loss", "Mean training loss per label token over the last "
                          "log window (all ranks)")
        self.learning_rate = gauge("finetune_learning_rate", "Learning rate of the last step")
        self.grad_norm = gauge("finetune_grad_norm", "Gradient norm before clipping, last "
                               "step of the log window", lazy=True)
        self.tokens_per_second = gauge("finetune_tokens_per_second", "Label tokens per second "
                                       "over the last log window (all ranks)")
        self.samples_per_second = gauge("finetune_samples_per_second", "Sequences per second "
                                        "over the last log window (all ranks; a packed "
                                        "sequence counts once)")
        self.mfu = gauge("finetune_mfu", "Model FLOPs utilisation over the last log window, "
                         "0 to 1 (GPUs with a known peak only)", lazy=True)
        self.step_phase = gauge("finetune_step_phase_seconds", "Mean seconds per step in each "
                                "phase over the last log window (collective_wait: the part of "
                                "the step spent waiting on collectives nothing overlapped)",
                                ("phase",))
        self.objective = gauge("finetune_objective_metric", "The objective's own figures "
                               "over the last log window, all ranks, by TRL's name (DPO: "
                               "rewards/chosen, rewards/margins, ...; GRPO: reward, "
                               "reward_std, rewards/<name>/mean, kl, ...); none for SFT",
                               ("name",))
        self.peak_memory = gauge("finetune_peak_memory_bytes", "Peak memory of this rank: "
                                 "the CUDA allocator's on a GPU, resident memory on CPU")
        self.tokens = counter("finetune_tokens", "Label tokens trained on by this rank")
        self.samples = counter("finetune_samples", "Sequences trained on by this rank")
        self.restarts = gauge("finetune_restarts", "Gang restarts before this run: the "
                              "operator's (new pods) plus torchrun's (workers restarted in "
                              "place after a failure)")
        self.checkpoint_save = Histogram(
            "finetune_checkpoint_save_seconds", "Time to write a checkpoint (collective)",
            names, buckets=SECONDS, registry=self.registry).labels(**labels)
        self.checkpoint_load = gauge("finetune_checkpoint_load_seconds",
                                     "Time the resume from the last checkpoint took", lazy=True)
        self.collective_seconds = counter("finetune_collective_seconds", "Time in collectives "
                                          "of the training step (timed ones)", ("op",))
        self.collective_bytes = counter("finetune_collective_bytes", "Bytes of the training "
                                        "step's collectives (full buffer sizes)", ("op",))
        self.collective_calls = counter("finetune_collective_calls", "Collectives timed",
                                        ("op",))
        self.collective_busbw = gauge("finetune_collective_bus_bandwidth_bytes_per_second",
                                      "Bus bandwidth of the training step's collectives over "
                                      "the last log window (nccl-tests convention)", ("op",))
        self.preflight_busbw = gauge("finetune_preflight_bus_bandwidth_bytes_per_second",
                                     "All-reduce bus bandwidth of every rank together before "
                                     "step 0, per message size", ("size_bytes",))
        self.preflight_node = gauge("finetune_preflight_node_bus_bandwidth_bytes_per_second",
                                    "Per node: all-reduce bus bandwidth of its ranks, or "
                                    "paired with another node", ("tested_node",))
        self.preflight_slow = gauge("finetune_preflight_slow_node", "1 for a node below 0.8x "
                                    "the median of its peers in the preflight",
                                    ("tested_node",))
        self.restarts.set(gang_restarts(os.environ))
        self.gpu = gpu.register(self.registry, labels, device) if device is not None else None

    def logged(self, step: int, total: int, epoch: float, loss: float | None, lr: float,
               tokens_per_second: float, device, *, grad_norm: float | None = None,
               samples_per_second: float | None = None, mfu: float | None = None,
               phases: dict[str, float] | None = None,
               objective_metrics: dict[str, float] | None = None) -> None:
        """A log step: the figures every rank now holds (the loss was all-reduced)."""
        self.step.set(step)
        self.total_steps.set(total)
        self.epoch.set(epoch)
        if loss is not None:
            self.loss.set(loss)
        self.learning_rate.set(lr)
        self.tokens_per_second.set(tokens_per_second)
        if grad_norm is not None and math.isfinite(grad_norm):
            self.grad_norm.labels(**self.labels).set(grad_norm)
        if samples_per_second is not None:
            self.samples_per_second.set(samples_per_second)
        if mfu is not None:
            self.mfu.labels(**self.labels).set(mfu)
        for name, value in (objective_metrics or {}).items():
            if math.isfinite(value):
                self.objective.labels(**self.labels, name=name).set(value)
        for phase, seconds in (phases or {}).items():
            self.step_phase.labels(**self.labels, phase=phase).set(seconds)
        self.peak_memory.set(peak_memory_bytes(device))

    def evaluated(self, figures: dict[str, float]) -> None:
        """An evaluation's figures, as `finetune_objective_metric{name="eval_<name>"}`."""
        for name, value in figures.items():
            if math.isfinite(value):
                self.objective.labels(**self.labels, name=f"eval_{name}").set(value)

    def resumed(self, seconds: float) -> None:
        self.checkpoint_load.labels(**self.labels).set(seconds)

    def collectives(self, window: Window, world: int) -> None:
        for op, totals in window.totals.items():
            self.collective_seconds.labels(**self.labels, op=op).inc(totals.seconds)
            self.collective_bytes.labels(**self.labels, op=op).inc(totals.bytes)
            self.collective_calls.labels(**self.labels, op=op).inc(totals.calls)
        for op, busbw in window.bus_bandwidth(world).items():
            self.collective_busbw.labels(**self.labels, op=op).set(busbw)

    def preflight(self, result: PreflightResult) -> None:
        """Rank 0 only: the figures are the same everywhere."""
        for size, busbw in result.sweep:
            self.preflight_busbw.labels(**self.labels, size_bytes=str(size)).set(busbw)
        for node, busbw in result.node_bandwidth().items():
            self.preflight_node.labels(**self.labels, tested_node=node).set(busbw)
            self.preflight_slow.labels(**self.labels, tested_node=node).set(
                1 if node in result.slow_nodes else 0)


def peak_memory_bytes(device) -> int:
    if getattr(device, "type", "cpu") == "cuda":

        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
