"""The dataset as it is, not as it is named: a digest of its files' content, which every
checkpoint records (`trained_with`) so that a resume on other data is refused even where
`dataset.uri` is the same (a file edited in place), and allowed where only the name moved
(the same file copied to a volume, an Azure ML mount path that differs per job).

Hashing reads every file once per output folder: the digest is kept in
`.finetune/fingerprints.json` there beside each file's size and modification time, and read
back while those are unchanged (a restart, the other ranks, the run after `finetune run`'s own
check). Hub and https datasets have no digest here (their content is only seen once loaded):
they are known by their URI and split.

Torch-free: `finetune run` and the pods' resume check compute it before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from finetune_trainer.config import DatasetSource
from finetune_trainer.data_files import DataError, local_data_files, local_path

CACHE = ".finetune/fingerprints.json"
"""In the output folder: each dataset's digest with the file stats it was taken at."""
_CHUNK = 1 << 20


def dataset(source: DatasetSource, base_dir: Path | None, output_dir: Path | None
            ) -> dict[str, Any] | None:
    """`{"sha256", "files", "bytes"}` of the local files `source` names (a file, or every
    data file of a folder, as the trainer reads them); None for hub and https data, and for
    data that cannot be listed (the reader says why, with the fix)."""
    if source.uri.startswith(("hf://", "https://")):
        return None
    try:
        files = local_data_files(source.uri, base_dir)
        root = local_path(source.uri, base_dir)
        stats = [[_relative(f, root), *_stat(f)] for f in files]
    except (DataError, OSError):
        return None
    cached = _cached(output_dir, str(root))
    if cached is not None and cached.get("stats") == stats:
        return cached["content"]
    content = _digest(files, stats)
    _keep(output_dir, str(root), {"stats": stats, "content": content})
    return content


def _relative(file: Path, root: Path) -> str:
    """A folder's file by its path inside it (names choose splits); one file by no name,
    so the same file copied under another name is the same data."""
    return "" if file == root else file.relative_to(root).as_posix()


def _stat(file: Path) -> tuple[int, int]:
    status = file.stat()
    return status.st_size, status.st_mtime_ns


def _digest(files: list[Path], stats: list[list]) -> dict[str, Any]:
    digest = hashlib.sha256()
    for file, (name, size, _mtime) in zip(files, stats, strict=True):
        digest.update(f"{name}\0{size}\0".encode())
        with file.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    return {"sha256": digest.hexdigest(), "files": len(files),
            "bytes": sum(size for _name, size, _mtime in stats)}


def _cached(output_dir: Path | None, root: str) -> dict[str, Any] | None:
    if output_dir is None:
        return None
    try:
        return json.loads((output_dir / CACHE).read_text()).get(root)
    except (OSError, ValueError, AttributeError):
        return None


def _keep(output_dir: Path | None, root: str, entry: dict[str, Any]) -> None:
    """Best effort: a folder that cannot be written only means hashing again next time."""
    if output_dir is None:
        return
    path = output_dir / CACHE
    try:
        kept = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(kept, dict):
            kept = {}
    except (OSError, ValueError):
        kept = {}
    kept[root] = entry
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(kept, indent=1))
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)


def describe(content: dict[str, Any] | None) -> str:
    """`2 files, 1,234 bytes, sha256 0123456789ab` (or `none`), for a refusal's line."""
    if not content:
        return "none"
    files = content.get("files", 0)
    return (f"{files} file{'' if files == 1 else 's'}, {content.get('bytes', 0):,} bytes, "
            f"sha256 {str(content.get('sha256', ''))[:12]}")
