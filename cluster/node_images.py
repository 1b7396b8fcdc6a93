"""Images for the real node, built without a daemon: Debian's buildah builds them; our two
are pushed to the cluster's registry (node_registry.py) and the kubelet pulls them as a
cluster does (`imagePullPolicy: IfNotPresent`, a pull Secret); the pod sandbox (and the
images of the node's own tests) are imported into containerd, as a node image holds its pause.

- `finetune-pause`: the pod sandbox (cluster/pause, a static Go program, from scratch).
- `finetune-base`: Debian bookworm from Debian's packages (debootstrap minbase + Python 3.11
  and pip), standing in for `python:3.11-slim`, which no registry here can serve. Like that
  image, pip installs into the system Python (Debian's EXTERNALLY-MANAGED marker removed).
- our Dockerfiles (`operator/Dockerfile`, `trainer/Dockerfile`) built as users build them,
  with `--build-arg BASE=` the base above.

Each is named by a hash of what goes into it and kept in buildah's storage in the cache, so a
rebuild happens only when an input changes (and reuses the unchanged layers: the trainer's
dependencies); loading skips what the node's containerd already holds.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

from build_cache import cache_dir

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3",
                 "ca-certificates")
HOST_TRUST = (Path("/etc/ssl/certs/ca-certificates.crt"), Path("/etc/pip.conf"))
"""Mounted into builds where the host has them: on a machine whose TLS goes through a proxy
with its own CA, pip inside the build trusts what the host trusts. Not in the image."""


class ImageError(RuntimeError):
    """Something a user can act on: the message says what and how."""


def cache() -> Path:
    return cache_dir("images")


def buildah(*args: str, log_to: Path | None = None) -> str:
    """buildah with its storage in the cache (not the machine's /var/lib/containers)."""
    command = ["buildah", *_storage(), *args]
    if log_to is None:
        result = subprocess.run(command, capture_output=True, text=True)
        output = result.stdout + result.stderr
    else:
        with open(log_to, "w") as log:
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        output = log_to.read_text(errors="replace")
    if result.returncode != 0:
        raise ImageError(f"buildah {' '.join(args[:2])} failed:\n{output[-4000:]}")
    return result.stdout.strip() if log_to is None else ""


def _storage() -> list[str]:
    return ["--root", str(cache() / "storage"), "--runroot", "/run/finetune-buildah",
            "--storage-driver", "overlay"]


def digest_of(*parts: bytes | str | Path) -> str:
    """A short hash of files (by content, folders recursively) and strings."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            files = sorted(p for p in part.rglob("*") if p.is_file()) if part.is_dir() \
                else [part]
            for path in files:
                if "__pycache__" in path.parts:
                    continue
                digest.update(str(path.relative_to(REPO) if path.is_relative_to(REPO)
                                  else path).encode() + b"\0" + path.read_bytes())
        else:
            digest.update(part.encode() if isinstance(part, str) else part)
    return digest.hexdigest()[:12]


def exists(reference: str) -> bool:
    """Whether buildah's storage (the cache) holds `reference`."""
    return subprocess.run(["buildah", *_storage(), "inspect", "--type", "image", reference],
                          capture_output=True).returncode == 0


def _commit(container: str, reference: str, started: float, log) -> str:
    buildah("commit", "--quiet", container, reference)
    buildah("rm", container)
    return _built(reference, started, log)


def _built(reference: str, started: float, log) -> str:
    """Say how long `reference` took; untag the earlier builds of the same name (their
    layers stay while a newer build shares them)."""
    name = reference.rsplit(":", 1)[0]
    listed = buildah("images", "--format", "{{.Name}}:{{.Tag}}", "--filter",
                     f"reference={name}")
    for older in listed.split():
        if older != reference:
            subprocess.run(["buildah", *_storage(), "rmi", older], capture_output=True)
    log(f"  image {reference}: {time.monotonic() - started:.0f} s")
    return reference


def pause_image(pause_binary: Path, log) -> str:
    """The pod sandbox image: the pause program alone."""
    reference = f"localhost/finetune-pause:{digest_of(pause_binary)}"
    if exists(reference):
        return reference
    started = time.monotonic()
    container = buildah("from", "scratch")
    buildah("copy", container, str(pause_binary), "/pause")
    buildah("config", "--entrypoint", '["/pause"]', container)
    return _commit(container, reference, started, log)


def base_image(log) -> str:
    """Debian bookworm with Python 3.11 and pip, from Debian's packages (~80 s cold)."""
    reference = (f"localhost/finetune-base:{DEBIAN_SUITE}-"
                 f"{digest_of(DEBIAN_SUITE, *BASE_PACKAGES, 'no-externally-managed')}")
    if exists(reference):
        return reference
    started = time.monotonic()
    log(f"building the base image {reference} from Debian's packages (debootstrap)")
    with tempfile.TemporaryDirectory(dir=cache().parent, prefix="rootfs-") as scratch:
        rootfs = Path(scratch) / "rootfs"
        result = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR], capture_output=True, text=True)
        if result.returncode != 0:
            raise ImageError(f"debootstrap failed (is {DEBIAN_MIRROR} reachable?):\n"
                             f"{(result.stdout + result.stderr)[-3000:]}")
        for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        for cached in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / cached).glob("*"):
                if path.is_file():
                    path.unlink()
        container = buildah("from", "scratch")
        buildah("add", container, f"{rootfs}/", "/")
    buildah("config", "--env", "LANG=C.UTF-8", "--env",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--cmd", "python3", container)
    return _commit(container, reference, started, log)


def copied(dockerfile: Path) -> list[Path]:
    """What the Dockerfile's COPY lines take from the repository."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return [REPO / source for line in text.splitlines()
            if (words := line.split()) and words[0] == "COPY"
            and not any(w.startswith("--") for w in words) for source in words[1:-1]]


def dockerfile_image(dockerfile: Path, name: str, base: str, build_args: dict[str, str],
                     log) -> str:
    """`dockerfile` built from the repository as a user builds it (`buildah bud`, which reads
    the same Dockerfile as `docker build`), from `base`; named by a hash of the Dockerfile,
    the base, the build arguments and what its COPY lines take."""
    args = {"BASE": base, **build_args}
    reference = f"localhost/{name}:" + digest_of(
        dockerfile, REPO / ".dockerignore", *copied(dockerfile),
        *(f"{k}={v}" for k, v in sorted(args.items())))
    if exists(reference):
        return reference
    drop_stale_steps()
    started = time.monotonic()
    shown = dockerfile.relative_to(REPO) if dockerfile.is_relative_to(REPO) else dockerfile
    log(f"building {reference} from {shown}")
    volumes = [arg for path in HOST_TRUST if path.exists()
               for arg in ("--volume", f"{path}:{path}:ro")]
    build_log = cache() / "logs" / f"{name}.log"
    build_log.parent.mkdir(parents=True, exist_ok=True)
    try:
        # --layers: a build whose dependencies' layer is unchanged reuses it
        buildah("bud", "--isolation", "chroot", "--pull=never", "--layers", "-f",
                str(dockerfile), "-t",
                reference, *(a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")),
                *volumes, str(REPO), log_to=build_log)
    except ImageError:
        _remove_working_containers()
        raise
    built = _built(reference, started, log)
    drop_stale_steps()
    return built


STEP = re.compile(r"^--> (?:Using cache )?([0-9a-f]{11,})", re.MULTILINE)


def drop_stale_steps() -> None:
    """Remove the step images (`--layers`' cache) that no build in the logs made or reused.

    Each build whose inputs changed leaves its predecessor's steps behind, untagged, and a
    trainer step is 6 GB: a few changes to the dependencies filled the disk (CI failed with
    `no space left on device` committing the pip layer). The tagged images and the steps of
    the last build of each image (its log in the cache: the layers the next build reuses)
    stay."""
    used = {step[:11] for path in (cache() / "logs").glob("*.log")
            for step in STEP.findall(path.read_text(errors="replace"))}
    listed = json.loads(buildah("images", "--all", "--no-trunc", "--json") or "[]")
    stale = [row["id"] for row in listed if not row.get("names")
             and row["id"].removeprefix("sha256:")[:11] not in used]
    for image in stale:  # one at a time: an image a container still uses stays, quietly
        subprocess.run(["buildah", *_storage(), "rmi", image], capture_output=True)


def _remove_working_containers() -> None:
    """A failed `bud` leaves its working container (mounted) behind."""
    subprocess.run(["buildah", *_storage(), "rm", "--all"], capture_output=True)


def load(node, reference: str, log) -> None:
    """Into the node's containerd, unless it holds `reference` already: through a
    docker-archive (layers uncompressed, faster to import than to decompress), removed after."""
    listed = node.ctr("images", "ls", "-q", check=False).stdout
    if reference in listed.split():
        return
    started = time.monotonic()
    # first: the archive, containerd's copy of it and the unpacked layers are each as large
    # as the image (6 GB for the trainer's), and the earlier build's are on the disk besides
    _drop_earlier_builds(node, reference)
    archive = cache() / "archives" / (reference.replace("/", "_").replace(":", "-") + ".tar")
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.unlink(missing_ok=True)
    try:
        buildah("push", "--quiet", reference, f"docker-archive:{archive}:{reference}")
        node.ctr("images", "import", str(archive))
    finally:
        archive.unlink(missing_ok=True)
    log(f"  loaded {reference} into the node: {time.monotonic() - started:.0f} s")


def _drop_earlier_builds(node, reference: str) -> None:
    """Remove the node's earlier builds of `reference`'s image, and the `sha256:` names the
    kubelet's CRI gave them (same digest), so that containerd frees their layers (now:
    `--sync`) before `reference` comes in: a trainer image is 6 GB. A pod still running one
    keeps its layers until it ends."""
    rows = [line.split()[:3] for line in node.ctr("images", "ls").stdout.splitlines()[1:]
            if line.strip()]
    name = reference.rsplit(":", 1)[0]
    named = {ref: digest for ref, _, digest in rows if not ref.startswith("sha256:")}
    earlier = {digest for ref, digest in named.items()  # an unchanged rebuild: same digest
               if ref.rsplit(":", 1)[0] == name and digest != named.get(reference)}
    kept = {digest for ref, digest in named.items() if digest not in earlier}
    unused = [ref for ref, _, digest in rows if digest in earlier or (
        ref.startswith("sha256:") and digest not in kept)]
    if unused:
        node.ctr("images", "rm", "--sync", *unused, check=False)


TRAINER_BUILD_ARGS = {"TORCH": "torch==2.13.0", "DEMO": "1"}
"""PyPI's torch (the CUDA build: no other index is reachable here; it runs on CPU) and the demo
model baked in, as `make kind-e2e` builds its CPU image."""


def build_product_images(log) -> dict[str, str]:
    """The operator's and the trainer's images built from our Dockerfiles (cached by their
    inputs): {"operator": reference, "trainer": reference}."""
    base = base_image(log)
    return {
        "operator": dockerfile_image(REPO / "operator" / "Dockerfile", "finetune-operator",
                                     base, {}, log),
        "trainer": dockerfile_image(REPO / "trainer" / "Dockerfile", "finetune-trainer",
                                    base, TRAINER_BUILD_ARGS, log)}


def published(registry, node, log) -> dict[str, str]:
    """Our two images, built if need be and pushed to the cluster's `registry`:
    {"operator": reference, "trainer": reference} in the registry. The node's earlier pulls
    of them go (a trainer build is 6 GB; a pod still running one keeps it)."""
    pushed = {}
    for role, local in build_product_images(log).items():
        pushed[role] = registry.push(local, buildah, log)
        _drop_earlier_builds(node, pushed[role])
    return pushed


def helm_values(pushed: dict[str, str], pull_secret: str) -> dict:
    """The chart's values that run these images (`helm install -f`): pulled from the
    registry with the `pull_secret` (the operator's pod and, by default, the workers)."""
    repository, tag = pushed["operator"].rsplit(":", 1)
    trainer_repository, trainer_tag = pushed["trainer"].rsplit(":", 1)
    return {"image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
            "imagePullSecrets": [{"name": pull_secret}],
            "trainer": {"image": {"repository": trainer_repository, "tag": trainer_tag}}}
