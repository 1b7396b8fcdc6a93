"""`finetune-train --config FILE`: one worker process of a fine-tune.

Started by torchrun (through `finetune_trainer.launch` in the pods and in `finetune run`)
or by Azure ML's launcher; reads the standard RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT environment. Each failure is said in one line, also left in torchrun's error
file for the launcher (finetune_trainer.errors).
Exit codes: 0 done, 2 bad input (the model or the data; no restart can help), 3 the
network failed the collective preflight (below spec.preflight.minBusBandwidthGBps, or no
InfiniBand where it was required), 4 the output folder holds checkpoints of another training,
or an exported model and no checkpoint (`trained_with`: nothing was started; no restart can
help), 5 this image cannot set the worker up (an import error, an op DeepSpeed or torch cannot
build or load: `errors.setup_failure`), 143 stopped by SIGTERM after a
checkpoint, 1 anything else (a full output volume among them: said in one line naming the
folder, not a traceback).

`--fetch-model` (the pods' init container, `finetune run`) downloads an hf:// model into
the output folder once (finetune_trainer.fetch); the workers then read that copy, never the
hub. Exit codes: 0 there, 2 the name, revision or token is wrong, 1 anything else (the
network, a full volume: the next attempt keeps what was fetched), 143 stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import errno
import gc
import os
import signal
import sys
import traceback
from pathlib import Path

from finetune_trainer import fetch, trained_with
from finetune_trainer.config import TrainerConfig
from finetune_trainer.errors import failed, record_failure, setup_failure
from finetune_trainer.exits import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_NETWORK,
    EXIT_OTHER_CHECKPOINTS,
    EXIT_SETUP,
    STOPPED,
)
from finetune_trainer.layout import checkpoint_root, resolve_output
from finetune_trainer.uris import bind_placeholders

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def bind_locations(config, pairs: list[str]):
    """The config with `${{inputs.x}}` placeholders in its locations replaced by the paths
    given as `inputs.x=PATH` (where Azure ML mounted them)."""
    bindings = {}
    for pair in pairs:
        key, sep, path = pair.partition("=")
        if not sep or not path:
            raise ValueError(f"--location {pair!r} is not KEY=PATH (e.g. inputs.model=/mnt/m)")
        bindings[key] = path
    update: dict = {}
    given = {}  # what checkpoints record: the placeholders, not this job's mount paths
    for section in ("model", "dataset", "output"):
        part = getattr(config, section)
        try:
            bound = bind_placeholders(part.uri, bindings)
        except KeyError as missing:
            raise ValueError(f"{section}.uri {part.uri!r} needs --location "
                             f"{missing.args[0]}=PATH") from None
        update[section] = part.model_copy(update={"uri": bound})
        if bound != part.uri:
            given[section] = part.uri
    return config.model_copy(update={**update, "placeholders": given or None})


def _fetch(config: TrainerConfig, output_dir: Path) -> int:
    """`--fetch-model`: the model's copy in the output folder, downloaded unless complete
    already. SIGTERM (the pod deleted, a gang restart) gives the lock back and exits at once,
    without waiting for the downloads in flight: the next attempt keeps the finished files."""
    if fetch.hub_repo(config.model) is None:
        print(f"fetch-model: {config.model.uri} is not an hf:// model: nothing to fetch")
        return 0

    def stop(signum, frame):
        raise SystemExit(STOPPED)

    signal.signal(signal.SIGTERM, stop)
    from huggingface_hub.utils import disable_progress_bars  # the hub's: only this step's

    disable_progress_bars()  # one line per weight file instead, readable in `kubectl logs`
    try:
        fetch.fetch_model(config.model, output_dir,
                          say=lambda line: print(f"fetch-model: {line}", flush=True))
    except SystemExit:
        print("fetch-model: stopped by SIGTERM; the next attempt keeps the files fetched",
              file=sys.stderr, flush=True)
        os._exit(STOPPED)  # the download threads are not waited for
    except fetch.FetchError as error:
        return failed(str(error), EXIT_BAD_INPUT if error.permanent else EXIT_FAILED,
                      termination=True)
    except OSError as error:  # the volume's: full, read-only, not permitted
        if error.errno is None:
            raise
        where = f" ({error.filename})" if error.filename else ""
        fix = ("free space on the output volume or point spec.output.uri at a larger one"
               if error.errno in DISK_FULL else "point spec.output.uri at a volume the "
               "workers can write (on a cluster, a pvc:// claim)")
        return failed(f"{output_dir}: {error.strerror}{where} while fetching "
                      f"{config.model.uri} — {fix}", EXIT_FAILED, termination=True)
    return 0


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--fetch-model", action="store_true",
                        help="only download an hf:// model into the output folder's "
                             "model-cache/ (a complete copy is reused without any request), "
                             "then exit (0, 1 or 2); the pods' init container")
    return parser


def _load(args) -> tuple[TrainerConfig, Path]:
    """The trainer config with its Azure ML locations bound, and the folder relative paths
    start from. Raises OSError, ValueError (pydantic's ValidationError among them)."""
    if args.config_base64:
        config = TrainerConfig.model_validate_json(base64.b64decode(args.config_base64))
    else:
        config = TrainerConfig.load(args.config)
    base_dir = args.base_dir or (Path.cwd() if args.config_base64
                                 else Path(args.config).resolve().parent)
    if world := os.environ.get("WORLD_SIZE"):  # the workers there are, as checkpoints record
        config = config.model_copy(update={"workers": int(world)})
    return bind_locations(config, args.location), base_dir


def _import_training_stack(config: TrainerConfig, worker: bool) -> None:
    """The libraries a worker (or the preflight) needs, imported up front with the cyclic
    collector off, then frozen: they create objects by the million, and collections while
    they import took a fifth of the import time (about 0.8 s a process); frozen, no later
    collection walks them again. Nothing is allocated for training yet, so nothing waits on
    the collector meanwhile."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":  # CPU workers: each backend hides the
        # GPUs from them; DeepSpeed (imported for ZeRO, and by accelerate at a full-weight
        # save) would warn on every rank that it found none and fell back to the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    gc.disable()
    try:
        import accelerate  # noqa: F401
        import datasets  # noqa: F401
        import torch  # noqa: F401
        import transformers.modeling_utils  # noqa: F401

        if config.method.type != "full":
            import peft  # noqa: F401
        if worker and config.strategy.type.startswith("zero"):
            import deepspeed  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()


def _disk_full(error: OSError, output: Path) -> int:
    where = f" ({error.filename})" if error.filename else ""
    return failed(f"{output}: {error.strerror}{where} — free space on the output volume or "
                  "point spec.output.uri at a larger one, then run the job again: it resumes "
                  f"from the newest complete checkpoint in {checkpoint_root(output)}",
                  EXIT_FAILED)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except Exception as error:  # raised again: its traceback still goes to stderr
        if (line := setup_failure(error)) is not None:
            traceback.print_exc()  # the whole story stays in the log
            return failed(line, EXIT_SETUP)
        record_failure(f"{type(error).__name__}: {error}")
        raise
    finally:
        gc.freeze()  # see finetune_trainer.launch.main


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.config and not args.config_base64:
        parser.error("--config is required (or set FINETUNE_CONFIG)")
    try:
        config, base_dir = _load(args)
    except (OSError, ValueError) as error:
        source = "--config-base64" if args.config_base64 else args.config
        return failed(f"{source}: {error}", EXIT_BAD_INPUT)
    output = resolve_output(config.output.uri, base_dir)
    if args.fetch_model:  # before torch is imported: the init container stays light
        return _fetch(config, output)

    # before any download or process group: a job changed after its first run must not
    # resume from (and fail on, at every restart) the checkpoints of the old settings
    refused = not args.preflight and trained_with.refusal(
        output, config, "set spec.output.uri to a new folder, or move its checkpoints/, "
        "final/ and merged/ away to start over", base_dir)
    if refused:
        return failed(refused, EXIT_OTHER_CHECKPOINTS, termination=True)
    if args.check_resume:
        return 0
    _import_training_stack(config, worker=not args.preflight)
    # torch comes with these: imported after the light steps above (--fetch-model and
    # --check-resume, the pods' init containers), inside main's guard (a module this
    # image cannot import is said in one line, exit 5: errors.setup_failure)
    from finetune_trainer.checkpoint import CheckpointError
    from finetune_trainer.data import DataError
    from finetune_trainer.model import ModelError
    from finetune_trainer.network_preflight import PreflightError
    from finetune_trainer.train import counted, preflight, run

    # the copy fetched into the output folder, where there is one: no hub request at all
    config = fetch.with_local_copy(config, output)
    try:
        if args.preflight:
            prepared = preflight(config, base_dir)
            said = prepared.objective.summary(prepared.train)  # pairs, prompts, rewards
            train_records, eval_records = prepared.records
            print(f"preflight: {counted(train_records, 'training record')} "
                  f"({counted(len(prepared.train), 'sequence')}), "
                  f"{counted(eval_records, 'eval record')} "
                  f"({counted(len(prepared.eval), 'sequence')})"
                  f"{f'; {said}' if said else ''}; model and data look usable")
            for note in prepared.notes:
                print(f"preflight: {note}")
            return 0
        return run(config, base_dir)  # rank 0 writes the model card (train.describe_export)
    except (DataError, ModelError) as error:
        return failed(str(error), EXIT_BAD_INPUT)
    except PreflightError as error:
        return failed(f"collective preflight: {error}", EXIT_NETWORK)
    except CheckpointError as error:
        return failed(str(error), EXIT_FAILED)
    except OSError as error:
        if error.errno not in DISK_FULL:
            raise
        return _disk_full(error, output)


if __name__ == "__main__":
    sys.exit(main())
