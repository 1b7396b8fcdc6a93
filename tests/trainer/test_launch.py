"""The launcher's last line and exit code, from what torchrun's agent tells it of a failed
worker (the runs themselves: tests/backends/test_trainer_pod.py, test_faults.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from finetune_trainer.launch import exit_code, failure_line
from tests.support import waits


def test_a_refusal_is_said_in_the_workers_own_words_and_keeps_its_code():
    line = failure_line(3, 2, "data.jsonl:2: is not valid JSON — fix that line")
    assert line == "data.jsonl:2: is not valid JSON — fix that line"
    assert exit_code(2) == 2 and exit_code(4) == 4 and exit_code(3) == 3
    # what the image cannot set up (errors.setup_failure): the same on every rank
    unbuildable = "op 'deepspeed_shm_comm' could not be built in this image: /bin/sh: 1: c++: ..."
    assert failure_line(0, 5, unbuildable) == unbuildable and exit_code(5) == 5


def test_a_crash_names_the_rank_and_the_exception():
    # torch's ErrorHandler nests the message beside the traceback
    nested = {"message": "RuntimeError: CUDA error: an illegal memory access",
              "extraInfo": {"py_callstack": "...", "timestamp": "0"}}
    assert failure_line(5, 1, nested) == (
        "rank 5 exited 1: RuntimeError: CUDA error: an illegal memory access")
    assert exit_code(1) == 1 and exit_code(7) == 1 and exit_code(-9) == 1


def test_a_worker_that_said_nothing_points_at_its_log():
    placeholder = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    assert failure_line(0, 1, placeholder) == "rank 0 exited 1 (its log above says why)"
    assert failure_line(0, 2, "") == "rank 0 exited 2 (its log above says why)"


def test_a_killed_worker_names_the_signal_and_the_likely_sender():
    said = failure_line(1, -9, "Signal 9 (SIGKILL) received by PID 42")
    assert said.startswith("rank 1 was ended by SIGKILL (the kernel's out-of-memory killer")
    assert failure_line(1, -6, "") == "rank 1 was ended by SIGABRT"
    assert failure_line(1, -9, "ValueError: bad batch") == (
        "rank 1 was ended by SIGKILL: ValueError: bad batch")


def test_a_collective_error_is_said_by_its_first_line_not_its_last_frame():
    """Seen on the real node: rank 0's gloo error, after its peer was killed, runs on for
    frames, and the status quoted the last one (`collectives.py(140): <lambda>`)."""
    message = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
               "[10.244.1.5]:37121\nException raised from recvHook at pair.cc:534 (most recent "
               "call first):\nframe #0: c10::Error::Error() + 0x98\n"
               "  /usr/local/lib/python3.11/dist-packages/finetune_trainer/collectives.py(140)"
               ": <lambda>")
    assert failure_line(0, 1, message) == (
        "rank 0 exited 1: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
        "closed by peer [10.244.1.5]:37121")


def test_a_ranks_own_failure_is_named_before_the_peer_that_lost_it(tmp_path):
    """torch's `get_first_failure` takes the earliest error file by the second: rank 0's lost
    connection, written in the same second as rank 1's kill (or before the agent saw the
    kill), would be named. The killed rank's own failure is."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from finetune_trainer.launch import first_cause

    def failure(rank: int, exitcode: int, message: str, timestamp: int) -> ProcessFailure:
        error_file = tmp_path / f"error-{rank}.json"
        error_file.write_text(json.dumps({"message": message, "timestamp": timestamp}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                              error_file=str(error_file))

    lost = ("RuntimeError: [pair.cc:534] Connection closed by peer [10.0.0.7]:1234\n"
            "This is typically caused by a remote worker crashing")
    killed = failure(1, -9, "torch.OutOfMemoryError: CUDA out of memory", 1000)
    for rank0_at in (999, 1000, 1001):  # before, in the same second as, after the kill
        failures = {0: failure(0, 1, lost, rank0_at), 1: killed}
        assert first_cause(failures) == 1, rank0_at
    # two ranks that failed on their own account, or both on a lost peer: the earliest
    failures = {0: failure(0, 1, "ValueError: bad batch", 1001), 1: killed}
    assert first_cause(failures) == 1
    failures = {0: failure(0, 1, lost, 1002), 1: failure(1, 1, lost, 1001)}
    assert first_cause(failures) == 1
    # a rank that waited for another's build of an op and found no library: the build's line
    built = failure(0, 5, "op 'deepspeed_shm_comm' could not be built in this image: "
                    "/bin/sh: 1: c++-missing: not found", 1001)
    waited = failure(1, 5, "ImportError: /ops/deepspeed_shm_comm/deepspeed_shm_comm.so: "
                     "cannot open shared object file: No such file or directory (an op this "
                     "image cannot build or load)", 1000)
    assert first_cause({0: built, 1: waited}) == 0
    # rank 1 refused the data first; torchrun then ended rank 0, which had written the same
    # refusal in the same second: rank 1's exit (2) is the one that names the cause
    data = "chats.jsonl:2: is not valid JSON (Expecting value, column 15) — fix that line"
    refused, ended = failure(1, 2, data, 1000), failure(0, -15, data, 1000)
    assert first_cause({1: refused, 0: ended}) == 1
    assert first_cause({0: ended, 1: refused}) == 1


BATON_USER = '''
import os
from pathlib import Path

from torch.utils.file_baton import FileBaton

# what torch's JIT build does on every load of an op, built or not (cpp_extension._jit_compile)
baton = FileBaton(str(Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm" / "lock"))
if baton.try_acquire():
    baton.release()
    print("op loaded")
else:
    baton.wait()
'''


def test_a_lock_no_process_holds_is_a_leftover_one_held_open_is_not(tmp_path):
    from finetune_trainer.launch import stale_build_locks

    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # a build compiling now
    try:
        assert stale_build_locks(tmp_path) == []
    finally:
        os.close(fd)  # killed midway: the file stays, nobody holds it
    assert stale_build_locks(tmp_path) == [lock.resolve()]


@pytest.mark.process
def test_a_build_lock_left_by_a_killed_build_no_longer_hangs_the_next_run(tmp_path):
    """A build of an op killed midway leaves its lock file, and torch's next load of the op
    waited on it forever, saying nothing (a run of ZeRO on CPU workers never started). The
    launcher removes a lock no process holds, says so, and the worker goes on."""
    extensions = tmp_path / "torch_extensions"
    (extensions / "deepspeed_shm_comm").mkdir(parents=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()  # the killed build's
    worker = tmp_path / "worker.py"
    worker.write_text(BATON_USER)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "finetune_trainer.launch", "--standalone",
                             "--nproc-per-node=1", str(worker)], capture_output=True,
                            text=True, env=env, timeout=min(120, waits.seconds_left()))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "op loaded" in result.stdout
    assert re.search(r"finetune-train: removed .*deepspeed_shm_comm/lock, left by a build of "
                     r"the op that was stopped midway", result.stderr), result.stderr[-3000:]
