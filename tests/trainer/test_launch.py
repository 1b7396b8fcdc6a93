"""The launcher's last line and exit code, from what torchrun's agent tells it of a failed
worker (the runs themselves: tests/backends/test_trainer_pod.py, test_faults.py)."""

from __future__ import annotations

from finetune_trainer.launch import exit_code, failure_line


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
