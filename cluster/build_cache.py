"""Where the cluster's builds are kept between runs, outside the repository: the binaries
(control-plane/), the images (images/) and each node's containerd store (node/)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(part: str) -> Path:
    """`~/.cache/finetune-operator/<part>` (XDG_CACHE_HOME honoured); FINETUNE_CLUSTER_CACHE
    names the binaries' folder, and the others sit beside it."""
    binaries = os.environ.get("FINETUNE_CLUSTER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "finetune-operator", "control-plane")
    return Path(binaries) if part == "control-plane" else Path(binaries).parent / part
