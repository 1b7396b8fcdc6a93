"""A model folder pushed to an OCI registry as one image that KAITO and `oras pull` both read.

The layout, and why (from their code, kaito-project/kaito pkg/workspace/image and
oras-go's file store):
- KAITO's inference Workspace takes an adapter from `adapters[].source.image`: its puller
  (skopeo) copies the image, untars every layer and keeps the `data/` folder; skopeo
  refuses an artifact whose config is not an image config. So: an image config
  (`application/vnd.oci.image.config.v1+json`, its `rootfs.diff_ids` the layer's tar) and
  one gzipped tar layer holding `data/<the folder's files>`, as KAITO's own tuning pushes.
- `oras pull` writes a layer titled `data` (`org.opencontainers.image.title`) and unpacks
  it where `io.deis.oras.content.unpack` says so, checking `io.deis.oras.content.digest`
  (the tar's digest): the same layer, annotated, comes back as `./data/`.
- The config names linux/amd64: containerd (Kubernetes image volumes) matches a single
  manifest's platform against the node's; the files are the same on any.

The tar is reproducible (sorted names, zero times and owners): the same folder pushed twice
makes the same digests, and a registry that holds the layer is not sent it again.

Credentials are Docker's: `REGISTRY_AUTH_FILE`, `$DOCKER_CONFIG/config.json` or
`~/.docker/config.json` (what `docker login`, `oras login` and a `kubernetes.io/
dockerconfigjson` Secret hold), inline or through the credential helper they name; a
registry's Basic or Bearer challenge is answered with them. TLS is checked against the
system's CAs, or `REQUESTS_CA_BUNDLE`'s.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urljoin

from finetune_trainer.export.retry import (
    ATTEMPTS,
    ExportError,
    no_answer,
    unresolved,
    wait_to_try_again,
)

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
DATA_DIR = "data"
"""The folder the layer holds the files in: where KAITO's puller takes them from, and the
name `oras pull` unpacks them to."""
TITLE = "org.opencontainers.image.title"
UNPACK = "io.deis.oras.content.unpack"
TAR_DIGEST = "io.deis.oras.content.digest"
CREATED = "org.opencontainers.image.created"
DESCRIPTION = "org.opencontainers.image.description"
BASE_MODEL = "dev.finetune.base-model"


_HOST = re.compile(r"^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
                   r"(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])"
                   r"(?::[0-9]{1,5})?$")
_PATH_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
"""The distribution spec's grammar of a registry host, a repository's path components and
a tag (distribution/reference's regexp.go)."""
_EXAMPLE = "oci://myregistry.azurecr.io/adapters/support-bot:v1"


@dataclass(frozen=True)
class Reference:
    """`oci://registry/repository:tag`, parsed (the tag defaults to `latest`)."""

    registry: str
    repository: str
    tag: str

    @classmethod
    def parse(cls, uri: str) -> Reference:
        """Raises ExportError naming the part a registry would refuse and why, before
        anything is sent (`finetune export`, `finetune validate` and the operator check a
        target with it: the one grammar of an oci:// target)."""
        rest = uri.removeprefix("oci://")
        registry, _, path = rest.partition("/")
        if "@" in path:
            raise ExportError(uri, "names a digest, which a push cannot target: the registry "
                              "gives the digest of what it is sent", "name a tag "
                              "(oci://registry/repository:tag), or none for `latest`")
        repository, _, tag = path.rpartition(":") if ":" in path else (path, "", "")
        if not _HOST.fullmatch(registry):
            raise ExportError(uri, f"names no registry host ({registry!r})", "write "
                              f"oci://<host[:port]>/<repository>[:tag], e.g. {_EXAMPLE}")
        if not repository:
            raise ExportError(uri, "names no repository", "write oci://<host[:port]>/"
                              f"<repository>[:tag], e.g. {_EXAMPLE}")
        if not all(_PATH_COMPONENT.fullmatch(c) for c in repository.split("/")):
            lower = repository.lower()
            why = ": repository names are lowercase (OCI distribution spec)" if (
                lower != repository) else ""
            fix = (f"write {lower}" if all(_PATH_COMPONENT.fullmatch(c) for c in lower.split(
                "/")) else "use lowercase letters, digits and single . _ - between them, in "
                "/-separated parts")
            raise ExportError(uri, f"names the repository {repository!r}, which a registry "
                              f"refuses{why}", fix)
        if tag and not _TAG.fullmatch(tag):
            raise ExportError(uri, f"names the tag {tag!r}, which a registry refuses", "use "
                              "up to 128 letters, digits, _ . and -, not starting with . or -")
        return cls(registry, repository, tag or "latest")

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}:{self.tag}"


@dataclass(frozen=True)
class Blob:
    media_type: str
    digest: str
    size: int
    path: Path

    def descriptor(self, annotations: dict[str, str] | None = None) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size,
                **({"annotations": annotations} if annotations else {})}


@dataclass(frozen=True)
class Packed:
    """A folder packed for a push: its config and layer blobs, and its manifest."""

    config: Blob
    layer: Blob
    manifest: bytes
    files: list[str]


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def model_files(folder: Path) -> list[Path]:
    """The files to push, sorted: everything in the folder but hidden files and folders."""
    return sorted(path for path in folder.rglob("*") if path.is_file() and not any(
        part.startswith(".") for part in path.relative_to(folder).parts))


class _Hashing:
    """A write-only stream that hashes and counts what passes through to `out`."""

    def __init__(self, out) -> None:
        self.out, self.hash, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.out.write(data)

    def tell(self) -> int:
        return self.size

    @property
    def digest(self) -> str:
        return "sha256:" + self.hash.hexdigest()


class _UnpaddedTar(tarfile.TarFile):
    """A tar that ends with its two zero blocks, as Go's archive/tar writes one: Python's
    pads to 10 KiB records after them, and `oras pull` checks the tar's digest over what
    Go's reader reads, which stops at those two blocks ("content digest mismatch")."""

    def close(self) -> None:
        if not self.closed:
            self.fileobj.write(tarfile.NUL * (tarfile.BLOCKSIZE * 2))
            self.closed = True


def write_layer(folder: Path, files: list[Path], path: Path) -> tuple[str, str, int]:
    """`files` as a gzipped tar under `data/`, with zero times and owners and plain modes,
    streamed to `path` (a merged model is many GB); returns the tar's digest, the gzip's
    digest and its size."""
    folders = sorted({parent for f in files for parent in f.relative_to(folder).parents
                      if parent != Path(".")})
    with path.open("wb") as raw:
        packed = _Hashing(raw)
        with gzip.GzipFile(fileobj=packed, mode="wb", compresslevel=1, mtime=0) as zipped:
            tar_stream = _Hashing(zipped)
            with _UnpaddedTar(fileobj=tar_stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for name in [DATA_DIR] + [f"{DATA_DIR}/{d.as_posix()}" for d in folders]:
                    info = tarfile.TarInfo(name)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                    tar.addfile(info)
                for file in files:
                    info = tarfile.TarInfo(f"{DATA_DIR}/{file.relative_to(folder).as_posix()}")
                    info.size, info.mode, info.mtime = file.stat().st_size, 0o644, 0
                    with file.open("rb") as handle:
                        tar.addfile(info, handle)
    return tar_stream.digest, packed.digest, packed.size


def annotations_of(folder: Path, created: datetime) -> dict[str, str]:
    """The manifest's annotations: when, and from the model card (`README.md`, written by
    finetune_trainer/model_card.py) the job's name, what the model is and its base."""
    found = {CREATED: created.strftime("%Y-%m-%dT%H:%M:%SZ"),
             TITLE: folder.resolve().parent.name if folder.name in ("final", "merged")
             else folder.resolve().name}
    card = folder / "README.md"
    if card.is_file():
        text = card.read_text(encoding="utf-8", errors="replace")
        if (base := re.search(r"^base_model:\s*(\S+)\s*$", text, re.MULTILINE)):
            found[BASE_MODEL] = base.group(1).strip("'\"")
        if (heading := re.search(r"^# (.+)\n+([^#\n].*)$", text, re.MULTILINE)):
            found[TITLE] = heading.group(1).strip()
            found[DESCRIPTION] = heading.group(2).strip()[:512]
    return found


def pack(folder: Path, work: Path, created: datetime | None = None) -> Packed:
    """`folder` as a config, a layer and a manifest, the blobs written under `work`;
    `created` defaults to when its newest file was written (a folder pushed again makes the
    same manifest)."""
    files = model_files(folder)
    if not files:
        raise ExportError.of_folder(folder, "holds no files", "export a model folder: a "
                                    "job's final/ (or merged/) once training has ended")
    tar_digest, layer_digest, layer_size = write_layer(folder, files, work / "layer.tar.gz")
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {
        "type": "layers", "diff_ids": [tar_digest]}}, sort_keys=True).encode()
    (work / "config.json").write_bytes(config)
    config_blob = Blob(CONFIG_TYPE, _digest(config), len(config), work / "config.json")
    layer_blob = Blob(LAYER_TYPE, layer_digest, layer_size, work / "layer.tar.gz")
    manifest = {
        "schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": config_blob.descriptor(),
        "layers": [layer_blob.descriptor({TITLE: DATA_DIR, UNPACK: "true",
                                          TAR_DIGEST: tar_digest})],
        "annotations": annotations_of(folder, created or datetime.fromtimestamp(
            max(f.stat().st_mtime for f in files), timezone.utc))}
    return Packed(config_blob, layer_blob, json.dumps(manifest, sort_keys=True).encode(),
                  [str(f.relative_to(folder)) for f in files])


# --- credentials --------------------------------------------------------------------------

def docker_configs() -> list[Path]:
    """Where Docker-style credentials are looked for, in order."""
    found = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        found.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    if os.environ.get("DOCKER_CONFIG"):
        found.append(Path(os.environ["DOCKER_CONFIG"]) / "config.json")
    found.append(Path.home() / ".docker" / "config.json")
    return found


def credentials_for(registry: str, configs: list[Path] | None = None
                    ) -> tuple[str, str] | None:
    """The user and password (or token) a Docker config holds for `registry` (inline, or
    through its credential helper: `credHelpers`, `credsStore`), else None."""
    for path in configs if configs is not None else docker_configs():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for key, entry in config.get("auths", {}).items():
            host = re.sub(r"^https?://", "", key).split("/", 1)[0]
            if host != registry or not isinstance(entry, dict):
                continue
            if entry.get("auth"):
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
                return user, password
            if entry.get("username"):
                return entry["username"], entry.get("password", "")
        helper = config.get("credHelpers", {}).get(registry) or config.get("credsStore")
        if helper and (found := _from_helper(helper, registry)):
            return found
    return None


def _from_helper(helper: str, registry: str) -> tuple[str, str] | None:
    """`docker-credential-<helper> get` (Docker's credential helper protocol: the registry
    on stdin, {"Username", "Secret"} out); None where it is missing or knows nothing."""
    program = shutil.which(f"docker-credential-{helper}")
    if program is None:
        return None
    answer = subprocess.run([program, "get"], input=registry, capture_output=True, text=True,
                            timeout=30)
    if answer.returncode != 0:
        return None
    try:
        found = json.loads(answer.stdout)
    except ValueError:
        return None
    return (found["Username"], found["Secret"]) if found.get("Secret") else None


# --- the registry ---------------------------------------------------------------------------

class Transient(Exception):
    """A fault worth another try (no answer, 5xx, 429)."""


class Registry:
    """The distribution API's push calls, authenticated on the registry's challenge."""

    def __init__(self, reference: Reference, credentials: tuple[str, str] | None,
                 plain_http: bool) -> None:
        import requests  # ~17 ms: `finetune export` loads this module for every target

        self.reference, self.credentials = reference, credentials
        self.base = f"{'http' if plain_http else 'https'}://{reference.registry}/v2/"
        self.session = requests.Session()
        self.authorization: str | None = None

    def request(self, method: str, url: str, **kwargs):
        import requests  # as in __init__

        given = kwargs.pop("headers", {})
        for attempt in (1, 2):
            headers = {**given, **(
                {"Authorization": self.authorization} if self.authorization else {})}
            body = kwargs.get("data")
            if hasattr(body, "seek"):
                body.seek(0)
            try:
                response = self.session.request(method, url, headers=headers, timeout=60,
                                                allow_redirects=True, **kwargs)
            except requests.exceptions.SSLError as error:
                raise ExportError(str(self.reference), f"TLS to {self.reference.registry} "
                                  f"failed ({error.__class__.__name__})", "give its CA "
                                  "in REQUESTS_CA_BUNDLE, or --plain-http for a registry "
                                  "without TLS") from None
            except requests.exceptions.RequestException as error:
                if unresolved(error):  # no other try: a missing name stays missing
                    host = re.sub(r":[0-9]+$", "", self.reference.registry)
                    raise ExportError(str(self.reference), f"the registry host {host} does "
                                      "not resolve (no such name)", "check the host in the "
                                      "target, and that this machine's DNS knows it") from None
                raise Transient(f"{self.reference.registry} did not answer "
                                f"({no_answer(error)})") from None
            if response.status_code == 401 and attempt == 1:
                self._authenticate(response)
                continue
            break
        if response.status_code == 429 or response.status_code >= 500:
            raise Transient(f"{self.reference.registry} answered {response.status_code}")
        if response.status_code in (401, 403):
            raise self._refused(response)
        return response

    def _refused(self, response) -> ExportError:
        who = (f"the credentials for {self.reference.registry}" if self.credentials
               else "no credentials")
        return ExportError(
            str(self.reference), f"the registry refused the push with {who} "
            f"({response.status_code}{': ' + _said(response) if _said(response) else ''})",
            f"log in with push rights to {self.reference.repository} (`docker login "
            f"{self.reference.registry}` or `oras login`; in a cluster, a "
            "kubernetes.io/dockerconfigjson Secret)")

    def _authenticate(self, response) -> None:
        """Answer the challenge: Basic with the credentials, Bearer with a token the realm
        gives for pull and push on the repository."""
        challenge = response.headers.get("WWW-Authenticate", "")
        scheme, _, params = challenge.partition(" ")
        if self.credentials is None and scheme.lower() == "basic":
            raise self._refused(response)
        if scheme.lower() == "basic":
            user, password = self.credentials
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.authorization = f"Basic {token}"
            return
        if scheme.lower() != "bearer":
            raise self._refused(response)
        import requests  # as in __init__

        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        if not fields.get("realm"):  # no token service named: nothing to ask
            raise self._refused(response)
        query = {"scope": f"repository:{self.reference.repository}:pull,push"}
        if fields.get("service"):
            query["service"] = fields["service"]
        try:
            answer = self.session.get(fields["realm"], params=query, timeout=60,
                                      auth=self.credentials)
        except requests.exceptions.RequestException as error:  # tried again, as the registry
            raise Transient(f"the token service of {self.reference.registry}, "
                            f"{fields['realm']}, did not answer ({no_answer(error)})") from None
        if answer.status_code != 200:
            raise self._refused(answer)
        body = answer.json()
        self.authorization = f"Bearer {body.get('token') or body.get('access_token')}"

    def has_blob(self, blob: Blob) -> bool:
        url = f"{self.base}{self.reference.repository}/blobs/{blob.digest}"
        return self.request("HEAD", url).status_code == 200

    def put_blob(self, blob: Blob) -> None:
        start = self.request("POST", f"{self.base}{self.reference.repository}/blobs/uploads/")
        if start.status_code != 202 or "Location" not in start.headers:
            raise _unexpected(self.reference, "starting an upload", start)
        location = urljoin(self.base, start.headers["Location"])
        joiner = "&" if "?" in location else "?"
        with blob.path.open("rb") as handle:
            done = self.request("PUT", f"{location}{joiner}digest={blob.digest}", data=handle,
                                headers={"Content-Type": "application/octet-stream",
                                         "Content-Length": str(blob.size)})
        if done.status_code != 201:
            raise _unexpected(self.reference, f"uploading {blob.digest}", done)

    def put_manifest(self, manifest: bytes) -> str:
        url = f"{self.base}{self.reference.repository}/manifests/{self.reference.tag}"
        done = self.request("PUT", url, data=manifest, headers={"Content-Type": MANIFEST_TYPE})
        if done.status_code != 201:
            raise _unexpected(self.reference, "putting the manifest", done)
        return done.headers.get("Docker-Content-Digest") or _digest(manifest)


def _said(response) -> str:
    """The registry's own words (the distribution API's `errors[].message`)."""
    try:
        return "; ".join(e.get("message", "") for e in response.json().get("errors", []))
    except ValueError:
        return response.text[:200].strip()


def _unexpected(reference: Reference, doing: str, response) -> ExportError:
    return ExportError(str(reference), f"{doing} got {response.status_code} "
                       f"{_said(response)}".strip(), "check that the registry speaks the OCI "
                       "distribution API and that the repository name is allowed there")


def push(folder: Path, reference: Reference, *, plain_http: bool = False,
         say: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep,
         configs: list[Path] | None = None) -> str:
    """Pack `folder` and push it as `reference`, the blobs a registry holds already skipped;
    a transient fault tries again (ATTEMPTS). `configs`: the Docker configs holding its
    credentials (None: `docker_configs()`). Returns `registry/repository:tag@digest`."""
    with tempfile.TemporaryDirectory(prefix="finetune-export-") as work:
        packed = pack(folder, Path(work))
        size = packed.layer.size
        say(f"pushing {len(packed.files)} files ({size / 2**20:.1f} MiB packed) from {folder} "
            f"to {reference}")
        credentials = credentials_for(reference.registry, configs)
        for attempt in range(1, ATTEMPTS + 1):
            registry = Registry(reference, credentials, plain_http)
            try:
                for blob in (packed.layer, packed.config):
                    if not registry.has_blob(blob):
                        registry.put_blob(blob)
                digest = registry.put_manifest(packed.manifest)
                break
            except Transient as fault:
                wait_to_try_again(attempt, fault, str(reference), "the registry", say, sleep)
    pushed = f"{reference}@{digest}"
    say(f"pushed {pushed}")
    return pushed
