"""Reading manifests: files or stdin, several YAML documents each."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Document:
    source: str
    """Where it came from: `file`, or `file#N` for the N-th document of a multi-document file."""
    data: Any


class ManifestError(ValueError):
    """A file that cannot be read or is not YAML."""


def read_documents(path: str) -> list[Document]:
    """The non-empty YAML documents in `path` (`-` reads stdin)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ManifestError(f"{path}: cannot read: {error.strerror}") from error
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ManifestError(f"{path}{where}: not valid YAML: {problem} — fix the syntax "
                            "(indentation, quoting, colons)") from error
    source = "<stdin>" if path == "-" else path
    if len(docs) == 1:
        return [Document(source, docs[0])]
    return [Document(f"{source}#{i}", d) for i, d in enumerate(docs, start=1)]
