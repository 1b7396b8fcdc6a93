"""`finetune-train --config FILE`: one worker process of a fine-tune.

Started by torchrun (Kubernetes pods, `finetune run`) or by Azure ML's launcher; reads
the standard RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT environment.
Exit codes: 0 done, 2 bad input (nothing was started), 143 stopped by SIGTERM after a
checkpoint, 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune-train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.environ.get("FINETUNE_CONFIG"),
                        help="trainer config (YAML or JSON); default $FINETUNE_CONFIG")
    parser.add_argument("--base-dir", type=Path, default=None,
                        help="folder that relative paths start from (default: the config's)")
    parser.add_argument("--preflight", action="store_true",
                        help="only check the model and the data, then exit (0 or 2)")
    args = parser.parse_args(argv)
    if not args.config:
        parser.error("--config is required (or set FINETUNE_CONFIG)")

    from pydantic import ValidationError

    from finetune_trainer.config import TrainerConfig
    from finetune_trainer.data import DataError
    from finetune_trainer.model import ModelError

    try:
        config = TrainerConfig.load(args.config)
    except (OSError, ValidationError, ValueError) as error:
        print(f"finetune-train: {args.config}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    base_dir = args.base_dir or Path(args.config).resolve().parent

    from finetune_trainer.train import preflight, run

    try:
        if args.preflight:
            prepared = preflight(config, base_dir)
            print(f"preflight: {len(prepared.train)} training sequences, "
                  f"{len(prepared.eval)} eval sequences; model and data look usable")
            return 0
        return run(config, base_dir)
    except (DataError, ModelError) as error:
        print(f"finetune-train: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
