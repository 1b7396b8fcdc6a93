"""`finetune run`: the same FineTuneJob on this machine, under torchrun, no cluster.

Pure parts (locations, the command line) are separate from the process handling so they
are tested directly; torch is only ever started as a child process.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from finetune_operator import gpu_catalog as catalog
from finetune_operator import yamlio
from finetune_operator.api import FineTuneJob
from finetune_operator.follow import read_progress
from finetune_operator.planner import (
    ModelConfig,
    ModelConfigs,
    StepSettings,
    VmSize,
    fetch_from_hub,
)
from finetune_operator.planner.plan import gib
from finetune_operator.planner.report import plan_with_notes
from finetune_operator.trainer_config import (
    Mount,
    trainer_config_and_step_settings,
    unreachable_locations,
)
from finetune_operator.validation import InvalidJobError, setting_errors
from finetune_trainer.config import TrainerConfig
from finetune_trainer.exits import EXIT_SETUP, NOT_RESTARTED
from finetune_trainer.exits import STOPPED as EXIT_STOPPED
from finetune_trainer.fetch import complete_copy, hub_repo
from finetune_trainer.layout import (
    CHECKPOINTS,
    FINAL_DIR,
    HISTORY_FILE,
    LOCAL_CONFIG,
    MERGED_DIR,
    PROGRESS_FILE,
    REFERENCE_FILE,
    TENSORBOARD_DIR,
    latest_checkpoint,
    step_of,
)
from finetune_trainer.uris import Location, Unreachable

START_OVER = ("point spec.output.uri at a new folder, or start over with `finetune run "
              "--fresh` (the earlier run's checkpoints and model are moved aside, not "
              "deleted)")


EARLIER_RUN = (CHECKPOINTS, FINAL_DIR, MERGED_DIR, TENSORBOARD_DIR, PROGRESS_FILE, HISTORY_FILE,
               REFERENCE_FILE)
"""What `--fresh` moves aside: the earlier run's checkpoints, exports, history and DPO
reference (the model cache, the logs and the lock stay: a fresh run reuses or appends to
them)."""


def set_earlier_run_aside(output_dir: Path) -> tuple[Path, list[str]] | None:
    """`finetune run --fresh`: the earlier run's outputs (EARLIER_RUN), renamed into
    `before-<time>/` in the output folder (renames on one filesystem: nothing is deleted or
    copied, and the new run's export cannot overwrite the old one); with the names moved.
    None when there is nothing to move."""
    found = [name for name in EARLIER_RUN if (output_dir / name).exists()]
    if not found:
        return None
    aside = output_dir / f"before-{time.strftime('%Y%m%dT%H%M%S')}"
    aside.mkdir()
    for name in found:
        (output_dir / name).rename(aside / name)
    return aside, found


def model_config(job: FineTuneJob, base_dir: Path) -> ModelConfig | None:
    """The model's config.json, for the planner: the folder itself, the copy an earlier run
    fetched into the output folder (no request at all), or only that file from the hub (the
    run fetches the model next anyway)."""
    configs = ModelConfigs(fetch=fetch_from_hub, base_dir=base_dir)
    if (copy := fetched_copy(job, base_dir)) is not None:
        return configs.resolve(str(copy))
    return configs.resolve(job.spec.model.uri, job.spec.model.revision)


def fetched_copy(job: FineTuneJob, base_dir: Path) -> Path | None:
    """The complete copy of an hf:// model in the job's local output folder, if one is
    there (`finetune_trainer.fetch`)."""
    output = job.spec.output.location
    if output.scheme not in ("path", "relative"):
        return None  # refused by local_config
    return complete_copy((base_dir / output.raw).resolve(), job.spec.model)


def needs_fetch(config: TrainerConfig) -> bool:
    """hf:// models are fetched into the output folder before any worker starts."""
    return hub_repo(config.model) is not None


def plan_warnings(job: FineTuneJob, model: ModelConfig | None,
                  machine: VmSize | None = None) -> list[str]:
    """The plan's warnings (a maxSeqLength beyond the model's context), and what the
    operator's Feasible=False would say; here it only warns: on this machine's GPUs
    (`machine`, by their free memory) the estimate may be off by its ±15%; without them
    (`job`: the spec) it is what the operator would say of the spec's gpuType, which this
    machine may not have."""
    plan = plan_with_notes(job, model, machine)
    warnings = [f"warning: {warning}" for warning in plan.warnings]
    if plan.fits is not False or job.spec.resources.skip_feasibility_check:
        return warnings
    if machine is not None:
        return [*warnings, f"warning: predicted not to fit this machine's GPUs — "
                f"{plan.reason} (an estimate, ±15%: the run starts anyway)"]
    return [*warnings, f"warning: spec.resources.gpuType: predicted not to fit — "
            f"{plan.reason} (`finetune plan` shows the breakdown; the operator would not "
            "launch this job)"]


def local_config(job: FineTuneJob, base_dir: Path, model: ModelConfig | None = None,
                 machine: VmSize | None = None, manifest: str | None = None
                 ) -> tuple[TrainerConfig, StepSettings]:
    """The trainer config with every location usable here (relative paths resolved), and
    the step settings it holds with why unset checkpointing and compile became what they
    are (`notes`); `model` (its config.json) lets `strategy: auto` go through the planner,
    which sizes the step for `machine` (this machine's GPUs) where given. `manifest`: the
    file the job came from, which its checkpoints name as the job that wrote them."""
    mount = local_mount(base_dir)
    if problems := unreachable_locations(job, mount):
        raise InvalidJobError(problems)
    config, settings = trainer_config_and_step_settings(job, mount, model, machine)
    if manifest is not None:
        config = config.model_copy(update={
            "job": config.job.model_copy(update={"manifest": manifest})})
    return config, settings


def local_mount(base_dir: Path) -> Mount:
    """Where `finetune run` opens a location: relative paths from the manifest's folder,
    absolute paths and the hub as they are; claims and Azure ML exist only on a cluster."""

    def mount(location: Location) -> str:
        if location.scheme == "relative":
            return str((base_dir / location.raw).resolve())
        if location.scheme in ("pvc", "azureml"):
            raise Unreachable(f"{location.scheme}:// locations exist only on the cluster",
                              "use a local path (absolute or ./relative) with `finetune run`")
        return location.raw

    return mount


def default_processes(job: FineTuneJob, gpus: int) -> int:
    """Processes on this machine: the spec's CPU workers, or the `gpus` that are visible."""
    resources = job.spec.resources
    if not resources.on_gpus:
        return resources.nodes * resources.processes()
    return max(1, min(gpus, resources.nodes * resources.gpus_per_node))


class MachineMismatch(ValueError):
    """The spec's global batch cannot be kept on this machine's processes."""


def fit_to_machine(job: FineTuneJob, processes: int, gpus: int) -> tuple[int, list[str]]:
    """The gradient accumulation that keeps the spec's global batch on `processes` local
    workers, and one line for each way this run differs from the spec (CPU instead of the
    GPUs it asks for, fewer or more workers). Raises MachineMismatch when the global batch
    does not divide."""
    spec, resources = job.spec, job.spec.resources
    hp = spec.hyperparameters
    world = resources.nodes * resources.processes()
    if resources.on_gpus and processes > gpus > 0:  # a worker each; the rest would fail
        raise MachineMismatch(
            f"--nproc {processes}: this machine shows {gpus} GPU{'s' if gpus > 1 else ''} "
            f"(CUDA_VISIBLE_DEVICES, else nvidia-smi) and each GPU worker needs one of its "
            f"own — pass --nproc {gpus} or fewer (more gradientAccumulationSteps keep the "
            "global batch)")
    notes = []
    if resources.on_gpus and gpus == 0:
        if refused := on_cpus_refused(job, processes):
            raise MachineMismatch(
                f"{refused} — no GPU is visible here (CUDA_VISIBLE_DEVICES, else nvidia-smi), so "
                "`finetune run` would train on CPU processes: run it where one is")
        notes.append(f"no GPU is visible here: training on {processes} CPU process"
                     f"{'es' if processes > 1 else ''} instead of the {world} GPU"
                     f"{'s' if world > 1 else ''} the spec asks for (slow; fine for a check)")
    if processes == world:
        return hp.gradient_accumulation_steps, notes
    global_batch = world * hp.batch_size_per_device * hp.gradient_accumulation_steps
    per_step = processes * hp.batch_size_per_device
    if global_batch % per_step:
        raise MachineMismatch(
            f"spec.hyperparameters: the spec's global batch of {global_batch} sequences "
            f"({world} worker{'s' if world > 1 else ''} x batchSizePerDevice "
            f"{hp.batch_size_per_device} x "
            f"gradientAccumulationSteps {hp.gradient_accumulation_steps}) cannot be kept on "
            f"{processes} local process{'es' if processes > 1 else ''} — pass --nproc with a "
            f"divisor of {global_batch // hp.batch_size_per_device}, or change "
            "batchSizePerDevice")
    accumulation = global_batch // per_step
    notes.append(f"{processes} local process{'es' if processes > 1 else ''} instead of the "
                 f"spec's {world}: gradientAccumulationSteps {accumulation} keeps the global "
                 f"batch of {global_batch} sequences")
    return accumulation, notes


def on_cpus_refused(job: FineTuneJob, processes: int) -> str | None:
    """Why a GPU job cannot train on `processes` CPU workers (QLoRA's 4-bit kernels,
    DeepSpeed's fp16): the rules a manifest of CPU workers meets, asked of this one, so the
    trainer is not started to refuse it once per restart."""
    on_cpus = job.spec.resources.model_copy(update={
        "nodes": 1, "gpus_per_node": 0, "processes_per_node": processes})
    problems = setting_errors(job.model_copy(update={
        "spec": job.spec.model_copy(update={"resources": on_cpus})}))
    return "; ".join(f"{p.path}: {p.message}" for p in problems) or None


def as_run_here(job: FineTuneJob, processes: int, accumulation: int) -> FineTuneJob:
    """The job this machine runs: one node of `processes` workers (GPU workers where the
    spec asks for GPUs, planned as such even when none is visible), `fit_to_machine`'s
    accumulation, and a set microBatchSize the largest that still divides the step and is
    no larger than the spec's. What is planned, written to the trainer config and compared
    with the checkpoints' settings, so a run resumes on the machine it ran on."""
    spec = job.spec
    hp, resources = spec.hyperparameters, spec.resources
    here = ({"nodes": 1, "gpus_per_node": processes} if resources.on_gpus else
            {"nodes": 1, "processes_per_node": processes})
    step = {"gradient_accumulation_steps": accumulation}
    if hp.micro_batch_size is not None:
        step["micro_batch_size"] = math.gcd(hp.micro_batch_size,
                                            hp.batch_size_per_device * accumulation)
    return job.model_copy(update={"spec": spec.model_copy(update={
        "resources": resources.model_copy(update=here),
        "hyperparameters": hp.model_copy(update=step)})})


def this_machine(processes: int) -> VmSize | None:
    """The GPUs `processes` workers get here (the first visible ones, as CUDA assigns
    them), as the planner sees a VM size: by what nvidia-smi says is free on them now.
    None when nvidia-smi is missing or cannot say (an old driver without compute_cap)."""
    if shutil.which("nvidia-smi") is None:
        return None
    command = ["nvidia-smi", "--query-gpu=name,memory.total,memory.free,compute_cap",
               "--format=csv,noheader,nounits"]
    if listed := os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        command.append(f"--id={listed}")
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False,
                                timeout=60)
    except subprocess.TimeoutExpired:
        return None
    cards = catalog.cards_from_nvidia_smi(result.stdout)[:processes]
    if result.returncode != 0 or not cards:
        return None
    return catalog.this_machine(cards, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def described(machine: VmSize) -> str:
    """`this_machine` for people: its GPUs and what is free on each."""
    return (f"{machine.gpus} x {machine.gpu.name} ({gib(machine.gpu.memory_bytes)} free on "
            f"{'each' if machine.gpus > 1 else 'it'})")


def visible_gpus() -> int:
    if (listed := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return len([d for d in listed.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in result.stdout.splitlines())


LOOPBACK = "127.0.0.1"


CAN_HOLD = hasattr(socket, "SO_REUSEPORT")
"""Whether `finetune run` can hold its ports for its workers (`PortHold`): Linux, macOS."""


class PortTaken(ValueError):
    """The metrics port asked for (`finetune run --metrics-port`) is held by another process."""


class PortHold:
    """The ports of a run's endpoints, held from the moment `serving_here` names them until
    the run ends (`close`), restarts included: each by a socket bound to it (SO_REUSEPORT,
    never listening), beside which the worker's endpoint listens (`metrics.reusePort`);
    connections go to the listening socket alone. Only found free when named, a port was
    bound when the workers came up (the model fetched, checked and loaded: minutes for a
    large one), and could be taken meanwhile, by another run choosing its ports then or by
    a connection the kernel gave it as its local port: that process's /metrics was then
    never served."""

    def __init__(self, first: int, sockets: list[socket.socket]) -> None:
        self.first, self.sockets = first, sockets

    @property
    def held(self) -> bool:
        """False where the platform has no SO_REUSEPORT: the ports were free when named."""
        return bool(self.sockets)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def serving_here(config: TrainerConfig, processes: int, asked: int | None = None
                 ) -> tuple[TrainerConfig, str, PortHold]:
    """The config with each worker's /metrics and /progress on this machine's loopback only
    (a laptop's run is not served to its network) from port `asked`, else the trainer's
    default, else the first ports after it that nothing holds (a second run beside the
    first keeps its endpoints); the line saying where; and the ports' hold, to keep until
    the run ends. Raises PortTaken when a port asked for is held."""
    first = asked or config.metrics.port
    tried = range(first, first + (1 if asked else 64) * processes, processes)
    with _choosing():
        hold = next((h for port in tried if (h := _hold(port, processes)) is not None), None)
    if hold is None and asked:
        raise PortTaken(f"--metrics-port {asked}: {_ports(asked, processes)} held by another "
                        "process (another run?) — pass another port, or leave the option out "
                        "to take the next free ones")
    if hold is None:
        raise PortTaken(f"no free metrics ports from {first} to {tried[-1] + processes - 1} "
                        "— pass --metrics-port with a free one")
    start = hold.first
    where = (f"metrics: http://{LOOPBACK}:{start}/metrics"
             + (f", one per process: {_ports(start, processes)}" if processes > 1 else "")
             + (f" ({_ports(first, processes)} held by another process)" if start != first
                else ""))
    metrics = config.metrics.model_copy(update={"host": LOOPBACK, "port": start,
                                                "reuse_port": hold.held})
    return config.model_copy(update={"metrics": metrics}), where, hold


def _ports(first: int, count: int) -> str:
    return f"ports {first}-{first + count - 1}" if count > 1 else f"port {first}"


def _hold(first: int, count: int) -> PortHold | None:
    """Ports `first` to `first + count - 1`, held; None when another process holds one."""
    sockets: list[socket.socket] = []
    try:
        for port in range(first, first + count):
            if not _free(port):
                raise OSError(f"port {port} held")
            if CAN_HOLD:
                sockets.append(_held(port))
    except OSError:
        for sock in sockets:
            sock.close()
        return None
    return PortHold(first, sockets)


def _free(port: int) -> bool:
    """Whether a worker's endpoint could listen on `port` (bound as its server binds, less
    SO_REUSEPORT: a port another run holds, or listens on, is not free)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _held(port: int) -> socket.socket:
    """A socket holding `port`, or OSError when it was taken since `_free` looked.
    SO_REUSEPORT alone: no process binds the port but one of this user's with SO_REUSEPORT
    too (a worker's endpoint), a connection's local port is never chosen from a bound one,
    and another run's `_free` finds it held."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((LOOPBACK, port))
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _choosing() -> Iterator[None]:
    """One `finetune run` of this user at a time choosing its ports: two holds of one user
    on one port do not exclude each other (SO_REUSEPORT), so without this two runs could
    both find a port free and both hold it. Unlocked where the lock file cannot be made."""
    path = Path(tempfile.gettempdir()) / f"finetune-metrics-ports-{os.getuid()}.lock"
    try:
        fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def write_config(config: TrainerConfig, output_dir: Path) -> Path:
    path = output_dir / LOCAL_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yamlio.dump(config.to_dict()))
    return path


def trainer_command(config_path: Path, processes: int) -> list[str]:
    """torchrun on this machine, through the launcher the pods use
    (finetune_trainer.launch): it ends with the failed worker's own exit code where that
    names the cause, and one line saying which rank failed and why. No torchrun restarts:
    `run_trainer` decides those, and skips the failures no restart can help."""
    return [sys.executable, "-m", "finetune_trainer.launch", "--standalone",
            f"--nproc-per-node={processes}", "-m", "finetune_trainer",
            "--config", str(config_path)]


def preflight_command(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "finetune_trainer", "--config", str(config_path), "--preflight"]


def fetch_command(config_path: Path) -> list[str]:
    """The pods' fetch-model step, here: the copy goes into the local output folder, so a
    second run (or a resumed one) downloads nothing."""
    return [sys.executable, "-m", "finetune_trainer", "--config", str(config_path),
            "--fetch-model"]


NOISE = re.compile(
    r"^(Loading weights|Generating \w+ split|Writing model shards|Map( \(num_proc=\d+\))?:|"
    r"\*{20,}|Setting OMP_NUM_THREADS environment variable|"
    r"stopped by SIGTERM (after step|before the first step)|"  # said once, by `finetune run`
    r"W\d{4} .*(Received \d+ death signal|closing signal SIGTERM))")
"""Lines of the workers and of torchrun that a plain `finetune run` does not show
(`--verbose` shows everything): progress bars of loading and data preparation,
torchrun's thread banner, and its log of the stop `finetune run` itself asked for."""


_TRACEBACK = "Traceback (most recent call last)"
_CHAINED = ("During handling of the above exception", "The above exception was the direct")


class QuietLog:
    """Filters one output stream of torchrun line by line. Drops `NOISE`, and the traceback
    torchrun's agent prints when `finetune run` forwards Ctrl-C or SIGTERM to it
    (SignalException); every other traceback passes whole."""

    def __init__(self, stopping: Callable[[], bool]) -> None:
        self.stopping = stopping
        self.traceback: list[str] | None = None
        self.held: list[str] = []
        """The signal traceback dropped last: shown after all if an exception chained to
        it is not one (a second Ctrl-C raises one while the agent handles the first)."""
        self.dropped = False
        self.blanks: list[str] = []

    def feed(self, line: str) -> list[str]:
        if self.traceback is not None:
            self.traceback.append(line)
            if line[:1].isspace() or not line.strip() or line.startswith(_TRACEBACK):
                return []
            block, self.traceback = self.traceback, None  # the exception's own line
            if self.stopping() and "SignalException" in line:
                self.held, self.dropped = block, True
                return []
            held, self.held, self.dropped = self.held, [], False
            blanks, self.blanks = self.blanks, []
            if held and block[0].startswith(_CHAINED):
                return [*held, "\n", *block]
            return [*blanks, *block]
        if line.startswith((_TRACEBACK, *_CHAINED)):
            self.traceback = [line]
            return []
        # a progress bar's carriage returns leave empty lines before and behind it
        if not line.strip():
            if not self.dropped:
                self.blanks.append(line)
            return []
        blanks, self.blanks = self.blanks, []
        self.dropped = NOISE.match(line) is not None
        return [] if self.dropped else [*blanks, line]

    def flush(self) -> list[str]:
        block, self.traceback = self.traceback or [], None
        blanks, self.blanks = self.blanks, []
        return blanks + block


class RunLog:
    """Every line torchrun and the workers wrote, filtered or not, in the output folder
    (`logs/run.log`, appended to by each run): what `finetune logs` reads. A volume that
    refuses the log (full, read-only) costs the log, said once, never the run or its
    terminal output."""

    def __init__(self, path: Path):
        self.lock = threading.Lock()
        self.handle: TextIO | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = path.open("a", encoding="utf-8", errors="replace")
        except OSError as error:
            self._give_up(path, error)
        self.path = path

    def begin(self, what: str) -> None:
        """A line that starts a run's part of the log (each run appends to it), closed."""
        self.write(f"=== {what}, {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC ===\n")
        self.close()

    def write(self, line: str) -> None:
        with self.lock:
            if self.handle is None:
                return
            try:
                self.handle.write(line)
                self.handle.flush()
            except OSError as error:
                self._give_up(self.path, error)

    def close(self) -> None:
        with self.lock:
            handle, self.handle = self.handle, None
            if handle is not None:
                with contextlib.suppress(OSError):  # every line was flushed as written
                    handle.close()

    def _give_up(self, path: Path, error: OSError) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()
        sys.stderr.write(f"finetune run: {path} is no longer written ({error.strerror}); "
                         "the terminal keeps every line\n")


def _relay(source: TextIO, target: TextIO, log: QuietLog | None, keep: RunLog) -> None:
    for line in source:
        keep.write(line)
        for kept in (log.feed(line) if log is not None else [line]):
            target.write(kept)
            target.flush()
    for kept in (log.flush() if log is not None else []):
        target.write(kept)
    target.flush()


def _relays(child: subprocess.Popen, keep: RunLog,
            stopping: Callable[[], bool] | None) -> list[threading.Thread]:
    """Threads copying the child's stdout and stderr to ours and to `keep`, through a
    QuietLog each unless `stopping` is None (verbose)."""
    relays = [threading.Thread(target=_relay, args=(
        stream, target, None if stopping is None else QuietLog(stopping), keep), daemon=True)
        for stream, target in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
    for relay in relays:
        relay.start()
    return relays


def run_step(command: list[str], log_path: Path, verbose: bool) -> int:
    """One step before the workers start (the model's fetch, the preflight), run as an
    attempt of the workers is (`_run_attempt`): its lines filtered unless `verbose` (a
    first read of the data draws a progress bar) and kept in `log_path`; Ctrl-C or SIGTERM
    ends it (EXIT_STOPPED), in its own session, so that the terminal's SIGINT does not
    reach it as a KeyboardInterrupt and its traceback."""
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
    folder's (`run_lock.hold`), held by the workers too. `on_gpus`: False for a job of CPU
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
    relays = _relays(child, keep, None if verbose else lambda: stopped)

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


def already_done(output_dir: Path, config: TrainerConfig) -> str | None:
    """The line a run that has nothing left to do ends with: the folder's run succeeded at
    the config's maxSteps and its model is there. (An epochs-long run's total is known only
    once the data is read: it runs again, resuming at its last step.)"""
    max_steps, final = config.hyperparameters.max_steps, output_dir / FINAL_DIR
    record = read_progress(output_dir) if max_steps is not None else None
    if record is None or record.phase != "Succeeded" or record.step != max_steps or (
            not final.is_dir()):
        return None
    return (f"already done: {max_steps}/{max_steps} steps, the model is in {final} — raise "
            "hyperparameters.maxSteps to train on from the last checkpoint, or --fresh to "
            "start over")


def stopped_message(output_dir: Path) -> str:
    """The one line `finetune run` ends with after Ctrl-C or SIGTERM."""
    latest = latest_checkpoint(output_dir)
    if latest is None:
        return "interrupted before the first checkpoint; run the same command to start again"
    return (f"interrupted; checkpoint at step {step_of(latest)} in {latest.parent}; run the "
            "same command to resume")


def failure_hint(code: int) -> str:
    """What `finetune run` adds to `training failed (exit CODE)`: where the cause was said,
    and why `run_trainer` restarted the workers as often as it did."""
    if code in NOT_RESTARTED:
        return "the line above names the setting; no restart would change it, so none was made"
    if code == EXIT_SETUP:
        return ("the line above says what the workers could not set up in this environment "
                "(an import, an op that cannot be built); restarts meet it again, so at most "
                "one was made")
    return "the line above names the rank and the cause; the log above has the rest"
