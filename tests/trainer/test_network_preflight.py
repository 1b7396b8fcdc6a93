"""The collective preflight: nccl-tests' bus bandwidth, slow nodes by name, the floor, the
InfiniBand check, and a real sweep over two "nodes" of two processes each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune_trainer.collectives import bus_bandwidth
from finetune_trainer.network_preflight import (
    GB,
    PreflightError,
    PreflightResult,
    check_floor,
    check_transport,
    flight_recorder_env,
    nccl_transport,
    slow_nodes,
)
from tests.support import waits
from tests.trainer.test_training import finetune_run, manifest


def test_bus_bandwidth_follows_nccl_tests():
    # nccl-tests: all-reduce busbw = algbw * 2(n-1)/n; all-gather / reduce-scatter (n-1)/n
    assert bus_bandwidth("all_reduce", 1e9, 1.0, 8) == pytest.approx(1.75e9)
    assert bus_bandwidth("all_gather", 1e9, 0.5, 4) == pytest.approx(1.5e9)
    assert bus_bandwidth("reduce_scatter", 1e9, 1.0, 2) == pytest.approx(0.5e9)
    assert bus_bandwidth("all_reduce", 1e9, 1.0, 1) == 0  # nothing crosses a bus


def test_a_node_under_four_fifths_of_the_median_is_named():
    figures = {"aks-gpu-0": 180e9, "aks-gpu-1": 176e9, "aks-gpu-2": 90e9, "aks-gpu-3": 182e9}
    assert slow_nodes(figures) == ["aks-gpu-2"]
    assert slow_nodes({"aks-gpu-0": 180e9, "aks-gpu-1": 150e9}) == []  # 150 > 0.8 * 165
    assert slow_nodes({"only": 1.0}) == []  # nothing to compare with


def test_the_floor_fails_naming_the_figure_the_field_and_the_slowest_node():
    result = PreflightResult(world=16, sweep=[(2**28, 40 * GB)],
                             network={"aks-gpu-0": 45 * GB, "aks-gpu-1": 12 * GB})
    with pytest.raises(PreflightError) as error:
        check_floor(result, 100)
    message = str(error.value)
    assert "40.00 GB/s" in message and "spec.preflight.minBusBandwidthGBps 100" in message
    assert "aks-gpu-1 at 12.00 GB/s" in message
    check_floor(result, 30)  # above the floor: nothing happens
    check_floor(result, None)


@pytest.mark.parametrize(("log", "transport"), [
    ("NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.4<0>\n"
     "NCCL INFO Using network IB", "IB"),
    ("NCCL INFO NET/IB : No device found.\nNCCL INFO NET/Socket : Using [0]eth0:10.0.0.4<0>\n"
     "NCCL INFO Using network Socket", "Socket"),
    ("NCCL INFO Channel 00/32 : 0 1 2 3 4 5 6 7\nNCCL INFO Connected all rings", None),
])
def test_the_transport_nccl_chose_is_read_from_its_log(log, transport):
    assert nccl_transport(log) == transport


def test_infiniband_asked_for_but_sockets_used_fails_with_the_fix():
    result = PreflightResult(world=16, sweep=[], transport="Socket")
    with pytest.raises(PreflightError, match="infiniband is true but NCCL chose the Socket"):
        check_transport(result, require_infiniband=True, nodes=2)
    check_transport(result, require_infiniband=False, nodes=2)
    check_transport(result, require_infiniband=True, nodes=1)  # one node: no network used
    check_transport(PreflightResult(world=16, sweep=[], transport="IB"), True, 2)


def test_the_flight_recorder_dumps_into_the_output_folder(tmp_path):
    env = flight_recorder_env(tmp_path)
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/nccl-flight-recorder/rank_"
    assert int(env["TORCH_FR_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


SWEEP = """
import json, sys, torch, torch.distributed as dist
from finetune_trainer.network_preflight import measure
dist.init_process_group("gloo")
result = measure(torch.device("cpu"), sizes=(2**14, 2**16), iterations=3)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(result.record()))
dist.destroy_process_group()
"""


@pytest.mark.process
def test_two_nodes_of_two_ranks_are_measured_inside_and_between(tmp_path):
    """Two torchrun agents on this machine are two nodes (NODE_NAME differs), as two pods are."""
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP)
    port = str(29400 + os.getpid() % 500)
    agents = []
    for node_rank, name in enumerate(("node-a", "node-b")):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   "--nproc-per-node=2", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
                   f"--master-port={port}", str(script)]
        agents.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env={**os.environ, "NODE_NAME": name}))
    outputs = [agent.communicate(timeout=waits.seconds_left())[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), outputs
    line = next(ln for ln in outputs[0].splitlines() if ln.startswith("RESULT "))
    record = json.loads(line.removeprefix("RESULT "))
    assert record["busBandwidthGBps"] > 0
    assert set(record["nodes"]) == {"node-a", "node-b"} and all(record["nodes"].values())
    assert isinstance(record["slowNodes"], list)


@pytest.mark.process
def test_a_network_below_the_floor_fails_before_training_and_writes_nothing(
        tiny_model_dir, tmp_path):
    job = manifest(tiny_model_dir, tmp_path / "out", steps=4)
    job["spec"]["preflight"] = {"minBusBandwidthGBps": 10000}
    job["spec"]["runPolicy"] = {"backoffLimit": 0}  # one machine: a restart measures the same
    result = finetune_run(job, tmp_path)
    assert result.returncode != 0
    log = result.stdout + result.stderr
    assert "collective preflight: all-reduce bus bandwidth" in log
    assert "spec.preflight.minBusBandwidthGBps 10000" in log
    assert not (Path(tmp_path / "out") / "checkpoints").exists()
    assert "step 1/" not in log
