"""Reading manifests: files, folders of them or stdin, several YAML documents each (and
lists of objects), read as kubectl reads them."""

from __future__ import annotations

import math
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

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


_NUMBER_CANDIDATE = re.compile(r"^[-+.0-9][-+.0-9a-zA-Z_]*$")
"""A plain scalar `go_scalar` reads: the first characters go-yaml tries as a number."""
_GO_INT = re.compile(r"([-+]?)(0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+|0[0-7]*|[1-9][0-9]*)")
"""Go's `strconv.ParseInt(s, 0, 64)`: a base prefix, a leading 0 for octal, or decimal."""
_GO_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
"""go-yaml's `yamlStyleFloat`: an exponent needs no dot (`1e-4`), unlike YAML 1.1's."""
_DOT_FLOAT = re.compile(r"\.[0-9]+([eE][-+]?[0-9]+)?")
"""What Go's `ParseFloat` takes of a scalar that starts with a dot (no underscores)."""
_SPECIAL_FLOATS = {
    **dict.fromkeys((".nan", ".NaN", ".NAN"), math.nan),
    **dict.fromkeys((".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"), math.inf),
    **dict.fromkeys(("-.inf", "-.Inf", "-.INF"), -math.inf)}


def go_scalar(text: str) -> int | float | str:
    """A plain scalar that starts like a number, read as go-yaml v2 reads it for kubectl,
    Helm and GitOps tools (sigs.k8s.io/yaml): `1e-4`, `2E-5` and `0o17` are numbers there
    and strings to YAML 1.1 (PyYAML's `learningRate: 1e-4` was the string '1e-4', refused
    by `validate` where `kubectl apply` took it); `1:30` and `2026-01-02` are strings there
    and numbers or dates to YAML 1.1. Anything else stays the text."""
    if text in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[text]
    if text.startswith("."):
        return float(text) if _DOT_FLOAT.fullmatch(text) else text
    plain = text.replace("_", "")  # go-yaml drops every underscore before it parses
    if (match := _GO_INT.fullmatch(plain)) is not None:
        sign, digits = match.groups()
        octal = len(digits) > 1 and digits[0] == "0" and digits[1].isdigit()  # Go's 012
        value = int(digits, 8) if octal else int(digits, 0)
        if -(2 ** 63) <= (-value if sign == "-" else value) < 2 ** (63 if sign else 64):
            return -value if sign == "-" else value  # else too large: read as a float
    if _GO_FLOAT.fullmatch(plain) and not math.isinf(number := float(plain)):
        return number  # Go's ParseFloat refuses what overflows a float64: it stays the text
    return text


def json_key(key: Any) -> str:
    """The name sigs.k8s.io/yaml gives a mapping key that YAML reads as other than a string
    (JSON's keys are strings): `true`, `16` for `0x10`, a float as Go's
    `FormatFloat(key, 'g', -1, 32)` writes it (`1000` for `1e3`, `1e-07`)."""
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int):
        return str(key)
    if math.isnan(key):
        return ".nan"
    try:
        single = struct.unpack("f", struct.pack("f", key))[0]
    except OverflowError:
        single = math.copysign(math.inf, key)
    if math.isinf(single):
        return ".inf" if single > 0 else "-.inf"
    sign, size = "-" if math.copysign(1.0, single) < 0 else "", abs(single)
    shortest = next(text for places in range(9) if struct.unpack(  # 9 digits always do
        "f", struct.pack("f", float(text := f"{size:.{places}e}")))[0] == size)
    mantissa, exponent = shortest.split("e")
    digits, power = mantissa.replace(".", "").rstrip("0") or "0", int(exponent)
    if power < -4 or power >= 6:
        return f"{sign}{digits[0]}{'.' + digits[1:] if digits[1:] else ''}e{power:+03d}"
    if power < 0:
        return f"{sign}0.{'0' * (-power - 1)}{digits}"
    whole, fraction = digits[:power + 1].ljust(power + 1, "0"), digits[power + 1:]
    return f"{sign}{whole}{'.' + fraction if fraction else ''}"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader made to read a manifest as kubectl does: plain scalars resolved
    as go-yaml v2 resolves them (`go_scalar`; `y` and `n` are booleans there too), keys
    named as JSON names them (`json_key`), and a key written twice in one mapping refused
    (PyYAML keeps the last silently: a second `learningRate:` or `method:` block replaced
    the first). Keys brought in by a merge (`<<: *anchor`) may be overridden, as YAML
    says."""

    # PyYAML's resolvers, less its YAML 1.1 numbers, dates and `=`
    yaml_implicit_resolvers: ClassVar[dict] = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag.rsplit(":", 1)[1]
                not in ("int", "float", "timestamp", "value")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    bool_values: ClassVar[dict] = {**yaml.SafeLoader.bool_values, "y": True, "n": False}

    def construct_go_scalar(self, node):
        return go_scalar(self.construct_scalar(node))

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
            self.flatten_mapping(node)  # a merge's keys first: the mapping's own win
        mapping: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):  # named before it is stored: `n` (false) and `0`
                key = self._json_key(key, key_node)  # are one key to a Python dict
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping

    @staticmethod
    def _json_key(key: Any, node: yaml.Node) -> str:
        if isinstance(key, (bool, int, float)):
            return json_key(key)
        what = "null (`~`, `null` or nothing)" if key is None else "a list or a mapping"
        raise yaml.constructor.ConstructorError(None, None, f"found a key that is {what}",
                                                node.start_mark)


_GO_NUMBER_TAG = "tag:finetune.dev,2026:go-scalar"
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"),
                              list("yYnN"))
_Loader.add_implicit_resolver(_GO_NUMBER_TAG, _NUMBER_CANDIDATE, list("-+.0123456789"))
_Loader.add_constructor(_GO_NUMBER_TAG, _Loader.construct_go_scalar)


def load_yaml(text: str) -> list[Any]:
    """The non-empty documents of a YAML text, read as kubectl reads them (`_Loader`)."""
    return [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]


def one_document(text: str) -> Any:
    """The one document of a YAML text, read as kubectl reads it; a YAMLError where it
    holds more than one."""
    return yaml.load(text, Loader=_Loader)


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
        docs = load_yaml(text)
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
               else "write the key as a name" if "found a key that is" in problem
               else "fix the syntax (indentation, quoting, colons)")
        raise ManifestError(f"{path}{where}: not valid YAML: {problem} — {fix}") from error
    except RecursionError:
        raise ManifestError(f"{path}: nests YAML too deeply to read — a manifest needs a "
                            "few levels; check the brackets and indentation") from None
    except ValueError as error:  # a value YAML parses but Python refuses (a 5000-digit int)
        raise ManifestError(f"{path}: holds a value that cannot be read ({error}) — "
                            "write it shorter") from error
    source = "<stdin>" if path == "-" else path
    named = [(source, docs[0])] if len(docs) == 1 else [
        (f"{source}#{i}", d) for i, d in enumerate(docs, start=1)]
    return [Document(name, data, path) for where, doc in named
            for name, data in _listed(where, doc, single=len(docs) == 1)]


def _listed(source: str, data: Any, single: bool) -> list[tuple[str, Any]]:
    """A list document (`kind: List`, what `kubectl get -o yaml` writes of several objects)
    as its items, each named `file#items[i]`, as kubectl apply takes them; any other
    document as itself."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if not (isinstance(kind, str) and kind.endswith("List")
            and isinstance(data.get("items"), list)):
        return [(source, data)]
    return [(f"{source}{'#' if single else '.'}items[{i}]", item)
            for i, item in enumerate(data["items"])]


MANIFEST_SUFFIXES = (".json", ".yaml", ".yml")
"""The files of a folder that are manifests, as `kubectl apply -f FOLDER` takes them."""


def manifest_paths(path: str) -> list[str]:
    """`path`, or for a folder the manifests in it in name order (`MANIFEST_SUFFIXES`; not
    its subfolders', as kubectl without -R)."""
    folder = Path(path)
    if path == "-" or not folder.is_dir():
        return [path]
    return [str(file) for file in sorted(folder.iterdir())
            if file.suffix in MANIFEST_SUFFIXES and file.is_file()]
