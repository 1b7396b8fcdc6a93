"""Every rank's Prometheus series (`GET /metrics` on the metrics port + local rank).

Updated only where the loop already holds host-side values (tokens per step, the loss and
learning rate of a log step, checkpoint timings), so exporting adds no device sync. Names
are `finetune_*` in base units; labels say which job, rank and node a series is from.
"""

from __future__ import annotations

import os
import resource
import socket
import sys

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SECONDS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class TrainerMetrics:
    def __init__(self, job: str, namespace: str, rank: int, node: str | None = None):
        self.registry = CollectorRegistry()
        labels = {"job": job, "namespace": namespace, "rank": str(rank),
                  "node": node or os.environ.get("NODE_NAME") or socket.gethostname()}

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, list(labels), registry=self.registry).labels(**labels)

        self.step = gauge("finetune_step", "Optimizer steps completed")
        self.total_steps = gauge("finetune_total_steps", "Optimizer steps the run will take")
        self.epoch = gauge("finetune_epoch", "Epochs completed (fractional)")
        self.loss = gauge("finetune_loss", "Mean training loss per label token over the last "
                          "log window (all ranks)")
        self.learning_rate = gauge("finetune_learning_rate", "Learning rate of the last step")
        self.tokens_per_second = gauge("finetune_tokens_per_second", "Label tokens per second "
                                       "over the last log window (all ranks)")
        self.peak_memory = gauge("finetune_peak_memory_bytes", "Peak memory of this rank: "
                                 "the CUDA allocator's on a GPU, resident memory on CPU")
        self.tokens = Counter("finetune_tokens", "Label tokens trained on by this rank",
                              list(labels), registry=self.registry).labels(**labels)
        self.checkpoint_save = Histogram(
            "finetune_checkpoint_save_seconds", "Time to write a checkpoint (collective)",
            list(labels), buckets=SECONDS, registry=self.registry).labels(**labels)
        self.checkpoint_load = gauge("finetune_checkpoint_load_seconds",
                                     "Time the resume from the last checkpoint took")

    def logged(self, step: int, total: int, epoch: float, loss: float | None, lr: float,
               tokens_per_second: float, device) -> None:
        """A log step: the figures every rank now holds (the loss was all-reduced)."""
        self.step.set(step)
        self.total_steps.set(total)
        self.epoch.set(epoch)
        if loss is not None:
            self.loss.set(loss)
        self.learning_rate.set(lr)
        self.tokens_per_second.set(tokens_per_second)
        self.peak_memory.set(peak_memory_bytes(device))


def peak_memory_bytes(device) -> int:
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
