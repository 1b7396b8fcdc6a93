"""Reading manifests: files or stdin, several YAML documents each."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


def manifest_folder(path: str) -> Path:
    """Where the relative paths of the manifest at `path` start: the manifest's own folder,
    or the working directory for stdin (`-`)."""
    return Path.cwd() if path == "-" else Path(path).resolve().parent


@dataclass(frozen=True)
class Document:
    source: str
    """Where it came from: `file`, or `file#N` for the N-th document of a multi-document file."""
    data: Any
    path: str = "-"
    """The file as given (`-`: stdin)."""

    @property
    def folder(self) -> Path:
        """Where its relative paths start (`manifest_folder`)."""
        return manifest_folder(self.path)


class ManifestError(ValueError):
    """A file that cannot be read or is not YAML."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping as kubectl does
    (PyYAML keeps the last silently: a second `learningRate:` or `method:` block replaced the
    first). Keys brought in by a merge (`<<: *anchor`) may be overridden, as YAML says."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                        key_node, yaml.ScalarNode):
                    continue
                if key_node.value in seen:
                    first = seen[key_node.value].start_mark.line + 1
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found the key {key_node.value!r} a second time (first on "
                        f"line {first})", key_node.start_mark)
                seen[key_node.value] = key_node
        return super().construct_mapping(node, deep=deep)


def _read_bytes(path: str) -> bytes:
    if path != "-":
        return Path(path).read_bytes()
    stdin = getattr(sys.stdin, "buffer", None)
    return stdin.read() if stdin is not None else sys.stdin.read().encode("utf-8")


def read_documents(path: str) -> list[Document]:
    """The non-empty YAML documents in `path` (`-` reads stdin)."""
    try:
        data = _read_bytes(path)
    except OSError as error:
        raise ManifestError(f"{path}: cannot read: {error.strerror}") from error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ManifestError(f"{path}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x}) "
                            "— save the manifest as UTF-8") from None
    try:
        docs = [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except yaml.reader.ReaderError as error:  # a control character: no mark, two lines
        line = text[:error.position].count("\n") + 1
        column = error.position - (text.rfind("\n", 0, error.position) + 1) + 1
        raise ManifestError(f"{path}:{line}:{column}: not valid YAML: character "
                            f"#x{error.character:04x} is not allowed — remove it (control "
                            "characters other than tab and newline)") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(error, "problem", None) or error).split())
        fix = ("indent with spaces: YAML takes no tab there" if "'\\t'" in problem
               else "keep one of them" if "a second time" in problem
               else "fix the syntax (indentation, quoting, colons)")
        raise ManifestError(f"{path}{where}: not valid YAML: {problem} — {fix}") from error
    except RecursionError:
        raise ManifestError(f"{path}: nests YAML too deeply to read — a manifest needs a "
                            "few levels; check the brackets and indentation") from None
    except ValueError as error:  # a value YAML parses but Python refuses (a 5000-digit int)
        raise ManifestError(f"{path}: holds a value that cannot be read ({error}) — "
                            "write it shorter") from error
    source = "<stdin>" if path == "-" else path
    if len(docs) == 1:
        return [Document(source, docs[0], path)]
    return [Document(f"{source}#{i}", d, path) for i, d in enumerate(docs, start=1)]
