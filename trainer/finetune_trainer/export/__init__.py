"""Getting a trained model out: its folder pushed to where serving picks it up.

`export(folder, target)` sends a model folder (a job's `final/`: a peft adapter or whole
weights, with its model card) to a target named by a URI; one module per kind of target:
`oci.py` (`oci://registry/repository:tag`, an image KAITO and `oras pull` read), `hub.py`
(`hf://owner/name`, a commit to a Hugging Face Hub repository), and `retry.py` what
they share (ExportError, the tries of a push). Torch-free: `finetune
export` runs it on a laptop as well as in the trainer.
"""

from __future__ import annotations

from pathlib import Path

from finetune_trainer.config import HUB_TOKEN_KEY
from finetune_trainer.export.retry import ExportError
from finetune_trainer.layout import FINAL_DIR, MERGED_DIR, export_credentials
from finetune_trainer.uris import UriError, parse_uri


def model_folder(output: Path, merged: bool = False) -> Path:
    """What to export of `output`: a job's output folder gives its `final/` (`merged/` with
    `merged`), a model folder itself. Raises ExportError saying what is there instead."""
    if not output.is_dir():
        raise ExportError.of_folder(output, "no such folder", "give a job's output folder "
                                    "(its spec.output.uri) or a model folder")
    if merged:
        if not (output / MERGED_DIR).is_dir():
            raise ExportError.of_folder(output, f"holds no {MERGED_DIR}/ folder", "train "
                                        "with spec.output.mergeAdapter: true, or export "
                                        "final/ (leave out --merged)")
        return output / MERGED_DIR
    if (output / FINAL_DIR).is_dir():
        return output / FINAL_DIR
    if any((output / name).is_file() for name in ("adapter_config.json", "config.json")):
        return output
    raise ExportError.of_folder(output, f"holds no {FINAL_DIR}/ folder and is no model "
                                "folder (adapter_config.json or config.json)", "wait until "
                                "the job has ended (its final/ is written after the last "
                                "step), or give the model folder")


def export(folder: Path, target: str, *, plain_http: bool = False, say=print,
           credentials: Path | None = None) -> str:
    """Push `folder` to `target`; returns what was pushed (the reference with its digest, or
    the repository with its commit). `credentials`: the file holding the target's (a Docker
    config, or a hub token; None: the user's own, `oci.docker_configs` or HF_TOKEN). Raises
    ExportError (a bad target, a refused or unreachable registry or hub, an empty folder)."""
    try:
        uri = parse_uri(target, ("oci", "hf"))
    except UriError as error:
        raise ExportError(target, error.what, error.fix) from None
    if uri.scheme == "hf":
        from finetune_trainer.export import hub  # each target's client: only its push loads it

        token = credentials.read_text().strip() if credentials else None
        return hub.push(folder, hub.HubRepo.parse(uri.raw), token=token, say=say)
    from finetune_trainer.export import oci  # as hub above

    return oci.push(folder, oci.Reference.parse(uri.raw), plain_http=plain_http, say=say,
                    configs=[credentials] if credentials else None)


def export_trained(output: Path, targets: list, say=print) -> list[dict[str, str]]:
    """After training: each of `spec.output.export`'s targets (config.ExportTarget) pushed
    in turn, what each came to as `{uri, pushed}` or `{uri, error}` (the progress record's
    `exports`). A failed push is said and recorded, never raised: the model is in the output
    folder whatever happens here. A target's `secretName` is read where the workers have it
    mounted (layout.export_credentials); where it is not (`finetune run`), the user's own
    login is (Docker's, or HF_TOKEN)."""
    outcomes = []
    for target in targets:
        if not target.pushed_by_trainer:
            say(f"{target.uri}: registered in the Azure ML workspace by the operator once the "
                "job has succeeded")
            continue
        credentials = None
        if target.secret_name:
            mounted = export_credentials(target.secret_name, target.secret_key)
            if mounted.is_file():
                credentials = mounted
            else:
                own = ("HF_TOKEN or your hub login" if target.secret_key == HUB_TOKEN_KEY
                       else "your own Docker login")
                say(f"secret {target.secret_name} is not mounted here: pushing to "
                    f"{target.uri} with {own}")
        try:
            pushed = export(model_folder(output, target.merged), target.uri,
                            plain_http=target.plain_http, say=say, credentials=credentials)
            outcomes.append({"uri": target.uri, "pushed": pushed})
        except ExportError as error:
            say(f"{error} (the model stays in {output})")
            outcomes.append({"uri": target.uri, "error": f"{error.problem}; {error.fix}"})
        except Exception as error:  # what no rule foresaw: the model is safe all the same
            say(f"export to {target.uri} failed: {type(error).__name__}: {error} (the model "
                f"stays in {output})")
            outcomes.append({"uri": target.uri, "error": f"{type(error).__name__}: {error}"})
    return outcomes
