"""`finetune run`: the same FineTuneJob on this machine, under torchrun, no cluster.

Pure parts (locations, the command line) are separate from the process handling so they
are tested directly; torch is only ever started as a child process.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from finetune_operator.api import FineTuneJob
from finetune_operator.planner import ModelConfig, ModelConfigs, fetch_from_hub
from finetune_operator.planner.render import plan_with_notes
from finetune_operator.trainer_config import build_trainer_config
from finetune_operator.validation import InvalidJobError, Problem
from finetune_trainer.config import TrainerConfig
from finetune_trainer.layout import checkpoint_root
from finetune_trainer.uris import parse_uri

CONFIG_DIR = ".finetune"
EXIT_STOPPED = 143
START_OVER = ("point spec.output.uri at a new folder, or start over with `finetune run "
              "--fresh` (the old checkpoints are moved aside, not deleted)")


def set_checkpoints_aside(output_dir: Path) -> Path | None:
    """`finetune run --fresh`: the output folder's checkpoints, renamed out of the way (a
    rename on the same filesystem: nothing is deleted or copied). None when there are none."""
    root = checkpoint_root(output_dir)
    if not root.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = root.with_name(f"{root.name}.before-{stamp}")
    root.rename(aside)
    return aside


def model_config(job: FineTuneJob, base_dir: Path) -> ModelConfig | None:
    """The model's config.json, for the planner: the folder itself, or only that file from
    the hub (the run downloads the model next anyway)."""
    configs = ModelConfigs(fetch=fetch_from_hub, base_dir=base_dir)
    return configs.resolve(job.spec.model.uri, job.spec.model.revision)


def feasibility_warning(job: FineTuneJob, model: ModelConfig | None) -> str | None:
    """What the operator's Feasible=False would say; here it only warns, since the GPUs
    of this machine may not be the spec's gpuType."""
    plan = plan_with_notes(job, model)
    if plan.fits is not False or job.spec.resources.skip_feasibility_check:
        return None
    return (f"warning: spec.resources.gpuType: predicted not to fit — {plan.reason} "
            "(`finetune plan` shows the breakdown; the operator would not launch this job)")


def local_config(job: FineTuneJob, base_dir: Path,
                 model: ModelConfig | None = None) -> TrainerConfig:
    """The trainer config with every location usable here (relative paths resolved);
    `model` (its config.json) lets `strategy: auto` go through the planner."""
    problems: list[Problem] = []

    def locate(section: str, uri: str, schemes: tuple) -> str:
        scheme = parse_uri(uri, schemes).scheme
        if scheme == "relative":
            return str((base_dir / uri).resolve())
        if scheme in ("pvc", "azureml"):
            problems.append(Problem(f"spec.{section}.uri", f"{scheme}:// locations exist only "
                                    "on the cluster", "use a local path (absolute or "
                                    "./relative) with `finetune run`"))
        return uri

    config = build_trainer_config(job, locate, model)
    if problems:
        raise InvalidJobError(problems)
    return config


def default_processes(job: FineTuneJob) -> int:
    """Processes on this machine: the spec's CPU workers, or the GPUs that are visible."""
    resources = job.spec.resources
    if resources.gpus_per_node == 0:
        return resources.nodes * resources.processes()
    return max(1, min(visible_gpus(), resources.nodes * resources.gpus_per_node))


def visible_gpus() -> int:
    if (listed := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return len([d for d in listed.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in result.stdout.splitlines())


def write_config(config: TrainerConfig, output_dir: Path) -> Path:
    from finetune_operator import yamlio

    path = output_dir / CONFIG_DIR / "trainer.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yamlio.dump(config.to_dict()))
    return path


def trainer_command(config_path: Path, processes: int, max_restarts: int = 0) -> list[str]:
    """torchrun on this machine. `max_restarts` (the job's runPolicy.backoffLimit): when a
    worker fails (an exception, an OOM kill, `kill -9`), torchrun stops the others and starts
    them all again, up to that many times; they resume from the newest complete checkpoint
    (each rank sees TORCHELASTIC_RESTART_COUNT and says so in the log)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={processes}", f"--max-restarts={max_restarts}",
            "-m", "finetune_trainer", "--config", str(config_path)]


def preflight_command(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "finetune_trainer", "--config", str(config_path), "--preflight"]


def run_trainer(config_path: Path, processes: int, max_restarts: int = 0) -> int:
    """Run torchrun in its own session; Ctrl-C or SIGTERM here becomes a SIGTERM there, so
    the workers checkpoint at the next step boundary and exit (143). A signal to torchrun
    itself never restarts the workers; a failed worker does, up to `max_restarts` times."""
    # torchrun's agent hosts one TCPStore for every attempt by default, and the process
    # group's keys (each rank's address) survive a restart there: a restarted rank can read
    # its peer's from the failed attempt and fail to connect (pytorch/pytorch#135712). With
    # sharing off, every attempt's rank 0 hosts a fresh store on a fresh port.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    child = subprocess.Popen(trainer_command(config_path, processes, max_restarts),
                             start_new_session=True, env=env)
    stopped = False

    def forward(signum, frame) -> None:
        nonlocal stopped
        stopped = True
        child.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_STOPPED if stopped else code
