"""`finetune operator`: the controller, run from the command line (the chart's pod runs it
too). Named `operate` so that no module of the package is called `operator`."""

from __future__ import annotations

import socket
import sys

import click

from finetune_operator.cli.group import main
from finetune_operator.controller.pacing import LAUNCH_BURST, LAUNCH_RATE


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
    import asyncio  # ~20 ms at every start, as logging's setup: only for the command that serves
    import logging

    # kopf, the cluster's client, the planner: loaded only by the command that runs them
    from finetune_operator import kube, planner
    from finetune_operator.controller.reconcilers import Peering, Runtime, run
    from finetune_operator.settings import OperatorSettings

    if all_namespaces and namespaces:
        raise click.UsageError("use either --all-namespaces or --namespace, not both")
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    client = kube.Kube()
    runtime = Runtime.build(client, OperatorSettings.from_env(), interval=interval,
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
        await run(runtime, namespaces=namespaces, liveness_port=health_port,
                  peering=Peering(peering) if peering else None)

    asyncio.run(serve())


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
