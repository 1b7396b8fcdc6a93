"""What the image cannot set up (`errors.setup_failure`, the trainer's exit 5): which errors
count, and the one line quoted for them. The run itself, an op that cannot build in a pod's
trainer container: tests/backends/test_trainer_pod.py; on the real node: tests/e2e."""

from __future__ import annotations

from finetune_trainer.errors import _build_line, setup_failure

# torch.utils.cpp_extension's message when ninja fails (torch 2.13), as a pod without a
# compiler said it, shortened: the first line runs on with the first command ninja ran
NO_COMPILER = (
    "Error building extension 'deepspeed_shm_comm': [1/3] c++ -MMD -MF shm_interface.o.d "
    "-DTORCH_EXTENSION_NAME=deepspeed_shm_comm -fPIC -std=c++20 -O2 -fopenmp -c "
    "/deepspeed/ops/csrc/cpu/comm/shm_interface.cpp -o shm_interface.o \n"
    "FAILED: shm_interface.o \n"
    "c++ -MMD -MF shm_interface.o.d -DTORCH_EXTENSION_NAME=deepspeed_shm_comm -fPIC -std=c++20 "
    "-O2 -fopenmp -c /deepspeed/ops/csrc/cpu/comm/shm_interface.cpp -o shm_interface.o \n"
    "/bin/sh: 1: c++: not found\n"
    "[2/3] c++ -MMD -MF shm.o.d -c /deepspeed/ops/csrc/cpu/comm/shm.cpp -o shm.o \n"
    "FAILED: shm.o \n"
    "c++ -MMD -MF shm.o.d -c /deepspeed/ops/csrc/cpu/comm/shm.cpp -o shm.o \n"
    "/bin/sh: 1: c++: not found\n"
    "ninja: build stopped: subcommand failed.\n")
COMPILE_ERROR = (
    "Error building extension 'pin_memory': [1/2] c++ -MMD -c pin.cpp -o pin.o \n"
    "FAILED: pin.o \nc++ -MMD -c pin.cpp -o pin.o \n"
    "In file included from pin.cpp:3:\n"
    "pin.h:7:10: fatal error: aio.h: No such file or directory\n"
    "compilation terminated.\nninja: build stopped: subcommand failed.\n")


def test_a_failed_build_is_said_by_its_own_error_line_not_a_command_line():
    line = _build_line(RuntimeError(NO_COMPILER))
    assert line.startswith("op 'deepspeed_shm_comm' could not be built in this image: "
                           "/bin/sh: 1: c++: not found (")
    assert "-MMD" not in line and "\n" not in line
    assert "fatal error: aio.h: No such file or directory" in _build_line(
        RuntimeError(COMPILE_ERROR))
    # DeepSpeed's own refusal (no libaio): its first line
    refused = RuntimeError("Unable to JIT load the async_io op due to it not being compatible "
                           "due to hardware/software issue. None")
    assert _build_line(refused) == (f"RuntimeError: {refused} (an op this image cannot build "
                                    "or load)")


def test_an_import_the_image_cannot_do_counts_wherever_it_is_raised():
    try:
        import finetune_no_such_module  # noqa: F401
    except ImportError as error:
        missing = error
    assert setup_failure(missing) == ("ModuleNotFoundError: No module named "
                                      "'finetune_no_such_module' (an import this image cannot "
                                      "do)")
    try:  # raised while handling it, or from it: still the image's
        try:
            raise missing
        except ImportError as error:
            raise RuntimeError("the model's code needs a package") from error
    except RuntimeError as error:
        assert setup_failure(error).startswith("ModuleNotFoundError: No module named")


def test_other_errors_are_not_the_images():
    for error in (RuntimeError("Error building extension 'x': but raised by us"),
                  ValueError("bad"), OSError(28, "No space left on device")):
        try:
            raise error
        except Exception as raised:
            assert setup_failure(raised) is None


def test_finetune_run_restarts_a_setup_failure_once(monkeypatch, tmp_path):
    """`finetune run`'s workers (local.processes.run_trainer): exit 5 is restarted once,
    not backoffLimit times; exit 1 still uses the whole budget."""
    from finetune_operator.local import processes

    for code, attempts in ((5, 2), (1, 4)):
        ran = []
        monkeypatch.setattr(processes, "_run_attempt", lambda *a, c=code, r=ran: r.append(1) or c)
        assert processes.run_trainer(tmp_path / "trainer.yaml", 2, tmp_path / "run.log",
                                     max_restarts=3, on_gpus=False) == code
        assert len(ran) == attempts, code
