"""`finetune-train --config FILE`: one worker process of a fine-tune.

Started by torchrun (Kubernetes pods, `finetune run`) or by Azure ML's launcher; reads
the standard RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT environment.
Exit codes: 0 done, 2 bad input (nothing was started), 3 the network failed the
collective preflight (below spec.preflight.minBusBandwidthGBps, or no InfiniBand where
it was required), 4 the output folder holds checkpoints trained with other settings
(nothing was started; no restart can help), 143 stopped by SIGTERM after a checkpoint,
1 anything else (a full output volume among them: said in one line naming the folder, not
a traceback).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import errno
import os
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2
EXIT_NETWORK = 3
EXIT_OTHER_CHECKPOINTS = 4
EXIT_FAILED = 1
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def restart_note(environ) -> str | None:
    """The line rank 0 prints when torchrun restarted the workers after one failed."""
    count = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if environ.get("RANK", "0") != "0" or not count.isdigit() or int(count) == 0:
        return None
    limit = environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    return (f"finetune-train: restart {count} of at most {limit} (spec.runPolicy."
            "backoffLimit): a worker failed, so torchrun restarted every worker; training "
            "resumes from the newest complete checkpoint")


def bind_locations(config, pairs: list[str]):
    """The config with `${{inputs.x}}` placeholders in its locations replaced by the paths
    given as `inputs.x=PATH` (where Azure ML mounted them)."""
    from finetune_trainer.uris import bind_placeholders

    bindings = {}
    for pair in pairs:
        key, sep, path = pair.partition("=")
        if not sep or not path:
            raise ValueError(f"--location {pair!r} is not KEY=PATH (e.g. inputs.model=/mnt/m)")
        bindings[key] = path
    update = {}
    for section in ("model", "dataset", "output"):
        part = getattr(config, section)
        try:
            update[section] = part.model_copy(
                update={"uri": bind_placeholders(part.uri, bindings)})
        except KeyError as missing:
            raise ValueError(f"{section}.uri {part.uri!r} needs --location "
                             f"{missing.args[0]}=PATH") from None
    return config.model_copy(update=update)


def _termination_message(text: str) -> None:
    """Where the kubelet reads why a container ended (`terminationMessagePath`), so the
    FineTuneJob's status says it in full; nothing happens outside a pod."""
    path = Path("/dev/termination-log")
    if path.exists():
        with contextlib.suppress(OSError):
            path.write_text(text[:4000])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune-train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.environ.get("FINETUNE_CONFIG"),
                        help="trainer config (YAML or JSON); default $FINETUNE_CONFIG")
    parser.add_argument("--config-base64", default=None, metavar="DATA",
                        help="the trainer config inline, base64-encoded JSON (Azure ML passes "
                             "it as a job input)")
    parser.add_argument("--location", action="append", default=[], metavar="KEY=PATH",
                        help="bind a ${{inputs.KEY}} / ${{outputs.KEY}} placeholder in the "
                             "config's locations to PATH (Azure ML mount paths); repeatable")
    parser.add_argument("--base-dir", type=Path, default=None,
                        help="folder that relative paths start from (default: the config's)")
    parser.add_argument("--preflight", action="store_true",
                        help="only check the model and the data, then exit (0 or 2)")
    parser.add_argument("--check-resume", action="store_true",
                        help="only check that the output folder's checkpoints were trained "
                             "with these settings, then exit (0 or 4); the pods' init "
                             "container")
    args = parser.parse_args(argv)
    if not args.config and not args.config_base64:
        parser.error("--config is required (or set FINETUNE_CONFIG)")

    from pydantic import ValidationError

    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.data import DataError
    from finetune_trainer.model import ModelError

    source = "--config-base64" if args.config_base64 else args.config
    try:
        if args.config_base64:
            config = TrainerConfig.model_validate_json(base64.b64decode(args.config_base64))
        else:
            config = TrainerConfig.load(args.config)
        config = bind_locations(config, args.location)
    except (OSError, ValidationError, ValueError) as error:
        print(f"finetune-train: {source}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    base_dir = args.base_dir or (Path.cwd() if args.config_base64
                                 else Path(args.config).resolve().parent)

    from finetune_trainer import trained_with
    from finetune_trainer.checkpoint import CheckpointError
    from finetune_trainer.network_preflight import PreflightError
    from finetune_trainer.train import preflight, resolve_path, run

    # before any download or process group: a job changed after its first run must not
    # resume from (and fail on, at every restart) the checkpoints of the old settings
    refused = not args.preflight and trained_with.refusal(
        resolve_path(config.output.uri, base_dir), config,
        "set spec.output.uri to a new folder, or move its checkpoints/ away to start over")
    if refused:
        print(f"finetune-train: {refused}", file=sys.stderr, flush=True)
        _termination_message(refused)
        return EXIT_OTHER_CHECKPOINTS
    if args.check_resume:
        return 0
    try:
        if args.preflight:
            prepared = preflight(config, base_dir)
            print(f"preflight: {len(prepared.train)} training sequences, "
                  f"{len(prepared.eval)} eval sequences; model and data look usable")
            return 0
        if note := restart_note(os.environ):
            print(note, flush=True)
        return run(config, base_dir)
    except (DataError, ModelError) as error:
        print(f"finetune-train: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PreflightError as error:
        print(f"finetune-train: collective preflight: {error}", file=sys.stderr, flush=True)
        return EXIT_NETWORK
    except CheckpointError as error:
        print(f"finetune-train: {error}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except OSError as error:
        if error.errno not in DISK_FULL:
            raise
        output = resolve_path(config.output.uri, base_dir)
        where = f" ({error.filename})" if error.filename else ""
        print(f"finetune-train: {output}: {error.strerror}{where} — free space on the output "
              "volume or point spec.output.uri at a larger one, "
              "then run the job again: it resumes from the newest complete checkpoint in "
              f"{output / 'checkpoints'}", file=sys.stderr, flush=True)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
