"""A real OCI registry for the tests: distribution v3's `registry` (built by `make cluster-bin`
into controlplane.registry_tools_dir(), beside the `oras` CLI), on loopback, with htpasswd
basic auth and TLS from a CA made here, or plain HTTP without auth."""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support import waits

sys.path.insert(0, str(REPO / "cluster"))  # cluster/controlplane.py: what `make cluster` runs
import controlplane

USER, PASSWORD = "trainer", "s3cret-for-tests"


def tool(name: str) -> Path:
    """`registry` or `oras`; the test is skipped, saying how to build them, where missing."""
    path = controlplane.registry_tools_dir() / name
    if not path.exists():
        pytest.skip(f"{name} is not built: `make cluster-bin` builds it (Go 1.26+)")
    return path


@dataclass
class RealRegistry:
    host: str
    """`127.0.0.1:port`."""
    ca: Path | None
    """The CA its certificate is signed by (None: plain HTTP)."""
    process: subprocess.Popen

    def docker_config(self, folder: Path, user: str = USER, password: str = PASSWORD) -> Path:
        """A Docker config folder (`DOCKER_CONFIG`) holding credentials for this registry."""
        folder.mkdir(parents=True, exist_ok=True)
        auth = base64.b64encode(f"{user}:{password}".encode()).decode()
        (folder / "config.json").write_text(json.dumps({"auths": {self.host: {"auth": auth}}}))
        return folder

    def oras(self, *args: str, cwd: Path | None = None, login: bool = True
             ) -> subprocess.CompletedProcess:
        """The oras CLI against this registry, as users run it."""
        where = ["--ca-file", str(self.ca)] if self.ca else ["--plain-http"]
        credentials = ["-u", USER, "-p", PASSWORD] if login and self.ca else []
        command, *rest = args
        return subprocess.run([str(tool("oras")), command, *where, *credentials, *rest],
                              capture_output=True, text=True, cwd=cwd,
                              timeout=waits.seconds_left())


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for 127.0.0.1 it signed: (ca, cert, key)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "2", "-subj", "/CN=finetune-tests-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "registry.key", "-out",
            "registry.csr", "-subj", "/CN=127.0.0.1")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "registry.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "registry.crt", "-days", "2", "-extfile", "san.ext")
    return folder / "ca.crt", folder / "registry.crt", folder / "registry.key"


@contextlib.contextmanager
def running(folder: Path, secure: bool = True) -> Iterator[RealRegistry]:
    """`start`, and the registry stopped after."""
    started = start(folder, secure)
    try:
        yield started
    finally:
        started.process.terminate()
        started.process.wait(timeout=30)


def start(folder: Path, secure: bool = True) -> RealRegistry:
    """The registry serving from `folder`: TLS and htpasswd where `secure`, else plain HTTP
    open to anyone. Waits until it answers /v2/."""
    import bcrypt
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    port = controlplane.free_port()
    config: dict = {"version": 0.1, "log": {"level": "warn"},
                    "storage": {"filesystem": {"rootdirectory": str(folder / "storage")}},
                    "http": {"addr": f"127.0.0.1:{port}", "secret": "tests-only"}}
    ca = None
    if secure:
        ca, cert, key = _certificates(folder)
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=5)).decode()
        (folder / "htpasswd").write_text(f"{USER}:{hashed}\n")
        config["http"]["tls"] = {"certificate": str(cert), "key": str(key)}
        config["auth"] = {"htpasswd": {"realm": "finetune-tests",
                                       "path": str(folder / "htpasswd")}}
    (folder / "config.yml").write_text(yaml.safe_dump(config))
    log = (folder / "registry.log").open("w")
    process = subprocess.Popen([str(tool("registry")), "serve", str(folder / "config.yml")],
                               stdout=log, stderr=subprocess.STDOUT)
    registry = RealRegistry(f"127.0.0.1:{port}", ca, process)

    def listening() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the registry exited: {(folder / 'registry.log').read_text()}")
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    waits.wait_until(listening, f"the registry listening on {port}")
    return registry
