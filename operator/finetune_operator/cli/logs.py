"""`finetune logs`: the trainer's log, of one node's pod on a cluster (init containers that
run first included), where an Azure ML job keeps it, or of a `finetune run`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from finetune_operator import naming
from finetune_operator.api import KIND, SWEEP_KIND
from finetune_operator.cli.common import (
    KUBECONFIG_HELP,
    NAMESPACE_HELP,
    Target,
    cluster_error,
    target_of,
)
from finetune_operator.cli.group import main

if TYPE_CHECKING:
    from finetune_operator.kube import Kube

UNSEEN_SAID_AFTER = 10
"""Seconds `finetune logs -f` waits for an operator to take up a job with no status before it
says none has (and goes on waiting: one may be starting)."""


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
    import asyncio  # ~20 ms at every start: only the commands that wait on a cluster

    from finetune_operator import follow  # ~8 ms at every start: only status and logs read it

    named = target_of("logs", target, namespace, kubeconfig)
    _not_a_pods_log(named, target, rank, keep_following)
    from finetune_operator import kube  # the cluster's client (aiohttp): not for a run's log

    client = kube.Kube(kubeconfig)
    namespace = named.namespace or namespace or kube.default_namespace(kubeconfig)
    target = named.name

    async def read() -> int:
        # the backends: only for a cluster's job (workers' names: only for a pod's log)
        from finetune_operator.backends import installed_rules
        from finetune_operator.backends.kubernetes import workers

        try:
            obj = await client.get(KIND, namespace, target)
            if obj is None:
                return await _not_there(client, namespace, target)
            rules = installed_rules().get(obj["spec"].get("backend", ""))
            if rules is not None and rules.logs_hint is not None:  # not in pods: said where
                click.echo(rules.logs_hint(obj))
                return 0
            read: list[tuple[str, str]] = []  # (pod, init container) whose logs were read
            waited = 0
            while True:
                pods = await client.pods(namespace, f"{naming.LABEL_JOB}={target}")
                pod = follow.newest_pod(pods, rank, workers.COMPLETION_INDEX_KEY)
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
                    pod, workers.TRAINER_CONTAINER, [c for p, c in read if p == name])
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
                if container != workers.TRAINER_CONTAINER:
                    failed = (pod.get("status") or {}).get("phase") == "Failed"
                    click.echo(f"finetune logs: pod {name} {'failed in' if failed else 'runs'} "
                               f"its init container {container}, before the trainer: its log",
                               err=True)
                if not await _print_log(client, namespace, name, container, keep_following):
                    return 1
                if container == workers.TRAINER_CONTAINER or not keep_following:
                    return 0
                read.append((name, container))
        except (kube.LoginError, kube.KubeError) as error:
            click.echo(cluster_error("logs", error), err=True)
            return 1
        finally:
            await client.close()

    try:
        sys.exit(asyncio.run(read()))
    except KeyboardInterrupt:
        sys.exit(130)


async def _not_there(client: Kube, namespace: str, target: str) -> int:
    """No FineTuneJob of that name in the namespace asked: said, with where it is if
    elsewhere; exit 1."""
    from finetune_operator import follow  # as in logs_command

    where = follow.elsewhere(await follow.namespaces_holding(client, (KIND,), target,
                                                             namespace))
    click.echo(f"finetune logs: no FineTuneJob {target} in namespace {namespace}{where}",
               err=True)
    return 1


def _not_a_pods_log(named: Target, target: str, rank: int, keep_following: bool) -> None:
    """A NAME whose log is no pod's: a `finetune run`'s (printed, then exit) or a sweep's
    (it has none: exit 1)."""
    from finetune_operator import follow  # as in logs_command

    if named.folder is not None:
        if rank:
            raise click.BadParameter(f"{rank}: a `finetune run` is one node, rank 0, and its "
                                     "log holds every process's lines — leave --rank out",
                                     param_hint="--rank")
        sys.exit(_local_logs(follow.run_log(named.folder), named.folder, keep_following))
    if named.kind == SWEEP_KIND:
        click.echo(f"finetune logs: {target} is a FineTuneSweep, whose trials are FineTuneJobs "
                   f"with logs of their own — `finetune status {named.name}"
                   f"{f' -n {named.namespace}' if named.namespace else ''}` lists them",
                   err=True)
        sys.exit(1)


def _no_pod(target: str, obj: dict, rank: int) -> str:
    """Why a FineTuneJob has no pod of node `rank` to read a log from."""
    from finetune_operator import follow  # as in logs_command

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
    from finetune_operator import kube  # as in logs_command

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
    from finetune_operator import follow  # as in logs_command

    try:
        return follow.view_of_output(output_dir.name, output_dir).finished
    except follow.NotARun:
        return False
