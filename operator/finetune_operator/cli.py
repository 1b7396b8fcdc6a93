"""The `finetune` command."""

from __future__ import annotations

import json
import sys

import click

from finetune_operator import yamlio
from finetune_operator.api import KIND, FineTuneJob
from finetune_operator.manifests import Document, ManifestError, read_documents
from finetune_operator.render import render
from finetune_operator.validation import check_document

EXIT_INVALID = 2


def _jobs_in(paths: tuple[str, ...]) -> tuple[list[tuple[Document, FineTuneJob]], int]:
    """Check every FineTuneJob in `paths`, printing problems; returns the valid jobs and
    the number of invalid documents."""
    valid: list[tuple[Document, FineTuneJob]] = []
    invalid = 0
    for path in paths:
        try:
            documents = read_documents(path)
        except ManifestError as error:
            click.echo(str(error), err=True)
            invalid += 1
            continue
        jobs_here = 0
        for doc in documents:
            if isinstance(doc.data, dict) and doc.data.get("kind") not in (None, KIND):
                click.echo(f"{doc.source}: skipped {doc.data.get('kind')} (not a {KIND})",
                           err=True)
                continue
            jobs_here += 1
            job, problems = check_document(doc.data)
            errors = [p for p in problems if p.severity == "error"]
            for problem in problems:
                prefix = "warning: " if problem.severity == "warning" else ""
                click.echo(f"{doc.source}: {prefix}{problem}", err=True)
            if errors or job is None:
                invalid += 1
            else:
                valid.append((doc, job))
        if jobs_here == 0:
            click.echo(f"{path}: no {KIND} found — check `kind: {KIND}`", err=True)
            invalid += 1
    return valid, invalid


def _summary(job: FineTuneJob) -> str:
    spec, r = job.spec, job.spec.resources
    count = r.processes()
    unit = ("GPU" if count == 1 else "GPUs") if r.gpus_per_node else (
        "CPU process" if count == 1 else "CPU processes")
    nodes = "1 node" if r.nodes == 1 else f"{r.nodes} nodes"
    return (f"{KIND} {job.namespace}/{job.name}: {spec.method.type} on {spec.backend}, "
            f"{nodes} x {count} {unit}, strategy {spec.strategy.type}, "
            f"{spec.strategy.precision}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="finetune-operator")
def main() -> None:
    """Fine-tune LLMs from one FineTuneJob manifest: on Kubernetes, on Azure ML, or here.

    \b
      finetune validate job.yaml      check a manifest, every problem at once
      finetune render job.yaml        print the objects the operator would create
    """


@main.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
def validate(files: tuple[str, ...]) -> None:
    """Check FineTuneJob manifests (`-` reads stdin).

    Prints one line per problem, `FILE: path.to.field: what is wrong — how to fix`, and
    exits 2 when any manifest is invalid. Warnings do not change the exit code.
    """
    valid, invalid = _jobs_in(files)
    for doc, job in valid:
        click.echo(f"{doc.source}: valid {_summary(job)}")
    if invalid:
        sys.exit(EXIT_INVALID)


@main.command(name="render")
@click.argument("file", metavar="FILE")
@click.option("-o", "--output", type=click.Choice(["yaml", "json"]), default="yaml",
              show_default=True, help="Output format.")
def render_command(file: str, output: str) -> None:
    """Print the objects the operator would create for a FineTuneJob, without a cluster."""
    valid, invalid = _jobs_in((file,))
    if invalid:
        sys.exit(EXIT_INVALID)
    objects = [obj for _, job in valid for obj in render(job)]
    if output == "json":
        click.echo(json.dumps(objects[0] if len(objects) == 1 else
                              {"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        click.echo(yamlio.dump_all(objects).rstrip())


if __name__ == "__main__":
    main()
