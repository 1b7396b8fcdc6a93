"""The `finetune` command."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import click

from finetune_operator import yamlio
from finetune_operator.admission import admit, offline_backends
from finetune_operator.api import KIND, SWEEP_KIND, FineTuneJob
from finetune_operator.manifests import Document, ManifestError, read_documents
from finetune_operator.pacing import LAUNCH_BURST, LAUNCH_RATE
from finetune_operator.render import render
from finetune_operator.sweep import check_sweep
from finetune_operator.validation import PUSH_THE_TRAINER_IMAGE, Problem, short_repr
from finetune_trainer import layout

if TYPE_CHECKING:
    from finetune_operator.kube import Kube
    from finetune_operator.planner import ModelConfigs
    from finetune_trainer.config import TrainerConfig

EXIT_INVALID = 2


def _say_problem(source: str, problem: Problem) -> None:
    if not problem.path:  # the file itself (cannot be read, not YAML): says where already
        click.echo(problem.message, err=True)
        return
    prefix = "warning: " if problem.severity == "warning" else ""
    click.echo(f"{source}: {prefix}{problem}", err=True)


Use = Literal["validate", "render", "here"]


def _sweep_valid(doc: Document, say: Callable[[str, Problem], None]) -> bool:
    """`validate` of a FineTuneSweep: its own fields, its template, and every searched
    value set into the template (`sweep.check_sweep`, what the operator checks)."""
    sweep, problems = check_sweep(doc.data)
    for problem in problems:
        say(doc.source, problem)
    if sweep is None or any(p.severity == "error" for p in problems):
        return False
    spec = sweep.spec
    click.echo(f"{doc.source}: valid {SWEEP_KIND} {sweep.name}: up to {spec.max_trials} "
               f"trials, {min(spec.parallel_trials, spec.max_trials)} at once, "
               f"{spec.sampling} sampling of {', '.join(spec.search_space)}",
               err=say is not _say_problem)  # `-o json` keeps standard output JSON
    return True


def _jobs_in(paths: tuple[str, ...], use: Use, backend: str | None = None,
             say: Callable[[str, Problem], None] = _say_problem,
             ) -> tuple[list[tuple[Document, FineTuneJob]], int]:
    """Check every FineTuneJob in `paths`, telling `say` each problem; returns the valid
    jobs and the number of invalid documents. `use`: `validate` and `render` check what the
    operator checks, the backend's refusals included (`admission.admit`), so the
    two agree; `validate` leaves out the backend's refusal of relative paths, which it
    reports as one warning (they are for `finetune run`). `here`: `finetune run` and
    `finetune plan` on this machine, without the cluster-only rules. `backend`: check them
    as if `spec.backend` said so (`render --backend`)."""
    valid: list[tuple[Document, FineTuneJob]] = []
    invalid = 0
    installed = offline_backends() if use != "here" else {}  # `here` needs their names only
    for path in paths:
        try:
            documents = read_documents(path)
        except ManifestError as error:
            say(path, Problem("", str(error), "fix the file"))
            invalid += 1
            continue
        jobs_here = 0
        for doc in documents:
            if use == "validate" and isinstance(doc.data, dict) and (
                    doc.data.get("kind") == SWEEP_KIND):
                jobs_here += 1
                invalid += not _sweep_valid(doc, say)
                continue
            if isinstance(doc.data, dict) and doc.data.get("kind") not in (None, KIND):
                kind = doc.data.get("kind")
                meant = next((k for k in (KIND, SWEEP_KIND) if isinstance(kind, str)
                              and kind.lower() == k.lower()), None)
                if kind == SWEEP_KIND:  # spelled right, but this command takes jobs
                    click.echo(f"{doc.source}: skipped {SWEEP_KIND} (this command takes "
                               f"{KIND}s; `finetune validate` checks a sweep, whose trials "
                               "are its spec.template with the searched values set)",
                               err=True)
                    continue
                click.echo(f"{doc.source}: skipped {_plain(kind)} (not a {KIND}"
                           + (f"; kinds are case-sensitive: `kind: {meant}`?" if meant else "")
                           + ")", err=True)
                continue
            jobs_here += 1
            if backend and isinstance(doc.data, dict) and isinstance(doc.data.get("spec"), dict):
                doc.data["spec"]["backend"] = backend
            admission = admit(doc.data, installed, "here" if use == "here" else "cluster")
            job, problems = admission.job, admission.problems
            if use == "validate":  # said once, by validation's warning; the image the
                # operator's own settings name is the cluster's, not this machine's: render's
                problems = [p for p in problems
                            if not (p.cluster_only and p.severity == "error")
                            and PUSH_THE_TRAINER_IMAGE not in p.fix]
            errors = [p for p in problems if p.severity == "error"]
            for problem in problems:
                say(doc.source, problem)
            if errors or job is None:
                invalid += 1
            else:
                valid.append((doc, job))
        if jobs_here == 0:  # a problem of the file: in `validate -o json` too
            say(path, Problem("", f"{path}: no {KIND} found — check `kind: {KIND}`",
                              f"check `kind: {KIND}`"))
            invalid += 1
    return valid, invalid


def _plain(value: object, longest: int = 80) -> str:
    """`value` as it is when printable and at most `longest` characters, else quoted and cut
    short: a value from the manifest may hold a newline (a forged line), escapes, or
    megabytes."""
    plain = isinstance(value, str) and value.isprintable() and len(value) <= longest
    return value if plain else short_repr(value)


def _path(path: Path) -> str:
    """A path in a message: whole up to 256 characters (a path cut short cannot be copied
    into the fix), quoted when it holds a line break or escapes, cut when it is longer."""
    return _plain(str(path), longest=256)


def _summary(job: FineTuneJob, where: str | None = None, on_gpus: bool = True) -> str:
    """One line about the job; `where`: `here` for `finetune run`, else its backend;
    `on_gpus`: False where `finetune run` trains a GPU job's workers on CPUs."""
    spec, r = job.spec, job.spec.resources
    count = r.processes()
    unit = ("GPU" if count == 1 else "GPUs") if r.on_gpus and on_gpus else (
        "CPU process" if count == 1 else "CPU processes")
    nodes = "1 node" if r.nodes == 1 else f"{r.nodes} nodes"
    return (f"{KIND} {job.namespace}/{job.name}: {spec.method.type} on {where or spec.backend}, "
            f"{nodes} x {count} {unit}, strategy {spec.strategy.type}, "
            f"{spec.strategy.precision}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="finetune-operator")
def main() -> None:
    """Fine-tune LLMs from one FineTuneJob manifest: on Kubernetes, on Azure ML, or here.

    \b
      finetune validate job.yaml      check a manifest, every problem at once
      finetune render job.yaml        print the objects the operator would create
      finetune plan job.yaml          per-GPU memory, step time, the cheapest GPUs that fit
      finetune run job.yaml           train it on this machine (CPU or local GPUs)
      finetune status NAME --watch    phase, progress bar, events (a cluster's job or a run's)
      finetune logs NAME -f           the trainer's log
      finetune export OUT oci://REF   push a trained model to a registry (KAITO, oras)
      finetune operator               run the controller (in-cluster, or via KUBECONFIG)
    """


@main.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="json: one object with every problem, for tools and CI.")
def validate(files: tuple[str, ...], output: str) -> None:
    """Check FineTuneJob and FineTuneSweep manifests (`-` reads stdin).

    Prints one line per problem, `FILE: path.to.field: what is wrong — how to fix`, and
    exits 2 when any manifest is invalid. It checks what the operator checks, the
    backend's own refusals included (what `finetune render` refuses). Warnings (an
    absolute local path that does not exist on this machine, relative paths that only
    `finetune run` can use, two jobs writing one output folder) do not change the exit
    code; a relative model or data path that is not on this machine is an error.
    """
    found: list[dict] = []

    def collect(source: str, problem: Problem) -> None:
        found.append({"source": source, "field": problem.path, "message": problem.message,
                      "fix": problem.fix, "severity": problem.severity})

    say = collect if output == "json" else _say_problem
    valid, invalid = _jobs_in(files, "validate", say=say)
    usable = []
    for doc, job in valid:
        here = local_path_problems(job, doc.folder)
        for problem in here:
            say(doc.source, problem)
        if any(p.severity == "error" for p in here):  # a relative path not on this machine
            invalid += 1
        else:
            usable.append((doc, job))
    valid = usable
    for source, problem in _shared_outputs(valid):
        say(source, problem)
    if output == "json":
        click.echo(json.dumps({
            "valid": invalid == 0,
            "jobs": [{"source": doc.source, "name": job.name, "namespace": job.namespace}
                     for doc, job in valid],
            "problems": found}, indent=2))
    else:
        for doc, job in valid:
            click.echo(f"{doc.source}: valid {_summary(job)}")
    if invalid:
        sys.exit(EXIT_INVALID)


def _shared_outputs(valid: list[tuple[Document, FineTuneJob]]) -> list[tuple[str, Problem]]:
    """A warning for each job whose output folder an earlier job of the files writes too: on
    a cluster the operator launches one live job per folder and refuses the other
    (OutputInUse); run one after the other, the second resumes or refuses the first's."""
    backends = offline_backends()
    first: dict[str, tuple[Document, FineTuneJob]] = {}
    warnings = []
    for doc, job in valid:
        if (folder := _output_folder(job, doc, backends)) is None:
            continue
        if folder not in first:
            first[folder] = (doc, job)
            continue
        other_doc, other = first[folder]
        warnings.append((doc.source, Problem(
            "spec.output.uri", f"{job.spec.output.uri} is also the output folder of "
            f"FineTuneJob {other.namespace}/{other.name} ({other_doc.source}): one folder "
            "holds one job's checkpoints and model, so the operator launches only one of "
            "them and refuses the other (OutputInUse)", "give each job a folder of its own",
            severity="warning")))
    return warnings


def _output_folder(job: FineTuneJob, doc: Document, backends) -> str | None:
    """Where the job's output lands, as its backend names the folder (`output_folder`); a
    relative path (`finetune run`) by where it is on this machine."""
    location = job.spec.output.location
    if location.scheme == "relative":
        return f"here|{(doc.folder / location.raw).resolve()}"
    find = getattr(backends.get(job.spec.backend), "output_folder", None)
    return find(job) if find is not None else None


def local_path_problems(job: FineTuneJob, base_dir: Path, runs_here: bool = False
                        ) -> list[Problem]:
    """The model and dataset paths this machine can look at and does not have (or has as a
    folder that is no saved model, an empty data file). Errors for relative ones: they mean
    this machine (only `finetune run` reads them), so one not here is wrong wherever it is
    checked; warnings for absolute ones (they may exist only in the job's image), errors
    too where the job `runs_here` (`finetune run`): found before anything starts or is
    written."""
    problems = []
    demo = Path(layout.DEMO_MODEL).parts
    for is_model, location in (True, job.spec.model.location), (False,
                                                                job.spec.dataset.location):
        scheme = location.scheme
        if scheme not in ("path", "relative"):
            continue
        where = base_dir / location.raw if scheme == "relative" else Path(location.raw)
        try:
            why, fix = _unusable(where, is_model)
        except OSError as error:  # a name too long for this filesystem, a loop of links
            why, fix = f"cannot be looked at on this machine ({error.strerror})", None
        if why is None:
            continue
        if fix is None and is_model and Path(os.path.normpath(where)).parts[
                -len(demo):] == demo:  # examples 01 and 08, before `make demo` built it
            fix = ("run `make demo` first: it builds the tiny model these examples use "
                   f"({layout.DEMO_MODEL})")
        if fix is None:
            fix = "fix the path (relative paths start at the manifest's folder)"
            if runs_here:
                fix += ": `finetune run` reads it on this machine"
        if not runs_here and scheme == "path":
            fix += "; ignore this if it is right where the job runs (inside its image)"
        problems.append(Problem(location.field, f"{_path(where)} {why}", fix, severity=(
            "error" if runs_here or scheme == "relative" else "warning")))
    output = job.spec.output.location
    if runs_here and output.scheme in ("path", "relative"):
        where = base_dir / output.raw if output.scheme == "relative" else Path(output.raw)
        if why := _unwritable(where):
            problems.append(Problem(output.field, f"{_path(where)} {why}",
                                    "point spec.output.uri at a folder this user can write "
                                    "(it is created if missing)"))
    return problems


def _unusable(where: Path, is_model: bool) -> tuple[str | None, str | None]:
    """(what is wrong, its fix or None for the path's) of a local model or data path."""
    saved_model = ("point it at a folder written by save_pretrained (config.json and the "
                   "weights)")
    if not where.exists():
        return "does not exist on this machine", None
    if not os.access(where, os.R_OK | (os.X_OK if where.is_dir() else 0)):
        return ("cannot be read by this user (permission denied)",
                "make it readable (chmod), or name another path")
    if is_model and not where.is_dir():
        return "is a file, not a model folder", saved_model
    if is_model and not (where / "config.json").is_file():
        if (where / "adapter_config.json").is_file():  # a LoRA job's export: SFT before DPO
            return layout.LORA_ADAPTER
        return "holds no config.json, so it is not a saved model", saved_model
    if is_model and not layout.holds_any(where, layout.SAVED_WEIGHTS):
        return (f"holds config.json but no weights ({', '.join(layout.SAVED_WEIGHTS)})",
                saved_model)
    if is_model and not layout.holds_any(where, layout.TOKENIZER_FILES):
        return (f"{layout.NO_TOKENIZER}, which the trainer reads from the model's folder",
                "save the model's tokenizer into it as well: "
                "tokenizer.save_pretrained(<the folder>)")
    if not is_model and where.is_file() and where.stat().st_size == 0:
        return "is empty", "write at least one record to it, or name another file"
    if not is_model:
        from finetune_trainer.uris import DATA_FILE_BUILDERS, data_file_builder

        kinds = ", ".join(DATA_FILE_BUILDERS)
        if where.is_file() and data_file_builder(where.name) is None:
            return (f"has an extension the trainer does not read ({where.suffix or 'none'})",
                    f"save it as one of {kinds}")
        if where.is_dir() and not any(data_file_builder(f.name) for f in where.rglob("*")):
            return f"holds no data file ({kinds})", "point it at a data file or a folder of them"
    return None, None


def _unwritable(where: Path) -> str | None:
    """Why `finetune run` could not write its output folder here, or None."""
    try:
        if where.exists() and not where.is_dir():
            return "is a file, not a folder"
        parent = where
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            return f"cannot be created: {_path(parent)} is a file"
        if not os.access(parent, os.W_OK | os.X_OK):
            return ("cannot be written by this user" if parent == where else
                    f"cannot be created: {_path(parent)} is not writable by this user")
    except OSError as error:
        return f"cannot be looked at on this machine ({error.strerror})"
    return None


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
    valid, invalid = _jobs_in((file,), "render", backend=backend)
    if invalid:
        sys.exit(EXIT_INVALID)
    objects = [obj for _, job in valid for obj in render(job)]
    if output == "json":
        click.echo(json.dumps(objects[0] if len(objects) == 1 else
                              {"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        click.echo(yamlio.dump_all(objects).rstrip())


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
    well-known models). Exits 0 when the job fits or the planner cannot tell, 1 when it
    is predicted not to fit, 2 when the manifest is invalid.

    \b
      finetune plan job.yaml --gpu-type A100-80GB      a manifest, on another GPU
      finetune plan --model meta-llama/Llama-3.1-8B --method full --gpus-per-node 8
      finetune plan --list-gpus                        what --gpu-type takes
      finetune plan --list-models                      what --model takes offline
    """
    from finetune_operator import planner
    from finetune_operator.planner import render as plan_render
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
    if model_name is not None:
        _usage_unless(file is None, "give FILE or --model, not both")
        job = _job_of_model(model_name, configs, why_offline, gpu_type, with_model)
    else:
        _usage_unless(file is not None, None)
        given = [name for name, value in with_model.items() if value is not None]
        _usage_unless(not given, f"{', '.join(given)}: only with --model (with FILE, the "
                                 "manifest's spec says it)")
        doc, job = _the_job_to_plan(file, gpu_type)
        configs.base_dir = doc.folder
    model = configs.resolve(job.spec.model.uri, job.spec.model.revision)
    result = plan_render.plan_with_notes(job, model, offline=why_offline, unanswered=(
        configs.unanswered(job.spec.model.uri, job.spec.model.revision)))
    if output == "json":
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(printable(plan_render.table(job, result)))
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
    from finetune_operator.planner import listing

    if output == "json":
        data = {"gpus": listing.gpus(), "vmSizes": listing.vm_sizes()} if list_gpus else {}
        click.echo(json.dumps({**data, **({"models": listing.models()} if list_models
                                          else {})}, indent=2))
        return
    tables = [listing.gpus_table()] if list_gpus else []
    click.echo("\n\n".join([*tables, *([listing.models_table()] if list_models else [])]))


def _the_job_to_plan(file: str, gpu_type: str | None) -> tuple[Document, FineTuneJob]:
    """The one FineTuneJob in `file`, its problems said (exit 2 when invalid); with
    `--gpu-type T`, as planned for T: the warnings about the spec's own gpuType are left
    out and those about T said instead."""
    from finetune_operator.validation import gpu_type_is_known

    said: list[tuple[str, Problem]] = []
    valid, invalid = _jobs_in((file,), "here", say=lambda where, p: said.append((where, p)))
    if invalid or len(valid) != 1:
        for where, problem in said:
            _say_problem(where, problem)
        if not invalid:
            click.echo(f"{file}: holds {len(valid)} FineTuneJobs — `finetune plan` takes one",
                       err=True)
        sys.exit(EXIT_INVALID)
    doc, job = valid[0]
    if gpu_type:
        _check_gpu_type_option(gpu_type, job)
        own = set(gpu_type_is_known(job))
        job = job.model_copy(deep=True)
        job.spec.resources.gpu_type = gpu_type
        said = [(w, p) for w, p in said if p not in own] + [
            (f"--gpu-type {gpu_type}", p) for p in gpu_type_is_known(job)]
    for where, problem in said:
        _say_problem(where, problem)
    return doc, job


def _job_of_model(name: str, configs: ModelConfigs, why_offline: str | None,
                  gpu_type: str | None, with_model: dict[str, int | str | None]
                  ) -> FineTuneJob:
    """`plan --model NAME`: the smallest FineTuneJob of that model (a manifest's defaults,
    one epoch, placeholder data and output), with the options given; exit 2 for a model
    whose config cannot be found, naming the table's closest names."""
    import re

    from finetune_operator.admission import admit
    from finetune_operator.api import API_VERSION, MAX_NAME_LENGTH

    local = Path(name).expanduser()
    uri = str(local.resolve()) if name.startswith((".", "/", "~")) or local.exists() else (
        "hf://" + name.removeprefix("hf://").strip("/"))
    if configs.resolve(uri) is None:
        _no_such_model(name, uri, why_offline, configs.unanswered(uri))
    named = local.resolve().parent if local.name == "config.json" else Path(uri)
    label = re.sub(r"[^a-z0-9]+", "-", named.name.lower())

    def given(**fields: int | str | None) -> dict[str, int | str]:
        return {key: value for key, value in fields.items() if value is not None}

    spec = {"model": {"uri": uri}, "hyperparameters": {"epochs": 1},
            "dataset": given(uri="pvc://data/train.jsonl", maxSeqLength=with_model["--seq-len"]),
            "method": given(type=with_model["--method"]), "output": {"uri": "pvc://output/plan"},
            "resources": given(gpusPerNode=with_model["--gpus-per-node"],
                               nodes=with_model["--nodes"], gpuType=gpu_type)}
    doc = {"apiVersion": API_VERSION, "kind": KIND, "spec": spec,
           "metadata": {"name": label[:MAX_NAME_LENGTH].strip("-") or "plan"}}
    admission = admit(doc, {}, "here")
    if admission.job is not None and gpu_type:
        _check_gpu_type_option(gpu_type, admission.job)
    for problem in admission.problems:
        _say_problem(f"--model {name}", problem)
    if admission.job is None or admission.errors:
        sys.exit(EXIT_INVALID)
    return admission.job


def _no_such_model(name: str, uri: str, why_offline: str | None,
                   unanswered: str | None = None) -> None:
    """`plan --model NAME` of a model whose config.json is nowhere to be had: exit 2;
    `unanswered`: why the hub, asked, gave none."""
    from finetune_operator.planner import known_models

    if not uri.startswith("hf://"):
        what = "holds no config.json that reads as JSON" if Path(uri).exists() else (
            "is no file or folder here (a hub model is org/name)")
        click.echo(f"--model {name}: {uri} {what}", err=True)
        sys.exit(EXIT_INVALID)
    close = known_models.close_names(name)
    hub = (f"the hub was not asked (offline: {why_offline})" if why_offline else
           f"the hub did not answer ({unanswered})" if unanswered else
           "the hub gave no config.json for it (not reached, no such repo, or a gated "
           "one: set HF_TOKEN)")
    click.echo(f"--model {name}: not in the planner's built-in table, and {hub} — "
               + (f"did you mean {' or '.join(close)}? " if close else "")
               + "(`finetune plan --list-models` lists the table; a local folder holding "
               "config.json works too)", err=True)
    sys.exit(EXIT_INVALID)


def _check_gpu_type_option(gpu_type: str, job: FineTuneJob) -> None:
    """`plan --gpu-type`, typed on the command line: a name the catalog does not know
    (a typo planned as `verdict: unknown`, exit 0) or a job of CPU workers (the option was
    ignored without a word) is refused, exit 2."""
    from finetune_operator import gpu_catalog as catalog

    if not job.spec.resources.on_gpus:
        click.echo(f"--gpu-type {gpu_type}: the job's workers are CPU processes "
                   "(spec.resources.gpusPerNode: 0) — set gpusPerNode to plan it on GPUs",
                   err=True)
        sys.exit(EXIT_INVALID)
    if catalog.find(gpu_type) is None:
        known, close = catalog.known_names(), catalog.close_names(gpu_type)
        click.echo(f"--gpu-type {gpu_type}: not in the planner's catalog — "
                   + (f"did you mean {' or '.join(close)}? " if close else "")
                   + f"(known: {', '.join(known)})", err=True)
        sys.exit(EXIT_INVALID)


def printable(text: str) -> str:
    """`text` with what a terminal cannot show or should not obey escaped: lone surrogates
    (valid in YAML strings, not in UTF-8) and control characters other than newlines."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode()
                   for c in text)


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

    Validates first, checks the model and data before any process starts, then trains
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
    from finetune_operator import local
    from finetune_trainer import trained_with

    doc, job = _the_job_to_run(file)
    model = local.model_config(job, doc.folder)
    gpus = local.visible_gpus()
    processes = nproc or local.default_processes(job, gpus)
    try:
        accumulation, differences = local.fit_to_machine(job, processes, gpus)
    except local.MachineMismatch as error:
        click.echo(f"{doc.source}: {error}", err=True)
        sys.exit(EXIT_INVALID)
    here = local.as_run_here(job, processes, accumulation)
    machine = local.this_machine(processes) if gpus and job.spec.resources.on_gpus else None
    config, step_settings, serving, ports = _config_here(doc, here, model, machine,
                                                         metrics_port)
    output_dir = Path(config.output.uri)
    lock = _hold_output(doc.source, output_dir)  # before anything in the folder changes
    if fresh and (moved := local.set_earlier_run_aside(output_dir)) is not None:
        aside, names = moved
        click.echo(f"--fresh: the earlier run's {', '.join(names)} are kept in {aside}; "
                   "starting over")
    if refused := trained_with.refusal(output_dir, config, local.START_OVER, doc.folder):
        click.echo(f"{doc.source}: {refused}", err=True)
        sys.exit(EXIT_INVALID)
    if not fresh and (done := local.already_done(output_dir, config)):
        click.echo(f"{doc.source}: {done}")
        sys.exit(0)
    config_path = local.write_config(config, output_dir)
    click.echo(f"{doc.source}: {_summary(here, 'this machine', on_gpus=bool(gpus))}")
    for difference in differences:
        click.echo(f"{doc.source}: {difference}", err=True)
    if machine is not None:
        click.echo(f"{doc.source}: step settings sized for this machine's "
                   f"{local.described(machine)}, not for spec.resources.gpuType")
    for note in step_settings.notes:
        click.echo(f"{doc.source}: {note}")
    for warning in local.plan_warnings(here if machine else job, model, machine):
        click.echo(f"{doc.source}: {warning}", err=True)
    click.echo(f"trainer config: {config_path}")
    click.echo(serving)
    from finetune_operator.follow import mark_failed, run_log

    _fetch_and_check(config, config_path, output_dir, verbose)
    restarts = job.spec.run_policy.backoff_limit
    click.echo(f"starting {processes} training process{'es' if processes > 1 else ''} "
               f"(a failed worker restarts them all from the newest checkpoint, up to "
               f"{restarts} time{'' if restarts == 1 else 's'}: spec.runPolicy.backoffLimit)")

    code = local.run_trainer(config_path, processes, run_log(output_dir),
                             max_restarts=restarts, verbose=verbose, lock=lock,
                             on_gpus=job.spec.resources.on_gpus)
    ports.close()  # held for the workers until now, restarts included
    if code == 0:
        click.echo(f"done: model in {output_dir / layout.FINAL_DIR}, checkpoints in "
                   f"{layout.checkpoint_root(output_dir)}, progress in "
                   f"{output_dir / layout.PROGRESS_FILE}")
    elif code == local.EXIT_STOPPED:
        click.echo(local.stopped_message(output_dir), err=True)
    else:
        mark_failed(output_dir)
        click.echo(f"training failed (exit {code}): {_failure_hint(code)}", err=True)
    sys.exit(code)


def _config_here(doc: Document, here: FineTuneJob, model, machine, metrics_port: int | None):
    """The trainer config of the job run `here`, its step settings, the line saying where
    its metrics are served and the hold on those ports (`local.PortHold`, kept until the
    run ends); or its problems said and exit 2."""
    from finetune_operator import local
    from finetune_operator.validation import InvalidJobError

    try:
        manifest = None if doc.path == "-" else str(Path(doc.path).resolve())
        config, step_settings = local.local_config(here, doc.folder, model, machine, manifest)
        config, serving, ports = local.serving_here(config, here.spec.resources.processes(),
                                                    metrics_port)
    except InvalidJobError as error:
        for problem in error.problems:
            click.echo(f"{doc.source}: {problem}", err=True)
        sys.exit(EXIT_INVALID)
    except local.PortTaken as error:
        click.echo(f"{doc.source}: {error}", err=True)
        sys.exit(EXIT_INVALID)
    return config, step_settings, serving, ports


def _failure_hint(code: int) -> str:
    from finetune_operator import local

    if code in local.NOT_RESTARTED:
        return "the line above names the setting; no restart would change it, so none was made"
    if code == local.EXIT_SETUP:
        return ("the line above says what the workers could not set up in this environment "
                "(an import, an op that cannot be built); restarts meet it again, so at most "
                "one was made")
    return "the line above names the rank and the cause; the log above has the rest"


def _the_job_to_run(file: str) -> tuple[Document, FineTuneJob]:
    """The manifest's one FineTuneJob, valid, with the model and data paths it reads on
    this machine there; else the problems said and exit 2."""
    valid, invalid = _jobs_in((file,), "here")
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


def _fetch_and_check(config: TrainerConfig, config_path: Path, output_dir: Path,
                     verbose: bool) -> None:
    """Before any worker: an hf:// model fetched into the output folder, then the model and
    data checked (the trainer's preflight); exits with their code when one fails, the run
    marked Failed (`finetune status` of the folder says so, not Stopped)."""
    from finetune_operator import local
    from finetune_operator.follow import run_log

    log = run_log(output_dir)
    local.RunLog(log).begin("finetune run")  # where this run's lines start
    if local.needs_fetch(config) and (fetched := local.run_step(
            local.fetch_command(config_path), log, verbose)) != 0:
        _stop_before_training(fetched, output_dir)
        sys.exit(fetched)  # 2: the name, revision or token; 1: the network or the disk
    if (checked := local.run_step(local.preflight_command(config_path), log, verbose)) != 0:
        _stop_before_training(checked, output_dir)
        sys.exit(checked)  # 2: the model or the data; 1: anything else (the traceback said)


def _stop_before_training(code: int, output_dir: Path) -> None:
    """A step before the workers failed (the run is marked Failed: `finetune status` says
    so) or was interrupted (Ctrl-C: nothing failed; one line, exit 143 as in training)."""
    from finetune_operator import local
    from finetune_operator.follow import mark_failed

    if code == local.EXIT_STOPPED:
        click.echo(local.stopped_message(output_dir), err=True)
        sys.exit(code)
    mark_failed(output_dir)


def _hold_output(source: str, output_dir: Path) -> int | None:
    """The output folder's lock for this run (`run_lock.hold`), or exit 2 naming the run
    that writes it."""
    from finetune_operator import run_lock

    try:
        return run_lock.hold(output_dir)
    except run_lock.FolderInUse as error:
        click.echo(f"{source}: spec.output.uri: {error} — wait for it to end, stop it (Ctrl-C "
                   "where it runs: it checkpoints first), or give this run another "
                   "spec.output.uri", err=True)
        sys.exit(EXIT_INVALID)


@main.command(name="operator")
@click.option("--all-namespaces", "-A", "all_namespaces", is_flag=True,
              help="Watch every namespace (the default when no --namespace is given).")
@click.option("--namespace", "-n", "namespaces", multiple=True, metavar="NS",
              help="Watch only this namespace; repeat for several.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@click.option("--metrics-port", type=int, default=8080, show_default=True,
              help="Port of the operator's Prometheus /metrics.")
@click.option("--health-port", type=int, default=8081, show_default=True,
              help="Port of /healthz (the liveness probe).")
@click.option("--interval", type=float, default=10.0, show_default=True,
              help="Seconds between looks at what no watch reports: rank 0's progress while "
                   "a job runs, why pods are not created, Azure ML jobs (idle jobs are not "
                   "polled).")
@click.option("--reconcilers", type=click.IntRange(1, 256), default=16, show_default=True,
              help="FineTuneJobs reconciled at once: what bounds the operator's API calls in "
                   "flight however many jobs change together.")
@click.option("--launch-rate", type=click.FloatRange(min=0), default=LAUNCH_RATE,
              show_default=True,
              help="Jobs launched a second once --launch-burst have launched at once (0: no "
                   "limit). A job waiting for its turn is Pending and says when it comes.")
@click.option("--launch-burst", type=click.IntRange(min=1), default=LAUNCH_BURST,
              show_default=True,
              help="Jobs launched at once before --launch-rate paces the rest.")
@click.option("--peering", metavar="NAME", default=None,
              help="Run as one of several replicas: the kopf peering object NAME elects the "
                   "one that acts; the others stand by (the chart sets this when replicas > 1).")
def operator_command(all_namespaces: bool, namespaces: tuple[str, ...], log_level: str,
                     metrics_port: int, health_port: int, interval: float, reconcilers: int,
                     launch_rate: float, launch_burst: int, peering: str | None) -> None:
    """Run the controller: watches FineTuneJobs and runs them on their backend.

    Logs in as kubectl does: the pod's service account inside a cluster, else KUBECONFIG
    (or ~/.kube/config). Worker settings (trainer image, GPU taint, ...) come from
    FINETUNE_* variables (Helm values).
    """
    import asyncio
    import logging

    from finetune_operator import controller, kube, planner
    from finetune_operator.settings import OperatorSettings

    if all_namespaces and namespaces:
        raise click.UsageError("use either --all-namespaces or --namespace, not both")
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    client = kube.Kube()
    runtime = controller.Runtime.build(client, OperatorSettings.from_env(), interval=interval,
                                       reconcilers=reconcilers, launch_rate=launch_rate,
                                       launch_burst=launch_burst)
    # the planner reads config.json from the hub (HF_HUB_OFFLINE=1 turns that off)
    runtime.model_configs = planner.ModelConfigs(fetch=planner.fetch_from_hub)

    async def serve() -> None:
        try:  # one clear line, not kopf's retry loop, when the cluster cannot be used at all
            for warning in await kube.check_access(client, namespaces):
                logging.getLogger("finetune_operator").warning("%s", warning)
        except kube.LoginError as error:
            click.echo(f"finetune operator: {error}", err=True)
            sys.exit(1)
        finally:
            await client.close()  # the operator opens its own connections
        for port, option in ((health_port, "--health-port"), (metrics_port, "--metrics-port")):
            if port and not _port_free(port):
                click.echo(f"finetune operator: port {port} is in use ({option}) — choose "
                           f"another with {option}", err=True)
                sys.exit(1)
        runtime.metrics.serve(metrics_port)
        await controller.run(runtime, namespaces=namespaces, liveness_port=health_port,
                             peering=controller.Peering(peering) if peering else None)

    asyncio.run(serve())


KUBECONFIG_HELP = "Kubeconfig to use (default: KUBECONFIG, then ~/.kube/config)."
NAMESPACE_HELP = "Namespace of the FineTuneJob (default: the kubeconfig context's)."


class Screen:
    """One block of lines, redrawn in place on a terminal; elsewhere (a pipe, a CI log)
    printed again only when something other than the clock changed."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.height = 0
        self.last: list[str] | None = None

    def show(self, lines: list[str]) -> None:
        if self.tty:
            if self.height:
                sys.stdout.write(f"\x1b[{self.height}F\x1b[J")  # back up, clear below
            sys.stdout.write("\n".join(lines) + "\n")
            self.height = len(lines)
        elif lines[:-1] != self.last:
            sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        self.last = lines[:-1]


@main.command(name="status")
@click.argument("target", metavar="NAME")
@click.option("-n", "--namespace", help=NAMESPACE_HELP)
@click.option("--kubeconfig", help=KUBECONFIG_HELP)
@click.option("-w", "--watch", is_flag=True,
              help="Follow the job until it succeeds or fails (exit 0 or 1).")
@click.option("--interval", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="Seconds between looks with --watch.")
def status_command(target: str, namespace: str | None, kubeconfig: str | None, watch: bool,
                   interval: float) -> None:
    """A FineTuneJob's phase, progress bar (step / total, loss, tokens/s, ETA), restarts,
    conditions and last events; a FineTuneSweep's trials (phase, step, objective, values)
    and best trial. NAME may also be the output folder of `finetune run`, or the manifest
    it ran: then no cluster is asked. Exits 1 for a job that failed or stopped, 0 otherwise
    (a job no operator has acted on yet is said so)."""
    import asyncio

    from finetune_operator import follow

    here = _local_target("status", target, namespace, kubeconfig)
    client, cluster_errors = None, ()  # a run on this machine asks no cluster: no client
    if not here:
        from finetune_operator import kube

        client, cluster_errors = kube.Kube(kubeconfig), (kube.LoginError, kube.KubeError)
        namespace = namespace or kube.default_namespace(kubeconfig)

    async def look_once() -> follow.JobView | None:
        if here:
            return follow.view_of_output(*here)
        return await follow.look(client, namespace, target)

    async def follow_job() -> int:
        screen = Screen()
        try:
            while True:
                view = await look_once()
                if view is None:
                    click.echo(f"finetune status: no FineTuneJob or FineTuneSweep {target} in "
                               f"namespace {namespace} — `kubectl get ftj,ftsweep -n "
                               f"{namespace}` lists them", err=True)
                    return 1
                screen.show(follow.render(view))
                if not watch:  # a script's check: 1 for a job that failed or stopped
                    return follow.FINISHED.get(view.phase or "", 0)
                if view.finished:
                    return follow.FINISHED[view.phase]
                await asyncio.sleep(interval)
        except cluster_errors as error:
            click.echo(_cluster_error("status", error), err=True)
            return 1
        except follow.NotARun as error:
            click.echo(f"finetune status: {error}", err=True)
            return 1
        finally:
            if client is not None:
                await client.close()

    try:
        sys.exit(asyncio.run(follow_job()))
    except KeyboardInterrupt:
        sys.exit(130)


def _local_target(command: str, target: str, namespace: str | None,
                  kubeconfig: str | None) -> tuple[str, Path] | None:
    """`follow.output_folder` unless a cluster was named; a path that names no run: exit 1."""
    from finetune_operator import follow

    if namespace is not None or kubeconfig is not None:
        return None
    try:
        return follow.output_folder(target)
    except follow.NotARun as error:
        click.echo(f"finetune {command}: {error}", err=True)
        sys.exit(1)


def _cluster_error(command: str, error: Exception) -> str:
    """The line for a failed call to the cluster; one that could not log in at all also
    says how a `finetune run` on this machine is named instead."""
    from finetune_operator import kube

    line = f"finetune {command}: {error}"
    if isinstance(error, kube.KubeError) and error.status == 401:
        line += f" — {kube.EXPIRED_TOKEN}"
    elif isinstance(error, kube.KubeError) and error.status == 403:
        line += (" — your identity may not read FineTuneJobs there: ask for a Role allowing "
                 "get and list on finetunejobs, pods and pods/log (`kubectl auth can-i get "
                 "finetunejobs -n <namespace>` checks)")
    elif isinstance(error, kube.KubeError) and error.status is None:
        line += f" — {kube.UNREACHABLE}"
    if isinstance(error, kube.LoginError):
        line += (f"; or, for a `finetune run` on this machine, name its manifest or output "
                 f"folder (`finetune {command} job.yaml`)")
    return line


UNSEEN_SAID_AFTER = 10
"""Seconds `finetune logs -f` waits for an operator to take up a job with no status before it
says none has (and goes on waiting: one may be starting)."""


@main.command(name="export")
@click.argument("output", metavar="OUTPUT", type=click.Path(path_type=Path))
@click.argument("target", metavar="TARGET")
@click.option("--merged", is_flag=True,
              help="Export merged/ (the base with the adapter merged in, from "
              "spec.output.mergeAdapter) instead of final/.")
@click.option("--plain-http", is_flag=True,
              help="Talk to the registry over plain HTTP (a local registry without TLS; "
              "oci:// only).")
def export_command(output: Path, target: str, merged: bool, plain_http: bool) -> None:
    """Push a trained model to TARGET: `oci://registry/repository:tag`, one image that
    KAITO's adapters and `oras pull` read (files under data/, the model card with them), or
    `hf://owner/name`, a commit to that Hugging Face Hub repository (created private when
    it does not exist; its README.md the model card).

    OUTPUT: a job's output folder (its final/ is pushed) or a model folder. Credentials:
    Docker's config (`docker login`, `oras login`, REGISTRY_AUTH_FILE), or for the hub
    HF_TOKEN (or `hf auth login`); another hub: HF_ENDPOINT; a private CA: REQUESTS_CA_BUNDLE.
    """
    from finetune_trainer.export import ExportError, export, model_folder

    try:
        export(model_folder(output, merged), target, plain_http=plain_http)
    except ExportError as error:
        raise click.ClickException(str(error)) from None


@main.command(name="logs")
@click.argument("target", metavar="NAME")
@click.option("-n", "--namespace", help=NAMESPACE_HELP)
@click.option("--kubeconfig", help=KUBECONFIG_HELP)
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="Node rank whose pod to read (its torchrun holds that node's processes).")
@click.option("-f", "--follow", "keep_following", is_flag=True,
              help="Keep printing as the workers write, until they end.")
def logs_command(target: str, namespace: str | None, kubeconfig: str | None, rank: int,
                 keep_following: bool) -> None:
    """The trainer's log: of one node's pod on a cluster, the Azure ML job's (where to read
    it), or of `finetune run` (NAME: its output folder or manifest; every process)."""
    import asyncio

    from finetune_operator import follow

    here = _local_target("logs", target, namespace, kubeconfig)
    if here:
        sys.exit(_local_logs(follow.run_log(here[1]), here[1], keep_following))
    from finetune_operator import kube

    client = kube.Kube(kubeconfig)
    namespace = namespace or kube.default_namespace(kubeconfig)

    async def read() -> int:
        from finetune_operator import naming
        from finetune_operator.backends.kubernetes import COMPLETION_INDEX_KEY, TRAINER_CONTAINER

        try:
            obj = await client.get(KIND, namespace, target)
            if obj is None:
                click.echo(f"finetune logs: no FineTuneJob {target} in namespace {namespace}",
                           err=True)
                return 1
            if obj["spec"].get("backend") == "azureml":
                click.echo(follow.azureml_logs_hint(obj))
                return 0
            read: list[tuple[str, str]] = []  # (pod, init container) whose logs were read
            waited = 0
            while True:
                pods = await client.pods(namespace, f"{naming.LABEL_JOB}={target}")
                pod = follow.newest_pod(pods, rank, COMPLETION_INDEX_KEY)
                phase = (obj.get("status") or {}).get("phase") or "Pending"
                if pod is None and keep_following and phase not in follow.FINISHED:
                    if waited == UNSEEN_SAID_AFTER and not follow.seen_by_an_operator(obj):
                        click.echo(f"finetune logs: {_no_pod(target, obj, rank)}", err=True)
                    await asyncio.sleep(1)  # applied a moment ago: its workers are coming
                    waited += 1
                    obj = await client.get(KIND, namespace, target) or obj
                    continue
                if pod is None:
                    click.echo(f"finetune logs: {_no_pod(target, obj, rank)}", err=True)
                    return 1
                name = pod["metadata"]["name"]
                container, waiting = follow.log_to_read(
                    pod, TRAINER_CONTAINER, [c for p, c in read if p == name])
                if container is None and keep_following and waiting in (
                        "waiting: PodInitializing", "waiting: ContainerCreating") and (
                        pod.get("status") or {}).get("phase") == "Pending":
                    await asyncio.sleep(1)  # the next container is on its way
                    continue
                if container is None:
                    click.echo(f"finetune logs: pod {name} has not started its trainer yet "
                               f"({waiting}) — `finetune status {target} -n {namespace}` says "
                               "what it waits for", err=True)
                    return 0 if read else 1
                if container != TRAINER_CONTAINER:
                    failed = (pod.get("status") or {}).get("phase") == "Failed"
                    click.echo(f"finetune logs: pod {name} {'failed in' if failed else 'runs'} "
                               f"its init container {container}, before the trainer: its log",
                               err=True)
                if not await _print_log(client, namespace, name, container, keep_following):
                    return 1
                if container == TRAINER_CONTAINER or not keep_following:
                    return 0
                read.append((name, container))
        except (kube.LoginError, kube.KubeError) as error:
            click.echo(_cluster_error("logs", error), err=True)
            return 1
        finally:
            await client.close()

    try:
        sys.exit(asyncio.run(read()))
    except KeyboardInterrupt:
        sys.exit(130)


def _no_pod(target: str, obj: dict, rank: int) -> str:
    """Why a FineTuneJob has no pod of node `rank` to read a log from."""
    from finetune_operator import follow

    if not follow.seen_by_an_operator(obj):
        return f"{target} has no pods: {follow.NOT_SEEN}"
    nodes = ((obj["spec"].get("resources") or {}).get("nodes")) or 1
    ranks = f"0 to {nodes - 1}" if nodes > 1 else "0"
    return (f"{target} has no pod of node rank {rank} (phase {obj['status']['phase']}; its "
            f"node ranks are {ranks}: spec.resources.nodes)")


async def _print_log(client: Kube, namespace: str, pod: str, container: str,
                     keep_following: bool) -> bool:
    """One container's log onto stdout (to its end with `keep_following`); False, said on
    stderr, where the node's kubelet could not serve it."""
    from finetune_operator import kube

    try:
        async for chunk in client.pod_log(namespace, pod, container, follow=keep_following):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
    except kube.KubeError as error:
        if error.status is None or error.status < 500:
            raise
        click.echo(f"finetune logs: read the log of pod {pod}: {error.message} — the API "
                   "server could not get it from the node's kubelet (the fake nodes of "
                   "`make cluster` have none)", err=True)
        return False
    return True


def _local_logs(path: Path, output_dir: Path, keep_following: bool) -> int:
    """`finetune run`'s log; with -f, read on until the run's progress says it ended."""
    import time


    if not path.exists() and not keep_following:
        click.echo(f"finetune logs: no {path}: `finetune run` has not run here", err=True)
        return 1
    offset = 0
    while True:
        chunk = b""
        if path.exists():
            with path.open("rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            offset += len(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        if not keep_following or (_run_ended(output_dir) and not chunk):
            return 0
        time.sleep(0.5)


def _run_ended(output_dir: Path) -> bool:
    """Whether the `finetune run` writing `output_dir` ended (False: none started yet)."""
    from finetune_operator import follow

    try:
        return follow.view_of_output(output_dir.name, output_dir).finished
    except follow.NotARun:
        return False


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


if __name__ == "__main__":
    main()
