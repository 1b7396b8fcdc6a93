"""How long the strategy's collectives take, and at what bus bandwidth — without a host
sync in the training loop.

Under DDP a communication hook times every gradient all-reduce; under FSDP2 the
module's all-gather and reduce-scatter are replaced by timed equivalents. Both stamp
the start when a collective is issued and the end from the completion callback of its
future: perf_counter on CPU, CUDA events on a GPU (resolved at the next log step, when
the loop has already waited for the device). ZeRO's collectives are DeepSpeed's; its
comms logger times them on sampled steps (it synchronises, so only every
`SAMPLE_EVERY` steps).

Bus bandwidth follows nccl-tests: algorithm bandwidth (bytes / seconds) x 2(n-1)/n for
all-reduce and x (n-1)/n for all-gather and reduce-scatter, where bytes is the full
buffer (the all-gather's output, the reduce-scatter's input).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch.distributed as dist

from finetune_trainer.timing import Clock

OPS = ("all_reduce", "all_gather", "reduce_scatter")
SAMPLE_EVERY = 50
"""ZeRO: steps between timed steps (the first is step 2, after warm-up)."""


def bus_factor(op: str, world: int) -> float:
    if world <= 1:
        return 0.0
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def bus_bandwidth(op: str, size_bytes: float, seconds: float, world: int) -> float:
    """Bytes per second on the bus, as nccl-tests reports it."""
    return size_bytes / seconds * bus_factor(op, world) if seconds > 0 else 0.0


@dataclass
class Totals:
    calls: int = 0
    bytes: float = 0.0
    seconds: float = 0.0


@dataclass
class _Record:
    op: str
    size: int
    start: object
    end: object = None


@dataclass
class Window:
    """What the collectives of one log window added up to."""

    totals: dict[str, Totals] = field(default_factory=dict)
    exposed_seconds: float = 0.0
    """Collectives nothing overlapped: the last one of each step (the final gradient
    reduction) and, under FSDP, the first all-gather of each forward."""

    def bus_bandwidth(self, world: int) -> dict[str, float]:
        return {op: bus_bandwidth(op, t.bytes, t.seconds, world)
                for op, t in self.totals.items() if t.seconds > 0}


class CollectiveLog:
    """Collectives issued since the last log step, with their device-timeline stamps."""

    def __init__(self, device, world: int) -> None:
        self.clock = Clock(device)
        self.world = world
        self._records: list[_Record] = []
        self._step_ends: list[int] = []  # index of the first record of each new step
        self._lock = threading.Lock()  # completion callbacks run on communication threads

    def start(self, op: str, size: int) -> _Record:
        record = _Record(op, size, self.clock.mark())
        self._records.append(record)
        return record

    def finish_when_done(self, record: _Record, work) -> None:
        """Stamp the end when `work` (a Work, a Future, or None for a finished op) completes."""
        if work is None:
            record.end = self.clock.mark()
            return
        future = work.get_future() if hasattr(work, "get_future") else work

        def done(fut):
            with self._lock:
                record.end = self.clock.mark()
            return fut.value()

        future.then(done)

    def step_boundary(self) -> None:
        self._step_ends.append(len(self._records))

    def drain(self) -> Window:
        """Close the window (call at a log step, after the loop has read the loss)."""
        with self._lock:
            records, boundaries = self._records, set(self._step_ends)
            self._records, self._step_ends = [], []
        window = Window()
        previous_end = None
        for index, record in enumerate(records):
            if record.end is None:  # completion callback still running: dropped
                continue
            start = self.clock.since_origin(record.start)
            end = self.clock.since_origin(record.end)
            # collectives of one group run one after another: time queued behind the
            # previous one is not this one's
            begin = start if previous_end is None else max(start, previous_end)
            seconds = max(end - begin, 0.0)
            previous_end = end
            totals = window.totals.setdefault(record.op, Totals())
            totals.calls += 1
            totals.bytes += record.size
            totals.seconds += seconds
            last_of_step = index + 1 in boundaries
            first_gather = record.op == "all_gather" and (index == 0 or index in boundaries)
            if last_of_step or first_gather:
                window.exposed_seconds += seconds
        self.clock.restart()
        return window


def ddp_hook(log: CollectiveLog):
    """A DDP communication hook: the default mean all-reduce, timed."""
    def hook(state, bucket):
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size())
        record = log.start("all_reduce", tensor.numel() * tensor.element_size())
        future = dist.all_reduce(tensor, async_op=True).get_future()
        log.finish_when_done(record, future)
        return future.then(lambda fut: fut.value()[0])

    return hook


def time_fsdp(model, log: CollectiveLog) -> bool:
    """Replace every FSDP2 module's all-gather and reduce-scatter with timed ones;
    False where this torch has no such hooks (then FSDP runs untimed)."""
    try:
        # FSDP2's private collectives: where this torch has them (else FSDP runs untimed)
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return False

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            record = log.start("all_gather", output_tensor.numel() * output_tensor.element_size())
            work = super().__call__(output_tensor, input_tensor, group, async_op)
            log.finish_when_done(record, work)
            return work

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            record = log.start("reduce_scatter",
                               input_tensor.numel() * input_tensor.element_size())
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            log.finish_when_done(record, work)
            return work

    timed = False
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(TimedAllGather())
            module.set_custom_reduce_scatter(TimedReduceScatter())
            timed = True
    return timed


class DeepSpeedSampler:
    """ZeRO: DeepSpeed's comms logger switched on for one step in `SAMPLE_EVERY`."""

    def __init__(self, every: int = SAMPLE_EVERY) -> None:
        self.every = every

    def wants(self, step: int) -> bool:
        return step == 2 or (step > 2 and step % self.every == 0)

    def begin(self) -> None:
        import deepspeed.comm as ds_comm  # a ZeRO job's: only it imports deepspeed

        ds_comm.comms_logger.comms_dict.clear()
        ds_comm.configure(enabled=True, prof_all=True, verbose=False)

    def end(self) -> Window:
        import deepspeed.comm as ds_comm  # a ZeRO job's: only it imports deepspeed

        ds_comm.configure(enabled=False)
        window = Window()
        for name, sizes in ds_comm.comms_logger.comms_dict.items():
            op = next((o for o in OPS if name.startswith(o)), None)
            if op is None:
                continue
            totals = window.totals.setdefault(op, Totals())
            for size, (count, latencies_ms, _algbw, _busbw) in sizes.items():
                totals.calls += count
                # DeepSpeed logs an all-gather by one rank's share (its input tensor)
                totals.bytes += size * count * (_world() if op == "all_gather" else 1)
                totals.seconds += sum(latencies_ms) / 1000.0
        # overlap_comm is off in our ZeRO config: every collective is waited for
        window.exposed_seconds = sum(t.seconds for t in window.totals.values())
        ds_comm.comms_logger.comms_dict.clear()
        return window


def _world() -> int:
    return dist.get_world_size()


def merge(windows: list[Window]) -> Window:
    merged = Window()
    for window in windows:
        for op, t in window.totals.items():
            m = merged.totals.setdefault(op, Totals())
            m.calls += t.calls
            m.bytes += t.bytes
            m.seconds += t.seconds
        merged.exposed_seconds += window.exposed_seconds
    return merged

