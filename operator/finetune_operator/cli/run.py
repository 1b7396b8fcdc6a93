"""`finetune run`: a FineTuneJob trained on this machine. The steps are the `local`
package's (the config for this machine, fetching, torchrun and its restarts, the
path checks, the folder's lock); here they are called in order and each outcome said."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from finetune_operator.api import FineTuneJob
from finetune_operator.cli.common import jobs_in, summary
from finetune_operator.cli.group import EXIT_INVALID, main
from finetune_operator.follow import mark_failed, run_log
from finetune_operator.local.lock import FolderInUse, hold
from finetune_operator.local.logs import RunLog
from finetune_operator.local.output import (
    START_OVER,
    already_done,
    set_earlier_run_aside,
    stopped_message,
)
from finetune_operator.local.paths import local_path_problems
from finetune_operator.local.ports import PortTaken, serving_here
from finetune_operator.local.processes import (
    failure_hint,
    fetch_command,
    needs_fetch,
    run_step,
    run_trainer,
)
from finetune_operator.manifests import Document
from finetune_operator.validation import InvalidJobError
from finetune_trainer import layout, trained_with
from finetune_trainer.exits import STOPPED

if TYPE_CHECKING:
    from finetune_trainer.config import TrainerConfig


@main.command(name="run")
@click.argument("file", metavar="FILE")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Training processes on this machine. Default: the spec's CPU workers "
                   "(nodes x processesPerNode), or the visible GPUs.")
@click.option("--fresh", is_flag=True,
              help="Start over instead of resuming: the earlier run's checkpoints, model and "
                   "progress are moved aside (into before-<time>/ in the output folder), "
                   "never deleted.")
@click.option("--metrics-port", type=click.IntRange(min=1, max=65535), default=None,
              help="Serve each process's /metrics and /progress on 127.0.0.1 from this port "
                   "(process k on PORT+k). Default: 9108, or the next free ports when another "
                   "run holds them.")
@click.option("--verbose", "-v", is_flag=True,
              help="Show every line torchrun and the workers print (library warnings, "
                   "loading progress bars, torchrun's own log).")
def run_command(file: str, nproc: int | None, fresh: bool, metrics_port: int | None,
                verbose: bool) -> None:
    """Train a FineTuneJob on this machine with torchrun, no cluster needed.

    Validates first (paths, the machine, the checkpoints' settings) before any process
    starts; each worker checks the model and data before it joins the others, then trains
    and prints where the outputs went. Relative paths start at the manifest's folder.
    Ctrl-C (or SIGTERM) checkpoints at the next step and exits 143 with one line saying
    where; running the same command again resumes from that checkpoint. A worker that
    fails (an exception, an OOM kill, kill -9) restarts all of them from the newest
    complete checkpoint, up to spec.runPolicy.backoffLimit times; a model or data the
    trainer refuses is said once and not restarted. An output folder belongs to one
    training: checkpoints of another (another objective, model, dataset, LoRA rank,
    strategy, ...) are never resumed, and a model exported there is never replaced by a run
    from step 0; the run is refused, naming what differs (--fresh sets them aside).
    """
    # the planner (model configs, this machine as a VM size): only the command that trains
    from finetune_operator.local.config import model_config, plan_warnings, write_config
    from finetune_operator.local.machine import described

    doc, job = _the_job_to_run(file)
    model = model_config(job, doc.folder)
    gpus, processes, here, differences, machine = _fitted_here(doc, job, nproc)
    config, step_settings, serving, ports = _config_here(doc, here, model, machine,
                                                         metrics_port)
    output_dir = Path(config.output.uri)
    lock = _hold_output(doc.source, output_dir)  # before anything in the folder changes
    if fresh and (moved := set_earlier_run_aside(output_dir)) is not None:
        aside, names = moved
        click.echo(f"--fresh: the earlier run's {', '.join(names)} are kept in {aside}; "
                   "starting over")
    if refused := trained_with.refusal(output_dir, config, START_OVER, doc.folder):
        click.echo(f"{doc.source}: {refused}", err=True)
        sys.exit(EXIT_INVALID)
    if not fresh and (done := already_done(output_dir, config)):
        click.echo(f"{doc.source}: {done}")
        sys.exit(0)
    config_path = write_config(config, output_dir)
    click.echo(f"{doc.source}: {summary(here, 'this machine', on_gpus=bool(gpus))}")
    for difference in differences:
        click.echo(f"{doc.source}: {difference}", err=True)
    if machine is not None:
        click.echo(f"{doc.source}: step settings sized for this machine's "
                   f"{described(machine)}, not for spec.resources.gpuType")
    for note in step_settings.notes:
        click.echo(f"{doc.source}: {note}")
    for warning in plan_warnings(here if machine else job, model, machine):
        click.echo(f"{doc.source}: {warning}", err=True)
    click.echo(f"trainer config: {config_path}")
    click.echo(serving)

    _fetch(config, config_path, output_dir, verbose)
    restarts = job.spec.run_policy.backoff_limit
    click.echo(f"starting {processes} training process{'es' if processes > 1 else ''} "
               f"(a failed worker restarts them all from the newest checkpoint, up to "
               f"{restarts} time{'' if restarts == 1 else 's'}: spec.runPolicy.backoffLimit)")

    code = run_trainer(config_path, processes, run_log(output_dir),
                             max_restarts=restarts, verbose=verbose, lock=lock,
                             on_gpus=job.spec.resources.on_gpus)
    ports.close()  # held for the workers until now, restarts included
    if code == 0:
        ended = (f"done: model in {output_dir / layout.FINAL_DIR}, checkpoints in "
                 f"{layout.checkpoint_root(output_dir)}, progress in "
                 f"{output_dir / layout.PROGRESS_FILE}")
        click.echo(ended)
    elif code == STOPPED:
        ended = stopped_message(output_dir)
        click.echo(ended, err=True)
    else:
        mark_failed(output_dir)
        ended = f"training failed (exit {code}): {failure_hint(code)}"
        click.echo(ended, err=True)
    log = RunLog(run_log(output_dir))  # `finetune logs` ends as the terminal did
    log.write(f"{ended}\n")
    log.close()
    sys.exit(code)


def _fitted_here(doc: Document, job: FineTuneJob, nproc: int | None):
    """The visible GPUs, the processes this run starts (`--nproc`, else the spec's CPU
    workers or the visible GPUs), the job as run on them (the spec's global batch kept),
    one line for each way that differs from the spec, and this machine's GPUs as the planner
    sees a VM size (None on CPUs); or exit 2 where the global batch cannot be kept."""
    from finetune_operator.local.machine import (  # as in run_command
        MachineMismatch,
        as_run_here,
        default_processes,
        fit_to_machine,
        this_machine,
        visible_gpus,
    )

    gpus = visible_gpus()
    processes = nproc or default_processes(job, gpus)
    try:
        accumulation, differences = fit_to_machine(job, processes, gpus)
    except MachineMismatch as error:
        click.echo(f"{doc.source}: {error}", err=True)
        sys.exit(EXIT_INVALID)
    machine = this_machine(processes) if gpus and job.spec.resources.on_gpus else None
    return gpus, processes, as_run_here(job, processes, accumulation), differences, machine


def _the_job_to_run(file: str) -> tuple[Document, FineTuneJob]:
    """The manifest's one FineTuneJob, valid, with the model and data paths it reads on
    this machine there; else the problems said and exit 2."""
    valid, invalid = jobs_in((file,), "here")
    if invalid:
        sys.exit(EXIT_INVALID)
    if len(valid) != 1:
        click.echo(f"{file}: holds {len(valid)} FineTuneJobs — `finetune run` takes one", err=True)
        sys.exit(EXIT_INVALID)
    doc, job = valid[0]
    if missing := local_path_problems(job, doc.folder, runs_here=True):
        for problem in missing:
            click.echo(f"{doc.source}: {problem}", err=True)
        sys.exit(EXIT_INVALID)
    return doc, job


def _config_here(doc: Document, here: FineTuneJob, model, machine, metrics_port: int | None):
    """The trainer config of the job run `here`, its step settings, the line saying where
    its metrics are served and the hold on those ports (`ports.PortHold`, kept until the
    run ends); or its problems said and exit 2."""
    from finetune_operator.local.config import local_config  # as in run_command

    try:
        manifest = None if doc.path == "-" else str(Path(doc.path).resolve())
        config, step_settings = local_config(here, doc.folder, model, machine, manifest)
        config, serving, ports = serving_here(config, here.spec.resources.processes(),
                                                    metrics_port)
    except InvalidJobError as error:
        for problem in error.problems:
            click.echo(f"{doc.source}: {problem}", err=True)
        sys.exit(EXIT_INVALID)
    except PortTaken as error:
        click.echo(f"{doc.source}: {error}", err=True)
        sys.exit(EXIT_INVALID)
    return config, step_settings, serving, ports


def _fetch(config: TrainerConfig, config_path: Path, output_dir: Path, verbose: bool) -> None:
    """Before any worker: an hf:// model fetched into the output folder; exits with the
    fetch's code when it fails, the run marked Failed (`finetune status` of the folder says
    so, not Stopped). The model and the data are then checked by the workers themselves,
    as in the pods, before they join: a step of its own for that took a process starting
    the training stack (6-7 s on 2 cores) and a pass over the data that every worker
    makes again."""
    log = run_log(output_dir)
    RunLog(log).begin("finetune run")  # where this run's lines start
    if needs_fetch(config) and (fetched := run_step(
            fetch_command(config_path), log, verbose)) != 0:
        _stop_before_training(fetched, output_dir)
        sys.exit(fetched)  # 2: the name, revision or token; 1: the network or the disk


def _stop_before_training(code: int, output_dir: Path) -> None:
    """A step before the workers failed (the run is marked Failed: `finetune status` says
    so) or was interrupted (Ctrl-C: nothing failed; one line, exit 143 as in training)."""
    if code == STOPPED:
        click.echo(stopped_message(output_dir), err=True)
        sys.exit(code)
    mark_failed(output_dir)


def _hold_output(source: str, output_dir: Path) -> int | None:
    """The output folder's lock for this run (`lock.hold`), or exit 2 naming the run
    that writes it."""
    try:
        return hold(output_dir)
    except FolderInUse as error:
        click.echo(f"{source}: spec.output.uri: {error} — wait for it to end, stop it (Ctrl-C "
                   "where it runs: it checkpoints first), or give this run another "
                   "spec.output.uri", err=True)
        sys.exit(EXIT_INVALID)

