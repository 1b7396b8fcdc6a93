"""`finetune export`: a trained model pushed to an OCI registry or the Hugging Face Hub
(`finetune_trainer.export` does it, its registry and hub clients loaded only once it
pushes; the trainer image runs the same code)."""

from __future__ import annotations

from pathlib import Path

import click

from finetune_operator.api import KIND
from finetune_operator.cli.group import main
from finetune_trainer.export import ExportError, export, model_folder


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

    OUTPUT: a job's output folder (its final/ is pushed), the FineTuneJob manifest `finetune
    run` ran (its spec.output.uri), or a model folder. Credentials: Docker's config (`docker
    login`, `oras login`, REGISTRY_AUTH_FILE), or for the hub HF_TOKEN (or `hf auth login`);
    another hub: HF_ENDPOINT; a private CA: REQUESTS_CA_BUNDLE.
    """
    try:
        export(model_folder(folder_named(output), merged), target, plain_http=plain_http)
    except ExportError as error:
        raise click.ClickException(str(error)) from None


def folder_named(output: Path) -> Path:
    """OUTPUT's folder: itself, or for a file the output folder of the FineTuneJob manifest
    it is, read as `finetune status` and `logs` read one (follow.output_folder). Raises
    ExportError for a file that is no manifest of a run on this machine."""
    if not output.is_file():
        return output  # a folder, or nothing: model_folder says which
    from finetune_operator import follow  # ~8 ms: only a manifest given as OUTPUT reads it

    try:
        found = follow.output_folder(str(output))
    except follow.OnItsCluster as elsewhere:
        raise ExportError.of_folder(output, f"{elsewhere.kind} {elsewhere.namespace}/"
                                    f"{elsewhere.name} runs on a cluster: its output is not "
                                    "on this machine", "list the target in the job's "
                                    "spec.output.export (pushed once training ends), or copy "
                                    "its output folder here and export that") from None
    except follow.NotARun:
        found = None
    if found is None:
        raise ExportError.of_folder(output, f"is a file, neither a folder nor a valid {KIND} "
                                    f"manifest (`finetune validate {output}` says why)",
                                    "give a job's output folder (its spec.output.uri), the "
                                    "manifest `finetune run` ran, or a model folder")
    return found[1]
