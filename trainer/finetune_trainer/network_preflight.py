"""Before step 0: is the network any good? An all-reduce bandwidth sweep across all ranks.

Figures are nccl-tests' bus bandwidth (algorithm bandwidth x 2(n-1)/n for all-reduce),
so they compare with the published numbers for a GPU and fabric. Then each node on its
own: its ranks together (NVLink / PCIe inside the node) and, for several nodes, pairs of
nodes (the node's network card). A node under 0.8x the median of its peers is named; a
`minBusBandwidthGBps` floor fails the job here, before minutes of loading are wasted.

Also: with `infiniband: true`, NCCL must have chosen the IB transport rather than
falling back to TCP sockets, and PyTorch's NCCL flight recorder is switched on so a hang
leaves a trace of every rank's last collectives.
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from finetune_trainer.collectives import bus_bandwidth

SLOW_RATIO = 0.8
GPU_SIZES = tuple(2**p for p in range(23, 29))  # 8 MiB .. 256 MiB, doubling
CPU_SIZES = tuple(2**p for p in range(16, 22))  # 64 KiB .. 2 MiB (gloo is slow)
FLIGHT_RECORDER_DIR = "nccl-flight-recorder"
GB = 1e9


class PreflightError(RuntimeError):
    """The network is below what the job asked for; the message says where and what to do."""


@dataclass
class PreflightResult:
    world: int
    sweep: list[tuple[int, float]]
    """(bytes, bus bandwidth in bytes/s), every rank together."""
    local: dict[str, float] = field(default_factory=dict)
    """node → bus bandwidth among that node's ranks."""
    network: dict[str, float] = field(default_factory=dict)
    """node → bus bandwidth of the node paired with another (the worse of its pairs)."""
    slow_nodes: list[str] = field(default_factory=list)
    transport: str | None = None
    flight_recorder: str | None = None

    @property
    def bus_bandwidth(self) -> float:
        """The headline: bus bandwidth at the largest size."""
        return self.sweep[-1][1] if self.sweep else 0.0

    def node_bandwidth(self) -> dict[str, float]:
        """One figure per node: the network pairing where there is one, else local."""
        return {**self.local, **self.network}

    def record(self) -> dict:
        """What rank 0 publishes in progress.json (and the operator puts in a condition)."""
        return {"busBandwidthGBps": round(self.bus_bandwidth / GB, 3),
                "nodes": {n: round(v / GB, 3) for n, v in self.node_bandwidth().items()},
                "slowNodes": list(self.slow_nodes), "transport": self.transport,
                "flightRecorder": self.flight_recorder}

    def table(self) -> str:
        lines = [f"all-reduce preflight over {self.world} ranks (bus bandwidth, nccl-tests "
                 "convention)", f"  {'size':>10}  {'busbw GB/s':>10}"]
        lines += [f"  {_size(size):>10}  {bw / GB:>10.3f}" for size, bw in self.sweep]
        for kind, figures in (("inside the node", self.local), ("node pairs", self.network)):
            if figures:
                lines.append(f"  per node, {kind}:")
                lines += [f"    {node:<30} {bw / GB:>8.3f} GB/s"
                          + ("   << slow" if node in self.slow_nodes else "")
                          for node, bw in figures.items()]
        if self.transport:
            lines.append(f"  NCCL network transport: {self.transport}")
        if self.flight_recorder:
            lines.append(f"  NCCL flight recorder: a hung collective dumps every rank's last "
                         f"collectives to {self.flight_recorder}/rank_<N>")
        return "\n".join(lines)


def _size(size: int) -> str:
    return f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size / 2**10:g} KiB"


def slow_nodes(figures: dict[str, float], ratio: float = SLOW_RATIO) -> list[str]:
    """Nodes below `ratio` x the median of all nodes (needs at least two to compare)."""
    if len(figures) < 2:
        return []
    median = statistics.median(figures.values())
    return [node for node, value in figures.items() if value < ratio * median]


def check_floor(result: PreflightResult, floor_gbps: float | None) -> None:
    if floor_gbps is None or result.bus_bandwidth / GB >= floor_gbps:
        return
    worst = min(result.node_bandwidth().items(), key=lambda kv: kv[1], default=None)
    where = f"; slowest node {worst[0]} at {worst[1] / GB:.2f} GB/s" if worst else ""
    raise PreflightError(
        f"all-reduce bus bandwidth {result.bus_bandwidth / GB:.2f} GB/s is below "
        f"spec.preflight.minBusBandwidthGBps {floor_gbps:g}{where}. Check the node's network "
        "(InfiniBand device plugin, NCCL_IB_HCA, a degraded link) or lower the floor")


def nccl_transport(log_text: str) -> str | None:
    """The network transport NCCL chose, from its INFO log: 'IB', 'Socket', or None when
    it used no network (a single node)."""
    chosen = re.findall(r"Using network (\w+)", log_text)
    if chosen:
        return chosen[-1]
    if "NET/IB" in log_text:
        return "IB"
    if "NET/Socket" in log_text:
        return "Socket"
    return None


def nccl_debug_env(scratch: Path) -> dict[str, str]:
    """Environment that makes NCCL log its transport choice into files we read back."""
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
            "NCCL_DEBUG_FILE": str(scratch / "nccl.%h.%p.log")}


def flight_recorder_env(output_dir: Path) -> dict[str, str]:
    """PyTorch's NCCL flight recorder: a ring of each rank's last collectives, dumped to
    `<output>/nccl-flight-recorder/rank_<N>` when a collective times out."""
    prefix = str(output_dir / FLIGHT_RECORDER_DIR / "rank_")
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


def node_name() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()


# --- measuring (collective: every rank calls these in the same order) -------------------

def _time_all_reduce(size: int, group, device, iterations: int) -> float:
    """Seconds per all-reduce of `size` bytes, the slowest rank's view."""
    tensor = torch.ones(max(size // 4, 1), dtype=torch.float32, device=device)
    for _ in range(2):  # warm-up: connections, NCCL channels
        dist.all_reduce(tensor, group=group)
    _sync(device)
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor, group=group)
    _sync(device)
    seconds = torch.tensor([(time.perf_counter() - started) / iterations], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return float(seconds)


def _sync(device) -> None:
    if device.type == "cuda":

        torch.cuda.synchronize(device)


def _groups(members: list[list[int]]):
    """Every rank creates every group (torch's rule); returns the one this rank is in."""
    mine = None
    for ranks in members:
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def measure(device, sizes: tuple[int, ...] | None = None,
            iterations: int | None = None) -> PreflightResult:

    world, rank = dist.get_world_size(), dist.get_rank()
    gpu = device.type == "cuda"
    sizes = sizes or (GPU_SIZES if gpu else CPU_SIZES)
    iterations = iterations or (20 if gpu else 5)
    names: list[str] = [""] * world
    dist.all_gather_object(names, node_name())
    nodes = list(dict.fromkeys(names))
    ranks_of = {node: [r for r, n in enumerate(names) if n == node] for node in nodes}

    result = PreflightResult(world=world, sweep=[])
    for size in sizes:
        seconds = _time_all_reduce(size, None, device, iterations)
        result.sweep.append((size, bus_bandwidth("all_reduce", size, seconds, world)))
    largest = sizes[-1]

    # inside each node, all nodes at once
    multi = [ranks_of[n] for n in nodes if len(ranks_of[n]) > 1]
    if multi:
        group = _groups(multi)
        figure = 0.0
        if group is not None:
            size_group = len(ranks_of[names[rank]])
            figure = bus_bandwidth("all_reduce", largest,
                                   _time_all_reduce(largest, group, device, iterations),
                                   size_group)
        figures: list[float] = [0.0] * world
        dist.all_gather_object(figures, figure)
        result.local = {n: figures[ranks_of[n][0]] for n in nodes if len(ranks_of[n]) > 1}

    # node pairs, two rounds so every node meets two neighbours (one pair each round)
    if len(nodes) >= 2:
        leaders = [ranks_of[n][0] for n in nodes]
        pairings = [[(i, i + 1) for i in range(0, len(nodes) - 1, 2)]]
        if len(nodes) > 2:
            pairings.append([(i, (i + 1) % len(nodes)) for i in range(1, len(nodes), 2)
                             if (i + 1) % len(nodes) != i])
        network: dict[str, float] = {}
        for pairs in pairings:
            group = _groups([[leaders[a], leaders[b]] for a, b in pairs])
            figure = 0.0
            if group is not None:
                figure = bus_bandwidth("all_reduce", largest,
                                       _time_all_reduce(largest, group, device, iterations), 2)
            figures = [0.0] * world
            dist.all_gather_object(figures, figure)
            for a, b in pairs:
                for node in (nodes[a], nodes[b]):
                    seen = figures[leaders[a]]
                    network[node] = min(network.get(node, seen), seen)
        result.network = network

    result.slow_nodes = sorted(set(slow_nodes(result.local)) | set(slow_nodes(result.network)))
    return result


def read_transport(scratch: Path) -> str | None:
    texts = [p.read_text(errors="replace") for p in sorted(scratch.glob("nccl.*.log"))]
    return nccl_transport("\n".join(texts))


def check_transport(result: PreflightResult, require_infiniband: bool, nodes: int) -> None:
    if not require_infiniband or nodes < 2 or result.transport in (None, "IB"):
        return
    raise PreflightError(
        f"spec.kubernetes.infiniband is true but NCCL chose the {result.transport} transport "
        "(TCP) between nodes. Check that the RDMA device plugin gives the pods an IB device "
        "and that NCCL_IB_HCA matches it, or set infiniband: false")
