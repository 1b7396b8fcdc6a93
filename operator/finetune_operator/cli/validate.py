"""`finetune validate` and `finetune render`: what the operator would accept, and what it
would create, without a cluster."""

from __future__ import annotations

import json
import sys

import click

from finetune_operator import yamlio
from finetune_operator.admission import offline_backends
from finetune_operator.backends import installed_names
from finetune_operator.cli.common import jobs_in, say_problem, summary
from finetune_operator.cli.group import EXIT_INVALID, main
from finetune_operator.local.paths import local_path_problems
from finetune_operator.output_folders import shared_folder_warnings
from finetune_operator.render import render
from finetune_operator.validation import Problem


@main.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="json: one object with every problem, for tools and CI.")
@click.option("--data", is_flag=True,
              help="Also read each valid job's model and data on this machine as its workers "
                   "will before training (the tokenizer, every record, the objective's "
                   "rules), and say how many records it found or which one is wrong. "
                   "Needs the trainer's packages; seconds a job, no GPU, nothing written.")
def validate(files: tuple[str, ...], output: str, data: bool) -> None:
    """Check FineTuneJob and FineTuneSweep manifests (`-` reads stdin).

    A FILE may be a folder: its .json, .yaml and .yml files, as `kubectl apply -f` takes
    it (not its subfolders). A `kind: List` (`kubectl get -o yaml`) is read as its items.

    Prints one line per problem, `FILE: path.to.field: what is wrong — how to fix`, and
    exits 2 when any manifest is invalid. It checks what the operator checks, the
    backend's own refusals included (what `finetune render` refuses, but for relative
    paths: `finetune run` takes those, so here they are a warning and `render`, for a
    cluster, refuses them). Warnings (an absolute local path that does not exist on this
    machine, relative paths that only `finetune run` can use, two jobs writing one output
    folder) do not change the exit
    code; a relative model or data path that is not on this machine is an error. With
    --data, a model or data set the trainer would refuse is an error too.
    """
    found: list[dict] = []

    def collect(source: str, problem: Problem) -> None:
        found.append({"source": source, "field": problem.path, "message": problem.message,
                      "fix": problem.fix, "severity": problem.severity})

    say = collect if output == "json" else say_problem
    sweeps: list = []
    valid, invalid = jobs_in(files, "validate", say=say, sweeps=sweeps)
    if data:
        # the trainer config and a process of the training stack: only when asked
        from finetune_operator.local.data_check import check_data
        for doc, _sweep in sweeps:  # its trials are FineTuneJobs on the cluster only
            say(doc.source, Problem("--data", "not read: --data reads FineTuneJobs, and a "
                                    "sweep's trials read spec.template's model and data on "
                                    "the cluster", "their workers check them when each trial "
                                    "starts; to read them here, validate --data a FineTuneJob "
                                    "whose spec is the template", severity="warning"))
    usable, read = [], []  # read: what --data found of each usable job
    for doc, job in valid:
        here = local_path_problems(job, doc.folder)
        checked = check_data(job, doc.folder) if data and not here else None
        if checked:
            here += checked.problems
        elif data:  # its model or data path is not usable here, as said
            here.append(Problem("--data", "not read: its model or data is not on this "
                                "machine (above)", "check it where the job runs",
                                severity="warning"))
        for problem in here:
            say(doc.source, problem)
        if any(p.severity == "error" for p in here):  # a relative path not on this machine,
            invalid += 1                             # a model or data the trainer refuses
        else:
            usable.append((doc, job))
            read.append(checked.said if checked else None)
    valid = usable
    for source, problem in shared_folder_warnings(valid, offline_backends()):
        say(source, problem)
    if output == "json":
        click.echo(json.dumps({
            "valid": invalid == 0,
            "jobs": [{"source": doc.source, "name": job.name, "namespace": job.namespace,
                      **({"data": list(said)} if said is not None else {})}
                     for (doc, job), said in zip(valid, read, strict=True)],
            "problems": found}, indent=2))
    else:
        for (doc, job), said in zip(valid, read, strict=True):
            click.echo(f"{doc.source}: valid {summary(job)}")
            for line in said or ():
                click.echo(f"{doc.source}: data: {line}")
    if invalid:
        sys.exit(EXIT_INVALID)


@main.command(name="render")
@click.argument("file", metavar="FILE")
@click.option("-o", "--output", type=click.Choice(["yaml", "json"]), default="yaml",
              show_default=True, help="Output format.")
@click.option("--backend", default=None, metavar="NAME",
              help="Render for this backend instead of the manifest's spec.backend.")
def render_command(file: str, output: str, backend: str | None) -> None:
    """Print the objects the operator would create for a FineTuneJob, without a cluster.

    \b
    kubernetes: the ConfigMap, headless Service and Indexed Job
    azureml:    the command job YAML, for `az ml job create --file`
    """
    if backend is not None and backend not in installed_names():  # the flag's, not the file's
        raise click.BadParameter(f"{backend!r} is not an installed backend — use one of: "
                                 f"{', '.join(sorted(installed_names()))}",
                                 param_hint="--backend")
    valid, invalid = jobs_in((file,), "render", backend=backend)
    if invalid:
        sys.exit(EXIT_INVALID)
    objects = [obj for _, job in valid for obj in render(job)]
    if output == "json":
        click.echo(json.dumps(objects[0] if len(objects) == 1 else
                              {"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        click.echo(yamlio.dump_all(objects).rstrip())
