"""`finetune status`: a FineTuneJob's or FineTuneSweep's look, once or followed, from a
cluster or from the output folder of a `finetune run`. What is shown is `follow`'s."""

from __future__ import annotations

import json
import sys

import click

from finetune_operator.api import KIND, SWEEP_KIND
from finetune_operator.cli.common import (
    KUBECONFIG_HELP,
    NAMESPACE_HELP,
    cluster_error,
    target_of,
)
from finetune_operator.cli.group import main


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


class JsonLines:
    """`-o json`: each look as one line of JSON, printed again only when it changed (there
    is no clock in it to change)."""

    def __init__(self) -> None:
        self.last: str | None = None

    def show(self, view: dict) -> None:
        line = json.dumps(view)
        if line != self.last:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        self.last = line


@main.command(name="status")
@click.argument("target", metavar="NAME")
@click.option("-n", "--namespace", help=NAMESPACE_HELP)
@click.option("--kubeconfig", help=KUBECONFIG_HELP)
@click.option("-w", "--watch", is_flag=True,
              help="Follow the job until it succeeds or fails (exit 0 or 1).")
@click.option("--interval", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="Seconds between looks with --watch.")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
              show_default=True,
              help="json: one object per look on one line (phase, message, progress as "
                   "status.progress names it, restarts, conditions, events), for scripts; "
                   "with --watch, a line each time it changed.")
def status_command(target: str, namespace: str | None, kubeconfig: str | None, watch: bool,
                   interval: float, output: str) -> None:
    """A FineTuneJob's phase, progress bar (step / total, loss, tokens/s, ETA), restarts,
    conditions and last events; a FineTuneSweep's trials (phase, step, objective, values)
    and best trial. NAME may also be the output folder of `finetune run`, or the manifest
    it ran: then no cluster is asked. Exits 1 for a job that failed or stopped, 0 otherwise
    (a job no operator has acted on yet is said so)."""
    import asyncio  # ~20 ms at every start: only the commands that wait on a cluster

    from finetune_operator import follow  # ~8 ms at every start: only status and logs read it

    named = target_of("status", target, namespace, kubeconfig)
    client, cluster_errors = None, ()  # a run on this machine asks no cluster: no client
    if named.folder is None:
        from finetune_operator import kube  # the cluster's client (aiohttp): not for a run's

        client, cluster_errors = kube.Kube(kubeconfig), (kube.LoginError, kube.KubeError)
        namespace = named.namespace or namespace or kube.default_namespace(kubeconfig)

    async def look_once() -> follow.JobView | None:
        if named.folder is not None:
            return follow.view_of_output(named.name, named.folder)
        return await follow.look(client, namespace, named.name)

    async def follow_job() -> int:
        screen = Screen() if output == "text" else JsonLines()
        try:
            while True:
                view = await look_once()
                if view is None:
                    assert client is not None  # a run's folder always has a view
                    where = follow.elsewhere(await follow.namespaces_holding(
                        client, (KIND, SWEEP_KIND), named.name, namespace))
                    click.echo(f"finetune status: no FineTuneJob or FineTuneSweep {named.name} in "
                               f"namespace {namespace}" + (where or f" — `kubectl get "
                               f"ftj,ftsweep -n {namespace}` lists them"), err=True)
                    return 1
                screen.show(follow.render(view) if output == "text" else follow.as_json(view))
                if not watch:  # a script's check: 1 for a job that failed or stopped
                    return follow.FINISHED.get(view.phase or "", 0)
                if view.finished:
                    return follow.FINISHED[view.phase]
                await asyncio.sleep(interval)
        except cluster_errors as error:
            click.echo(cluster_error("status", error), err=True)
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
