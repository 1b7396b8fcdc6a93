"""`finetune run`'s processes: torchrun through the launcher the pods use, the step before
it (an hf:// model's fetch), each in its own session so Ctrl-C becomes a SIGTERM the workers
checkpoint on, and the restarts `runPolicy.backoffLimit` allows. Torch is only ever
started as a child process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from finetune_operator.local.logs import RunLog, start_relays
from finetune_trainer.config import TrainerConfig
from finetune_trainer.exits import EXIT_SETUP, NOT_RESTARTED
from finetune_trainer.exits import STOPPED as EXIT_STOPPED
from finetune_trainer.fetch import hub_repo


def trainer_command(config_path: Path, processes: int) -> list[str]:
    """torchrun on this machine, through the launcher the pods use
    (finetune_trainer.launch): it ends with the failed worker's own exit code where that
    names the cause, and one line saying which rank failed and why. No torchrun restarts:
    `run_trainer` decides those, and skips the failures no restart can help."""
    return [sys.executable, "-m", "finetune_trainer.launch", "--standalone",
            f"--nproc-per-node={processes}", "-m", "finetune_trainer",
            "--config", str(config_path)]


def fetch_command(config_path: Path) -> list[str]:
    """The pods' fetch-model step, here: the copy goes into the local output folder, so a
    second run (or a resumed one) downloads nothing."""
    return [sys.executable, "-m", "finetune_trainer", "--config", str(config_path),
            "--fetch-model"]


def needs_fetch(config: TrainerConfig) -> bool:
    """hf:// models are fetched into the output folder before any worker starts."""
    return hub_repo(config.model) is not None


def run_step(command: list[str], log_path: Path, verbose: bool) -> int:
    """A step before the workers start (the model's fetch), run as an attempt of the
    workers is (`_run_attempt`): its lines filtered unless `verbose` (a download draws
    progress bars) and kept in `log_path`; Ctrl-C or SIGTERM ends it (EXIT_STOPPED), in
    its own session, so that the terminal's SIGINT does not reach it as a
    KeyboardInterrupt and its traceback."""
    return _run_attempt(command, worker_env(1, verbose), log_path, None, verbose)


def worker_env(processes: int, verbose: bool, on_gpus: bool = True) -> dict[str, str]:
    """The environment of torchrun and the workers: after Ctrl-C, SHUTDOWN_TIMEOUT_SECONDS
    to checkpoint. Not `on_gpus` (a job of CPU workers): no GPU is visible to them,
    or each would take the GPU of its local rank (the trainer uses any it sees), which a
    machine with fewer GPUs than workers does not have. Without `verbose`: the cores shared
    out between the workers (what torchrun's banner asks for) and library FutureWarnings
    off, unless set already."""
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT_SECONDS)}
    if not on_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if loopback := loopback_interface():  # the workers' collectives on this machine only
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    if not verbose:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
        env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
        env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def loopback_interface() -> str | None:
    """This machine's loopback interface (`lo` on Linux, `lo0` on macOS): gloo's and NCCL's
    sockets between the workers of one machine bind there, not to the address the host
    name resolves to, which the network reaches."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), None)


SHUTDOWN_TIMEOUT_SECONDS = 120
"""How long the workers have after Ctrl-C to finish their step and checkpoint before
torchrun kills them (its default is 30 s, less than a large model's checkpoint takes)."""


def run_trainer(config_path: Path, processes: int, log_path: Path, max_restarts: int = 0,
                verbose: bool = True, lock: int | None = None, on_gpus: bool = True) -> int:
    """The workers, started again from the newest complete checkpoint after a failure (an
    exception, an OOM kill, `kill -9`), up to `max_restarts` times (the job's
    runPolicy.backoffLimit), except for the failures in NOT_RESTARTED, and once at most
    for what the image cannot set up (EXIT_SETUP: the same on every attempt); each rank's
    finetune_restarts metric counts the attempts (FINETUNE_RESTARTS). Ctrl-C or SIGTERM
    ends it (EXIT_STOPPED) and is never restarted. Every line goes to `log_path` (RunLog);
    without `verbose`, the terminal gets them through `QuietLog`. `lock`: the output
    folder's (`lock.hold`), held by the workers too. `on_gpus`: False for a job of CPU
    workers (`worker_env`)."""
    restarts = 0
    while True:
        env = {**worker_env(processes, verbose, on_gpus), "FINETUNE_RESTARTS": str(restarts)}
        code = _run_attempt(trainer_command(config_path, processes), env, log_path, lock,
                            verbose)
        if code in (0, EXIT_STOPPED, *NOT_RESTARTED) or restarts == max_restarts or (
                code == EXIT_SETUP and restarts):
            return code
        restarts += 1
        line = (f"finetune run: a worker failed (exit {code}); restarting every worker from "
                f"the newest complete checkpoint: restart {restarts} of at most "
                f"{max_restarts} (spec.runPolicy.backoffLimit)\n")
        sys.stderr.write(line)
        with contextlib.closing(RunLog(log_path)) as keep:
            keep.write(line)


def _run_attempt(command: list[str], env: dict[str, str], log_path: Path,
                 lock: int | None, verbose: bool) -> int:
    """One torchrun (or `run_step`'s process), in its own session; Ctrl-C or SIGTERM here
    becomes a SIGTERM there, so the workers checkpoint at the next step boundary and exit:
    EXIT_STOPPED."""
    child = subprocess.Popen(command, start_new_session=True, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             errors="replace", pass_fds=() if lock is None else (lock,))
    stopped = False
    keep = RunLog(log_path)
    relays = start_relays(child, keep, None if verbose else lambda: stopped)

    def forward(signum, frame) -> None:
        nonlocal stopped
        stopped = True
        child.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
        for relay in relays:
            relay.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        keep.close()
    return EXIT_STOPPED if stopped else code


def failure_hint(code: int) -> str:
    """What `finetune run` adds to `training failed (exit CODE)`: where the cause was said,
    and why `run_trainer` restarted the workers as often as it did."""
    if code in NOT_RESTARTED:
        return ("the line above names what is wrong and the fix; no restart would change "
                "it, so none was made")
    if code == EXIT_SETUP:
        return ("the line above says what the workers could not set up in this environment "
                "(an import, an op that cannot be built); restarts meet it again, so at most "
                "one was made")
    return "the line above names the rank and the cause; the log above has the rest"
