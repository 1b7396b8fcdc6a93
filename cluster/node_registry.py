"""The cluster's image registry: distribution's `registry` (built with the control plane,
REGISTRY_TOOLS), where `make cluster-images` pushes our two images and the real node's kubelet
pulls them from, as a cluster pulls from ACR:

    host                                      namespace finetune-node-N
    registry on 10.250.N.1:5000  <-veth->     containerd pulls (hosts.toml: the CA to trust),
    TLS: a certificate the cluster's CA       with the credentials of the pods' pull Secret
    signed; htpasswd basic auth               (kubernetes.io/dockerconfigjson)

Every repository needs credentials (the pull Secret `registry-pull`, made in the namespaces
that pull: `pull_secret`). The storage is in the cache, shared by every cluster of this
machine, so that an image is pushed once; pushes take a lock on it, and a push of an image's
new build deletes the earlier builds of that image and collects their blobs (a trainer build
is 6 GB). Each cluster has its own password, in its folder.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import secrets
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from build_cache import cache_dir

PORT = 5000
USER = "finetune"
PULL_SECRET = "registry-pull"
"""The docker-registry Secret the chart's values name (imagePullSecrets), in the operator's
namespace and in each namespace whose jobs pull our trainer image."""
MEDIA_TYPES = ("application/vnd.oci.image.manifest.v1+json",
               "application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.v2+json")


class RegistryError(RuntimeError):
    """Something a user can act on: the message says what and how."""


def storage() -> Path:
    return cache_dir("registry") / "storage"


@dataclass(frozen=True)
class NodeRegistry:
    """The registry of the control plane whose state lives in `folder`'s parent, serving on
    the host's end of its node's link."""

    folder: Path
    """`<cluster>/registry`: its configuration, certificate, htpasswd and password."""
    address: str
    port: int = PORT

    @property
    def host(self) -> str:
        """What image references start with: `10.250.N.1:5000`."""
        return f"{self.address}:{self.port}"

    @property
    def ca(self) -> Path:
        """The CA its certificate is signed by (the control plane's), alone in its folder:
        what clients' `--cert-dir` / `--ca-file` take."""
        return self.folder / "trust" / "ca.crt"

    @property
    def password(self) -> str:
        return (self.folder / "password").read_text().strip()

    # --- serving -----------------------------------------------------------------------------
    def configure(self, pki: Path) -> Path:
        """Certificate (signed by `pki`'s CA, for this address), htpasswd with a fresh
        password, and the registry's configuration; the configuration's path."""
        import bcrypt

        self.ca.parent.mkdir(parents=True, exist_ok=True)
        self.ca.write_bytes((pki / "ca.crt").read_bytes())
        (self.folder / "san.ext").write_text(f"subjectAltName=IP:{self.address}\n"
                                             "extendedKeyUsage=serverAuth\n")

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=self.folder, check=True, capture_output=True)

        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "registry.key", "-out",
                "registry.csr", "-subj", f"/CN={self.address}")
        openssl("x509", "-req", "-in", "registry.csr", "-CA", str(pki / "ca.crt"), "-CAkey",
                str(pki / "ca.key"), "-CAcreateserial", "-out", "registry.crt", "-days", "365",
                "-extfile", "san.ext")
        password = secrets.token_urlsafe(18)
        (self.folder / "password").write_text(password)
        (self.folder / "password").chmod(0o600)
        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=6)).decode()
        (self.folder / "htpasswd").write_text(f"{USER}:{hashed}\n")
        storage().mkdir(parents=True, exist_ok=True)
        config = self.folder / "config.yml"
        config.write_text(yaml.safe_dump({
            "version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(storage())},
                        "delete": {"enabled": True}},
            "http": {"addr": self.host, "secret": secrets.token_hex(16),
                     "tls": {"certificate": str(self.folder / "registry.crt"),
                             "key": str(self.folder / "registry.key")}},
            "auth": {"htpasswd": {"realm": "finetune-cluster",
                                  "path": str(self.folder / "htpasswd")}}}))
        return config

    def wait_ready(self, process: subprocess.Popen, timeout: float = 30.0) -> None:
        """Until it answers /v2/ (401: it asks for the credentials)."""
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RegistryError(f"the registry exited with {process.returncode}; is port "
                                    f"{self.port} on {self.address} taken? See "
                                    f"{self.folder.parent / 'logs' / 'registry.log'}")
            with contextlib.suppress(OSError):
                if self.request("GET", "/v2/", auth=False)[0] == 401:
                    return
            if time.monotonic() > deadline:
                raise RegistryError(f"the registry did not answer on {self.host} within "
                                    f"{timeout:.0f} s")
            time.sleep(0.2)

    # --- what clients need ---------------------------------------------------------------------
    def docker_config(self) -> dict:
        """`.dockerconfigjson`: what `kubectl create secret docker-registry` writes."""
        auth = base64.b64encode(f"{USER}:{self.password}".encode()).decode()
        return {"auths": {self.host: {"username": USER, "password": self.password,
                                      "auth": auth}}}

    def pull_secret(self, namespace: str, name: str = PULL_SECRET) -> dict:
        """The pods' pull Secret for this registry, in `namespace`."""
        data = base64.b64encode(json.dumps(self.docker_config()).encode()).decode()
        return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
                "metadata": {"name": name, "namespace": namespace},
                "data": {".dockerconfigjson": data}}

    def containerd_hosts(self, certs_d: Path) -> Path:
        """`certs.d/<host>/hosts.toml` (containerd's `config_path`): trust the cluster's CA
        for this registry, as a node trusts a private registry's."""
        folder = certs_d.resolve() / self.host
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ca.crt").write_bytes(self.ca.read_bytes())
        # the server alone, with its CA: a [host] entry beside it is tried first and the
        # server after, without that CA, so a missing tag read "x509: unknown authority"
        (folder / "hosts.toml").write_text(
            f'server = "https://{self.host}"\nca = "{folder / "ca.crt"}"\n')
        return certs_d

    # --- the API -------------------------------------------------------------------------------
    def request(self, method: str, path: str, auth: bool = True, body: bytes | None = None,
                content_type: str | None = None) -> tuple[int, dict[str, str], bytes]:
        """One call of the distribution API: (status, headers with lower-case names, body)."""
        context = ssl.create_default_context(cafile=str(self.ca))
        request = urllib.request.Request(f"https://{self.host}{path}", method=method,
                                         data=body, headers={"Accept": ", ".join(MEDIA_TYPES)})
        if content_type:
            request.add_header("Content-Type", content_type)
        if auth:
            token = base64.b64encode(f"{USER}:{self.password}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as response:
                status, headers, answer = response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            status, headers, answer = error.code, error.headers, error.read()
        return status, {k.lower(): v for k, v in headers.items()}, answer

    def digest(self, repository: str, tag: str) -> str | None:
        """The manifest digest `tag` names; None where the registry has no such tag."""
        status, headers, _ = self.request("HEAD", f"/v2/{repository}/manifests/{tag}")
        return headers.get("docker-content-digest") if status == 200 else None

    def has(self, repository: str, tag: str) -> bool:
        return self.digest(repository, tag) is not None

    def tags(self, repository: str) -> list[str]:
        status, _, body = self.request("GET", f"/v2/{repository}/tags/list")
        return (json.loads(body).get("tags") or []) if status == 200 else []

    def tag(self, reference: str, new_tag: str) -> str:
        """`reference` (`<host>/name:tag`) tagged `new_tag` too, as `crane tag` does: its
        manifest put again under the new tag. Returns the new reference."""
        name, tag = reference.removeprefix(f"{self.host}/").rsplit(":", 1)
        status, headers, manifest = self.request("GET", f"/v2/{name}/manifests/{tag}")
        if status != 200:
            raise RegistryError(f"{reference} is not in the registry ({status})")
        status, _, said = self.request("PUT", f"/v2/{name}/manifests/{new_tag}",
                                       body=manifest, content_type=headers["content-type"])
        if status != 201:
            raise RegistryError(f"tagging {reference} as {new_tag}: {status} {said[:300]!r}")
        return f"{self.host}/{name}:{new_tag}"

    # --- pushing -------------------------------------------------------------------------------
    def push(self, local: str, buildah, log, replace_earlier: bool = True) -> str:
        """`local` (`localhost/name:tag`, in buildah's storage) pushed as `<host>/name:tag`,
        its layers uncompressed (a local link: compressing 6 GB costs minutes, the node would
        then decompress them); skipped where the registry holds the tag. Where
        `replace_earlier`, the name's other builds (tags of another manifest) are deleted and
        their blobs collected. Returns the pushed reference."""
        name, tag = local.removeprefix("localhost/").rsplit(":", 1)
        reference = f"{self.host}/{name}:{tag}"
        if self.has(name, tag) and not replace_earlier:
            return reference
        started = time.monotonic()
        with self._storage_lock(log):
            if not self.has(name, tag):  # another cluster's push, meanwhile
                with _docker_config(self) as auth_file:
                    buildah("push", "--quiet", "--disable-compression", "--cert-dir",
                            str(self.ca.parent), "--authfile", str(auth_file), local,
                            f"docker://{reference}")
                log(f"  pushed {reference}: {time.monotonic() - started:.0f} s")
            if replace_earlier:
                self._replace_earlier(name, tag, log)
        return reference

    def _replace_earlier(self, name: str, tag: str, log) -> None:
        current = self.digest(name, tag)
        earlier = {d for t in self.tags(name) if (d := self.digest(name, t)) != current} - {None}
        for digest in earlier:  # the registry deletes by digest: every tag of it goes
            self.request("DELETE", f"/v2/{name}/manifests/{digest}")
        if earlier:
            self._collect_garbage(log)

    @contextlib.contextmanager
    def _storage_lock(self, log):
        """One push (and collection) at a time over the shared storage."""
        with open(storage().parent / ".push.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log("another cluster pushes to the registry's storage: waiting for it")
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _collect_garbage(self, log) -> None:
        """distribution's own collector: the blobs no manifest references any more."""
        from controlplane import registry_tools_dir

        result = subprocess.run([str(registry_tools_dir() / "registry"), "garbage-collect",
                                 "--delete-untagged", str(self.folder / "config.yml")],
                                capture_output=True, text=True)
        if result.returncode != 0:  # space not freed, nothing lost: said, not raised
            log(f"  the registry's garbage collection failed: {result.stderr.strip()[-500:]}")


@contextlib.contextmanager
def _docker_config(registry: NodeRegistry):
    """The credentials as a file only this user reads, removed after: never on a command
    line (`ps` shows those)."""
    path = registry.folder / f".auth-{os.getpid()}.json"
    path.touch(mode=0o600)
    path.write_text(json.dumps(registry.docker_config()))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)

