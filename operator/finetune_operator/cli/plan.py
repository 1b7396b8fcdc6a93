"""`finetune plan`: per-GPU memory and step time of a job, a manifest's or `--model`'s, and
the lists of what the planner knows. What the options mean is the planner's
(`planner.options`); here they are read, checked against each other and printed."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, NoReturn

import click

from finetune_operator.admission import admit
from finetune_operator.api import SWEEP_KIND, FineTuneJob, FineTuneSweep
from finetune_operator.cli.common import jobs_in, largest_values, printable, say_problem
from finetune_operator.cli.group import EXIT_INVALID, main
from finetune_operator.manifests import Document
from finetune_operator.validation import Problem, gpu_type_is_known

if TYPE_CHECKING:
    from finetune_operator.planner import ModelConfigs


@main.command(name="plan")
@click.argument("file", required=False)
@click.option("--gpu-type", default=None, metavar="T",
              help="Plan for this GPU or Azure VM size instead of spec.resources.gpuType "
                   "(`--list-gpus` lists them).")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True, help="Output format.")
@click.option("--offline", is_flag=True,
              help="Do not fetch config.json from the hub; use local paths and the "
                   "built-in table only.")
@click.option("--model", "model_name", default=None, metavar="NAME",
              help="Plan this model without a manifest: a name of the built-in table "
                   "(`--list-models`), a hub repo (org/name) or a local folder holding "
                   "config.json; the job is a manifest's defaults plus the options below.")
@click.option("--method", type=click.Choice(["lora", "qlora", "full"]), default=None,
              help="With --model: spec.method.type.  [default: lora]")
@click.option("--seq-len", type=click.IntRange(min=16), default=None, metavar="N",
              help="With --model: spec.dataset.maxSeqLength.  [default: 2048]")
@click.option("--gpus-per-node", type=click.IntRange(0, 16), default=None, metavar="N",
              help="With --model: spec.resources.gpusPerNode.  [default: 1]")
@click.option("--nodes", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --model: spec.resources.nodes.  [default: 1]")
@click.option("--list-gpus", is_flag=True,
              help="List the GPUs and Azure VM sizes the planner knows, and exit.")
@click.option("--list-models", is_flag=True,
              help="List the models of the planner's built-in table, and exit.")
def plan_command(file: str | None, gpu_type: str | None, output: str, offline: bool,
                 model_name: str | None, method: str | None, seq_len: int | None,
                 gpus_per_node: int | None, nodes: int | None, list_gpus: bool,
                 list_models: bool) -> None:
    """Predict per-GPU memory and step time of a FineTuneJob, and the cheapest fit.

    Reads only the model's config.json (a local folder, the hub, or a built-in table of
    well-known models). A FineTuneSweep is planned as its largest trial (each searched
    number at its largest). Exits 0 when the job fits or the planner cannot tell, 1 when
    it is predicted not to fit, 2 when the manifest is invalid (with -o json, the problems
    as `finetune validate -o json` gives them).

    \b
      finetune plan job.yaml --gpu-type A100-80GB      a manifest, on another GPU
      finetune plan --model meta-llama/Llama-3.1-8B --method full --gpus-per-node 8
      finetune plan --list-gpus                        what --gpu-type takes
      finetune plan --list-models                      what --model takes offline
    """
    # the planner (its tables, the hub's client): loaded only by the command that plans
    from finetune_operator import planner
    from finetune_operator.planner import report as plan_report
    from finetune_operator.planner.sources import ask_hub, hub_offline

    with_model = {"--method": method, "--seq-len": seq_len, "--gpus-per-node": gpus_per_node,
                  "--nodes": nodes}
    if list_gpus or list_models:
        _usage_unless(not (file or model_name or gpu_type) and all(
            v is None for v in with_model.values()),
            "--list-gpus and --list-models take no FILE, --model, --gpu-type or --model's "
            "options (-o json lists as JSON)")
        _print_lists(list_gpus, list_models, output)
        return
    why_offline = "--offline" if offline else (
        "HF_HUB_OFFLINE=1" if hub_offline() else None)
    # asked, the hub's silence is said with its reason, as --offline is
    configs = planner.ModelConfigs(fetch=None if why_offline else ask_hub)
    sweep = None
    if model_name is not None:
        _usage_unless(file is None, "give FILE or --model, not both")
        job = _job_of_model(model_name, configs, why_offline, gpu_type, with_model, output)
    else:
        _usage_unless(file is not None, None)
        given = [name for name, value in with_model.items() if value is not None]
        _usage_unless(not given, f"{', '.join(given)}: only with --model (with FILE, the "
                                 "manifest's spec says it)")
        doc, job = _the_job_to_plan(file, gpu_type, output)
        configs.base_dir = doc.folder
        sweep = _sweep_note(doc)
    model = configs.resolve(job.spec.model.uri, job.spec.model.revision)
    result = plan_report.plan_with_notes(job, model, offline=why_offline, unanswered=(
        configs.unanswered(job.spec.model.uri, job.spec.model.revision)))
    if sweep is not None:
        result = result.model_copy(update={"notes": [sweep, *result.notes]})
    if output == "json":
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(printable(plan_report.table(job, result)))
    sys.exit(1 if result.fits is False else 0)


def _usage_unless(ok: bool, message: str | None) -> None:
    """click's usage error (exit 2) unless `ok`; `message` None: FILE is missing."""
    if ok:
        return
    context = click.get_current_context()
    if message is None:
        file = next(p for p in context.command.params if p.name == "file")
        raise click.MissingParameter(ctx=context, param=file, param_hint="'FILE'")
    raise click.UsageError(message, context)


def _print_lists(list_gpus: bool, list_models: bool, output: str) -> None:
    """`plan --list-gpus` / `--list-models`: what the planner knows."""
    from finetune_operator.planner import listing  # the planner: as in plan_command

    if output == "json":
        data = {"gpus": listing.gpus(), "vmSizes": listing.vm_sizes()} if list_gpus else {}
        click.echo(json.dumps({**data, **({"models": listing.models()} if list_models
                                          else {})}, indent=2))
        return
    tables = [listing.gpus_table()] if list_gpus else []
    click.echo("\n\n".join([*tables, *([listing.models_table()] if list_models else [])]))


def _refuse(said: list[tuple[str, Problem]], output: str) -> NoReturn:
    """Exit 2 with the problems said; with `-o json`, said as `finetune validate -o json`
    says them, so that standard output is JSON whatever happened."""
    if output != "json":
        for where, problem in said:
            say_problem(where, problem)
    else:
        click.echo(json.dumps({"valid": False, "problems": [
            {"source": where, "field": p.path, "message": p.message, "fix": p.fix,
             "severity": p.severity} for where, p in said]}, indent=2))
    sys.exit(EXIT_INVALID)


def _one_line(where: str, line: str) -> tuple[str, Problem]:
    """A refusal of an option, one line `what — fix`, as a problem of `where`."""
    return where, Problem("", line, line.partition(" — ")[2])


def _the_job_to_plan(file: str, gpu_type: str | None, output: str
                     ) -> tuple[Document, FineTuneJob]:
    """The one FineTuneJob in `file` (a FineTuneSweep's largest trial), its problems said
    (exit 2 when invalid); with `--gpu-type T`, as planned for T: the warnings about the
    spec's own gpuType are left out and those about T said instead."""
    said: list[tuple[str, Problem]] = []
    valid, invalid = jobs_in((file,), "plan", say=lambda where, p: said.append((where, p)))
    if invalid or len(valid) != 1:
        if not invalid:
            said.append(_one_line(file, f"{file}: holds {len(valid)} FineTuneJobs — "
                                        "`finetune plan` takes one"))
        _refuse(said, output)
    doc, job = valid[0]
    if gpu_type:
        _refuse_gpu_type(gpu_type, job, output)
        own = set(gpu_type_is_known(job))
        job = job.model_copy(deep=True)
        job.spec.resources.gpu_type = gpu_type
        said = [(w, p) for w, p in said if p not in own] + [
            (f"--gpu-type {gpu_type}", p) for p in gpu_type_is_known(job)]
    for where, problem in said:
        say_problem(where, problem)
    return doc, job


def _sweep_note(doc: Document) -> str | None:
    """What a plan of a FineTuneSweep is of (`common.largest_trial`): the values it set,
    and the searched fields it could not rank, whose trials it does not cover."""
    if doc.data.get("kind") != SWEEP_KIND:
        return None
    sweep = FineTuneSweep.model_validate(doc.data)  # valid: its largest trial was admitted
    largest = largest_values(sweep.spec.search_space)
    unranked = [path for path in sweep.spec.search_space if path not in largest]
    note = (f"{SWEEP_KIND} {sweep.namespace}/{sweep.name}: planned as its largest trial, "
            "spec.template" + (" with " + ", ".join(f"{k}: {v}" for k, v in largest.items())
                               + " (each searched number at its largest)" if largest else ""))
    if unranked:
        them = "them" if len(unranked) > 1 else "it"
        note += (f"; {', '.join(unranked)} as the template has {them}: a trial with another "
                 "value may need more memory")
    return note


def _job_of_model(name: str, configs: ModelConfigs, why_offline: str | None,
                  gpu_type: str | None, with_model: dict[str, int | str | None], output: str
                  ) -> FineTuneJob:
    """`plan --model NAME`: its job (`options.model_manifest`), admitted as for this
    machine; exit 2 for a model whose config cannot be found, or a job refused."""
    from finetune_operator.planner import options  # the planner: as in plan_command

    uri = options.model_uri(name)
    if configs.resolve(uri) is None:
        _refuse([_one_line(f"--model {name}", options.missing_model(
            name, uri, why_offline, configs.unanswered(uri)))], output)
    admission = admit(options.model_manifest(
        name, uri, gpu_type, method=with_model["--method"], seq_len=with_model["--seq-len"],
        gpus_per_node=with_model["--gpus-per-node"], nodes=with_model["--nodes"]), {}, "here")
    if admission.job is not None and gpu_type:
        _refuse_gpu_type(gpu_type, admission.job, output)
    said = [(f"--model {name}", problem) for problem in admission.problems]
    if admission.job is None or admission.errors:
        _refuse(said, output)
    for where, problem in said:
        say_problem(where, problem)
    return admission.job


def _refuse_gpu_type(gpu_type: str, job: FineTuneJob, output: str) -> None:
    """Exit 2 where the planner refuses `--gpu-type` for this job (`options.gpu_type_refused`)."""
    from finetune_operator.planner import options  # the planner: as in plan_command

    if refused := options.gpu_type_refused(gpu_type, job):
        _refuse([_one_line(f"--gpu-type {gpu_type}", refused)], output)
