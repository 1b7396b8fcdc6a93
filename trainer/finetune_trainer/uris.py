"""Where models, datasets and outputs live: the URI forms the API accepts.

One regular expression per form, shared by the Python validation rules and the CRD's
`pattern`, so `kubectl apply` and `finetune validate` refuse the same strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

Scheme = Literal["hf", "pvc", "azureml", "https", "path", "relative", "oci"]

_SCHEME_PATTERNS: dict[Scheme, str] = {
    # hf://org/name or hf://name (a few hub repos have no org, e.g. hf://gpt2)
    "hf": r"hf://[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?",
    # pvc://claim[/path]: the claim is mounted read-only (inputs) or read-write (output)
    "pvc": r"pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/\S*)?",
    # azureml://datastores/..., azureml://registries/..., azureml://subscriptions/...
    "azureml": r"azureml://\S+",
    "https": r"https://\S+",
    "path": r"/\S*",
    # ./x or ../x: only meaningful to `finetune run`, resolved against the manifest's folder
    "relative": r"\.\.?/\S*",
    # oci://registry[:port]/repository[:tag]: an export target. The scheme alone here: its
    # grammar is finetune_trainer/export/oci.py's Reference.parse, the one parser, which
    # says which part a registry would refuse
    "oci": r"oci://.*",
}

SCHEME_EXAMPLES: dict[Scheme, str] = {
    "hf": "hf://org/name",
    "pvc": "pvc://claim/path",
    "azureml": "azureml://...",
    "https": "https://...",
    "path": "/absolute/path",
    "relative": "./relative/path",
    "oci": "oci://registry.example.com/models/name:tag",
}

SCHEME_NAMES: dict[Scheme, str] = {
    "hf": "Hugging Face Hub (hf://)",
    "pvc": "PersistentVolumeClaim (pvc://)",
    "azureml": "Azure ML (azureml://)",
    "https": "https://",
    "path": "absolute path",
    "relative": "relative path",
    "oci": "OCI registry (oci://)",
}

MODEL_SCHEMES: tuple[Scheme, ...] = ("hf", "pvc", "azureml", "path", "relative")
DATASET_SCHEMES: tuple[Scheme, ...] = ("hf", "pvc", "azureml", "https", "path", "relative")
OUTPUT_SCHEMES: tuple[Scheme, ...] = ("pvc", "azureml", "path", "relative")


def uri_pattern(schemes: tuple[Scheme, ...]) -> str:
    """An anchored regular expression accepting exactly the given URI forms."""
    return "^(" + "|".join(_SCHEME_PATTERNS[s] for s in schemes) + ")$"


@dataclass(frozen=True)
class Uri:
    """A parsed location: `scheme` plus the part after `scheme://` (the raw path otherwise)."""

    scheme: Scheme
    raw: str

    @property
    def rest(self) -> str:
        return self.raw.split("://", 1)[1] if "://" in self.raw else self.raw

    @property
    def pvc_claim(self) -> str:
        assert self.scheme == "pvc"
        return self.rest.split("/", 1)[0]

    @property
    def pvc_subpath(self) -> str:
        assert self.scheme == "pvc"
        parts = self.rest.split("/", 1)
        return parts[1] if len(parts) == 2 else ""


class UriError(ValueError):
    """A location the API does not accept: `what` is wrong, `fix` says what to write instead;
    `field` names the spec field where it is known."""

    def __init__(self, what: str, fix: str, field: str | None = None):
        super().__init__(f"{field + ': ' if field else ''}{what} — {fix}")
        self.what = what
        self.fix = fix
        self.field = field


class Unreachable(UriError):
    """A valid location that the workers of one backend cannot open (a claim from Azure ML,
    an Azure ML datastore from a pod, either from `finetune run`)."""


def parse_uri(raw: str, allowed: tuple[Scheme, ...]) -> Uri:
    """Parse `raw` into a Uri, or raise UriError saying which forms would be accepted."""
    for scheme in allowed:
        if re.fullmatch(_SCHEME_PATTERNS[scheme], raw):
            return Uri(scheme, raw)
    fix = "use " + " or ".join(SCHEME_EXAMPLES[s] for s in allowed)
    for scheme, pattern in _SCHEME_PATTERNS.items():
        if re.fullmatch(pattern, raw):
            raise UriError(f"{SCHEME_NAMES[scheme]} locations are not accepted here", fix)
    if raw.startswith("http://"):
        raise UriError(f"{raw!r} is plain http", "use https:// so data and tokens travel encrypted")
    raise UriError(f"{raw!r} is not a location this API understands", fix)


Section = Literal["model", "dataset", "output"]
SECTION_SCHEMES: dict[Section, tuple[Scheme, ...]] = {
    "model": MODEL_SCHEMES, "dataset": DATASET_SCHEMES, "output": OUTPUT_SCHEMES}


@dataclass(frozen=True)
class Location:
    """A job's model, dataset or output location, parsed once: what the rules read and
    what each backend mounts (its `mount(location)` says where the workers open it)."""

    section: Section
    uri: Uri

    @property
    def field(self) -> str:
        return f"spec.{self.section}.uri"

    @property
    def scheme(self) -> Scheme:
        return self.uri.scheme

    @property
    def raw(self) -> str:
        return self.uri.raw


def parse_location(section: Section, raw: str) -> Location:
    """`raw` as the `section`'s location, or UriError naming the field and the forms it takes."""
    try:
        return Location(section, parse_uri(raw, SECTION_SCHEMES[section]))
    except UriError as error:
        raise UriError(error.what, error.fix, f"spec.{section}.uri") from None


# --- Azure ML job placeholders -----------------------------------------------------------
# Azure ML mounts a job's inputs and outputs at paths known only when the job starts, and
# substitutes `${{inputs.<name>}}` / `${{outputs.<name>}}` in the command line, never in
# files. The operator writes these placeholders into the trainer config and binds them on
# the command line (`--location inputs.model=${{inputs.model}}`); the trainer swaps them.
PLACEHOLDER_PATTERN = re.compile(r"\$\{\{\s*((?:inputs|outputs)\.[A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


DATA_FILE_BUILDERS: dict[str, str] = {
    ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""The data files the trainer reads, by suffix (in any case), and the `datasets` builder
that reads each."""
ONE_DATA_FILE = "(?i)[.](" + "|".join(s[1:] for s in DATA_FILE_BUILDERS) + ")$"
"""A dataset uri ending so names one file (the trainer reads a folder only by its files):
the expression the CRD's CEL rules and the Python validation share."""


def data_file_builder(name: str) -> str | None:
    """The `datasets` builder for a data file's name, path or link, or None where it names
    no data file the trainer reads."""
    return DATA_FILE_BUILDERS.get(PurePosixPath(name.split("?")[0]).suffix.lower())


def job_placeholder(key: str) -> str:
    """`inputs.model` → `${{inputs.model}}`: what Azure ML substitutes in a command."""
    return "${{" + key + "}}"


def bind_placeholders(value: str, bindings: dict[str, str]) -> str:
    """`value` with every job placeholder replaced by its bound path.

    Raises KeyError naming the first placeholder that has no binding."""

    def swap(match: re.Match) -> str:
        return bindings[match.group(1)]

    return PLACEHOLDER_PATTERN.sub(swap, value)
