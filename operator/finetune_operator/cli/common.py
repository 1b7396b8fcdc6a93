"""What several commands share: reading manifests into admitted jobs (`jobs_in`), saying a
problem, the one-line summary of a job, and the lines of a failed call to a cluster."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import click

from finetune_operator.admission import admit, offline_backends, said_by_validate
from finetune_operator.api import (
    KIND,
    SWEEP_KIND,
    FineTuneJob,
    FineTuneSweep,
    Scalar,
    SearchParameter,
)
from finetune_operator.manifests import (
    MANIFEST_SUFFIXES,
    Document,
    ManifestError,
    manifest_paths,
    read_documents,
)
from finetune_operator.sweep import check_sweep, grid_values, with_params
from finetune_operator.validation import Problem, short_repr

KUBECONFIG_HELP = "Kubeconfig to use (default: KUBECONFIG, then ~/.kube/config)."
NAMESPACE_HELP = "Namespace of the FineTuneJob (default: the kubeconfig context's)."


def say_problem(source: str, problem: Problem) -> None:
    if not problem.path:  # the file itself (cannot be read, not YAML): says where already
        click.echo(problem.message, err=True)
        return
    prefix = "warning: " if problem.severity == "warning" else ""
    click.echo(f"{source}: {prefix}{problem}", err=True)


Use = Literal["validate", "render", "here", "plan"]


def _sweep_valid(doc: Document, say: Callable[[str, Problem], None]) -> FineTuneSweep | None:
    """`validate` of a FineTuneSweep: its own fields, its template, and every searched
    value set into the template (`sweep.check_sweep`, what the operator checks); the sweep
    when it is valid."""
    sweep, problems = check_sweep(doc.data)
    for problem in problems:
        say(doc.source, problem)
    if sweep is None or any(p.severity == "error" for p in problems):
        return None
    spec = sweep.spec
    click.echo(f"{doc.source}: valid {SWEEP_KIND} {sweep.name}: up to {spec.max_trials} "
               f"trials, {min(spec.parallel_trials, spec.max_trials)} at once, "
               f"{spec.sampling} sampling of {', '.join(spec.search_space)}",
               err=say is not say_problem)  # `-o json` keeps standard output JSON
    return sweep


def jobs_in(paths: tuple[str, ...], use: Use, backend: str | None = None,
            say: Callable[[str, Problem], None] = say_problem,
            sweeps: list[tuple[Document, FineTuneSweep]] | None = None,
            ) -> tuple[list[tuple[Document, FineTuneJob]], int]:
    """Check every FineTuneJob in `paths` (files, folders of them as `kubectl apply -f`
    takes them, `-`), telling `say` each problem; returns the valid jobs and the number of
    invalid documents. `use`: `validate` and `render` check what the operator checks, the
    backend's refusals included (`admission.admit`), so the two agree; `validate` leaves
    out the backend's refusal of relative paths, which it reports as one warning (they are
    for `finetune run`). `here`: `finetune run` on this machine, without the cluster-only
    rules; `plan`: as `here`, and a FineTuneSweep stands for its largest trial
    (`largest_trial`). `backend`: check them as if `spec.backend` said so (`render
    --backend`). `sweeps`: where `validate` puts the valid FineTuneSweeps."""
    valid: list[tuple[Document, FineTuneJob]] = []
    invalid = 0
    installed = offline_backends() if use in ("validate", "render") else {}  # names only
    for path in paths:
        files = manifest_paths(path)
        if not files:
            say(path, Problem("", f"{path}: holds no manifest — put FineTuneJobs in its "
                              f"{', '.join(MANIFEST_SUFFIXES)} files", "add a manifest"))
            invalid += 1
            continue
        taken, unread, sweeps_skipped = 0, 0, False
        for file in files:
            try:
                documents = read_documents(file)
            except ManifestError as error:
                say(file, Problem("", str(error), "fix the file"))
                invalid, unread = invalid + 1, unread + 1
                continue
            for doc in documents:
                counted, ok, job = _checked(doc, use, backend, installed, say, sweeps)
                sweeps_skipped |= not counted and _kind_of(doc) == SWEEP_KIND
                taken, invalid = taken + counted, invalid + (counted and not ok)
                if job is not None:
                    valid.append((doc, job))
        if taken == 0 and not unread and sweeps_skipped:  # the kind is right, the command not
            say(path, Problem("", f"{path}: no {KIND} found, a {SWEEP_KIND} only — apply it to "
                              "a cluster, whose operator makes its trials",
                              "apply it to a cluster"))
            invalid += 1
        elif taken == 0 and not unread:  # a problem of the file: in `validate -o json` too
            say(path, Problem("", f"{path}: no {KIND} found — check `kind: {KIND}`",
                              f"check `kind: {KIND}`"))
            invalid += 1
    return valid, invalid


def _checked(doc: Document, use: Use, backend: str | None, installed: dict,
             say: Callable[[str, Problem], None],
             sweeps: list[tuple[Document, FineTuneSweep]] | None = None,
             ) -> tuple[bool, bool, FineTuneJob | None]:
    """One document: (a job or sweep the command takes, it is valid, the job if one); a
    valid sweep is added to `sweeps`."""
    data = doc.data
    if use == "validate" and isinstance(data, dict) and data.get("kind") == SWEEP_KIND:
        sweep = _sweep_valid(doc, say)
        if sweep is not None and sweeps is not None:
            sweeps.append((doc, sweep))
        return True, sweep is not None, None
    if (use == "plan" and isinstance(data, dict) and data.get("kind") == SWEEP_KIND
            and (data := largest_trial(doc, say)) is None):
        return True, False, None
    if isinstance(data, dict) and data.get("kind") not in (None, KIND):
        _say_skipped(doc)
        return False, True, None
    if backend and isinstance(data, dict) and isinstance(data.get("spec"), dict):
        data["spec"]["backend"] = backend
    admission = admit(data, installed, "cluster" if use in ("validate", "render") else "here")
    job, problems = admission.job, admission.problems
    if use == "validate":
        problems = said_by_validate(problems)
    for problem in problems:
        say(doc.source, problem)
    ok = job is not None and not any(p.severity == "error" for p in problems)
    return True, ok, job if ok else None


def largest_trial(doc: Document, say: Callable[[str, Problem], None]) -> dict | None:
    """A FineTuneSweep's trial that needs the most memory, for `finetune plan`: its
    template, named as the sweep, with every searched number at its largest
    (`largest_values`); None, its problems said, for a sweep `finetune validate` refuses."""
    sweep, problems = check_sweep(doc.data)
    for problem in problems:
        say(doc.source, problem)
    if sweep is None or any(p.severity == "error" for p in problems):
        return None
    metadata = {"name": sweep.name, "namespace": sweep.namespace,
                "labels": sweep.metadata.labels, "annotations": sweep.metadata.annotations}
    return {"apiVersion": sweep.api_version, "kind": KIND, "metadata": metadata,
            "spec": with_params(sweep.spec.template.to_dict(),
                                largest_values(sweep.spec.search_space))}


def largest_values(space: dict[str, SearchParameter]) -> dict[str, Scalar]:
    """Each searched field whose values are numbers at its largest: a larger LoRA rank,
    batch or sequence length only needs more memory. Text and booleans have no largest:
    those fields keep the template's value."""
    largest: dict[str, Scalar] = {}
    for path, parameter in space.items():
        values = [parameter.max] if parameter.type in ("uniform", "logUniform") else (
            grid_values(parameter))
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if numbers:
            largest[path] = max(numbers)
    return largest


def _kind_of(doc: Document) -> object:
    return doc.data.get("kind") if isinstance(doc.data, dict) else None


def _say_skipped(doc: Document) -> None:
    """A document of another kind than the command takes: one line, then the next."""
    kind = doc.data.get("kind")
    meant = next((k for k in (KIND, SWEEP_KIND) if isinstance(kind, str)
                  and kind.lower() == k.lower()), None)
    if kind == SWEEP_KIND:  # spelled right, but this command takes jobs
        click.echo(f"{doc.source}: skipped {SWEEP_KIND} (this command takes {KIND}s: a "
                   "sweep's trials, its spec.template with the searched values set, run on "
                   "a cluster; `finetune validate` checks it, `finetune plan` sizes its "
                   "largest trial)", err=True)
        return
    click.echo(f"{doc.source}: skipped {plain(kind)} (not a {KIND}"
               + (f"; kinds are case-sensitive: `kind: {meant}`?" if meant else "")
               + ")", err=True)


def plain(value: object, longest: int = 80) -> str:
    """`value` as it is when printable and at most `longest` characters, else quoted and cut
    short: a value from the manifest may hold a newline (a forged line), escapes, or
    megabytes."""
    is_plain = isinstance(value, str) and value.isprintable() and len(value) <= longest
    return value if is_plain else short_repr(value)


def summary(job: FineTuneJob, where: str | None = None, on_gpus: bool = True) -> str:
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


def printable(text: str) -> str:
    """`text` with what a terminal cannot show or should not obey escaped: lone surrogates
    (valid in YAML strings, not in UTF-8) and control characters other than newlines."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode()
                   for c in text)


@dataclass(frozen=True)
class Target:
    """What a NAME of `status` and `logs` names: a run on this machine (its output folder),
    or an object on a cluster (a manifest's own namespace, unless `-n` named one)."""

    name: str
    folder: Path | None = None
    namespace: str | None = None
    kind: str = KIND


def target_of(command: str, target: str, namespace: str | None,
              kubeconfig: str | None) -> Target:
    """`follow.output_folder`'s reading of NAME. `-n` or `--kubeconfig` names a cluster: a
    bare NAME is asked of it, even where a folder of that name is here, and a manifest of a
    cluster's job or sweep asks it for that object; a path to a run on this machine is still
    read here, said so. A path that names no run: exit 1."""
    from finetune_operator import follow  # ~8 ms at every start: only status and logs read it

    cluster_named = namespace is not None or kubeconfig is not None
    if cluster_named and not follow.looks_local(target):
        return Target(target)
    try:
        found = follow.output_folder(target)
    except follow.OnItsCluster as elsewhere:
        if not cluster_named:
            click.echo(f"finetune {command}: {elsewhere}", err=True)
            sys.exit(1)
        return Target(elsewhere.name, namespace=namespace or elsewhere.namespace,
                      kind=elsewhere.kind)
    except follow.NotARun as error:
        click.echo(f"finetune {command}: {error}", err=True)
        sys.exit(1)
    if found is None:
        return Target(target)
    if cluster_named:
        flags = " and ".join(flag for flag, value in (("-n", namespace),
                                                       ("--kubeconfig", kubeconfig))
                             if value is not None)
        click.echo(f"finetune {command}: {target} is a `finetune run` on this machine: read "
                   f"here, {flags} not used", err=True)
    return Target(found[0], folder=found[1])


def cluster_error(command: str, error: Exception) -> str:
    """The line for a failed call to the cluster; one that could not log in at all also
    says how a `finetune run` on this machine is named instead."""
    from finetune_operator import kube  # the cluster's client (aiohttp): not for `run`, `plan`

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
