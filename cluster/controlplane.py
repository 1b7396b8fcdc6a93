"""A real Kubernetes control plane on 127.0.0.1, without Docker: etcd, kube-apiserver (RBAC),
kube-controller-manager, kube-scheduler, KWOK playing the kubelets of fake nodes, and Kueue
(cluster/kueue_manager.py).

    python cluster/controlplane.py build     # the binaries, once per version (cached)
    python cluster/controlplane.py build-images   # the node's images (cached by inputs)
    python cluster/controlplane.py build-product-images   # the same but the pause image:
                                             # no Go needed (.ci/run: beside the Go build)
    python cluster/controlplane.py up        # start in the background: .cluster/
    python cluster/controlplane.py up --no-kueue   # the same without Kueue
    python cluster/controlplane.py install   # CRD, chart, the operator's kubeconfig
    python cluster/controlplane.py images    # our images, built and pushed to the registry
    python cluster/controlplane.py pull-secret --namespace NS   # its pull Secret in NS
    python cluster/controlplane.py down      # stop what `up` started

`make cluster` / `make cluster-down` call this; the tests' `real_cluster` fixture uses the
same `ControlPlane` in a folder of its own. Binaries are built from the Go modules beside this
file (go.mod / go.sum pin every version) into a cache outside the repository keyed by those
files, so only the first build on a machine pays (measured in docs/design/development.md,
"Build times").
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kueue_manager
import node_images as images
import node_registry
import real_node
import yaml
from build_cache import cache_dir
from processes import alive, processes_naming, terminate

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KUBERNETES_VERSION = "v1.36.3"
MODULES = ("kube", "etcd", "kwok", "kueue", "coredns", "pause", "helm")
BINARIES = {
    # binary: (module folder, package)
    "kube-apiserver": ("kube", "k8s.io/kubernetes/cmd/kube-apiserver"),
    "kube-controller-manager": ("kube", "k8s.io/kubernetes/cmd/kube-controller-manager"),
    "kube-scheduler": ("kube", "k8s.io/kubernetes/cmd/kube-scheduler"),
    "kubectl": ("kube", "k8s.io/kubernetes/cmd/kubectl"),
    "etcd": ("etcd", "."),
    "kwok": ("kwok", "sigs.k8s.io/kwok/cmd/kwok"),
    "kueue": ("kueue", "sigs.k8s.io/kueue/cmd/kueue"),
    # the real node (cluster/real_node.py)
    "kubelet": ("kube", "k8s.io/kubernetes/cmd/kubelet"),
    "kube-proxy": ("kube", "k8s.io/kubernetes/cmd/kube-proxy"),
    "coredns": ("coredns", "github.com/coredns/coredns"),
    "pause": ("pause", "."),
    # what users install the chart with
    "helm": ("helm", "helm.sh/helm/v3/cmd/helm"),
}
HELM_VERSION = "v3.22.0"  # as cluster/helm/go.mod pins it
REGISTRY_TOOLS = {
    # a real OCI registry (htpasswd basic auth, TLS) and the oras CLI: `finetune export`
    # pushes to the one and the tests pull back with the other
    "registry": ("registry", "github.com/distribution/distribution/v3/cmd/registry"),
    "oras": ("oras", "oras.land/oras/cmd/oras"),
}
"""Built with the control plane but cached apart, keyed by their own pins: adding or moving
one rebuilds them, not Kubernetes."""
LINT_TOOLS = {
    # `make lint` checks the GitHub workflows with it (the release one cannot run here)
    "actionlint": ("actionlint", "github.com/rhysd/actionlint/cmd/actionlint"),
}
"""Built by `make lint` where missing (seconds with a warm Go cache), cached apart."""
ADMIN_TOKEN_USER = "finetune-admin"
SERVICE_CIDR = "10.96.0.0/16"
OPERATOR_NAMESPACE = "finetune-system"
"""The chart's namespace in the docs and tests: its service accounts are audited."""
POD_CIDR = "127.64.0.0/16"
"""Pod IPs on loopback: what a pod serves (the trainer's /progress) can be played by a test
server bound to that pod's own IP, and nothing leaves the machine."""


class ControlPlaneError(RuntimeError):
    """Something a user can act on: the message says what and how."""


# --- binaries -------------------------------------------------------------------------------
def cache_root() -> Path:
    return cache_dir("control-plane")


def cache_key(modules: tuple[str, ...] = MODULES) -> str:
    """Kubernetes version + a hash of every go.mod/go.sum/main.go and the Go version: a change
    to any pin builds anew, nothing else does."""
    digest = hashlib.sha256()
    for module in modules:
        for name in ("go.mod", "go.sum", "main.go"):
            path = HERE / module / name
            if path.exists():
                digest.update(f"{module}/{name}\0".encode() + path.read_bytes())
    digest.update(go_version().encode())
    return f"{KUBERNETES_VERSION}-{digest.hexdigest()[:12]}"


def go_version() -> str:
    go = shutil.which("go")
    if go is None:
        raise ControlPlaneError("Go is not installed: the control plane is built from Go modules "
                                "(install Go 1.26+ and run `make cluster` again)")
    return subprocess.run([go, "env", "GOVERSION"], check=True, capture_output=True,
                          text=True).stdout.strip()


def binaries_dir() -> Path:
    return cache_root() / cache_key()


def lint_tools_dir() -> Path:
    """Where `actionlint` is (LINT_TOOLS), once `actionlint` has built it."""
    return cache_dir("lint-tools") / cache_key(tuple(sorted(
        {module for module, _ in LINT_TOOLS.values()})))


def registry_tools_dir() -> Path:
    """Where `registry` and `oras` are (REGISTRY_TOOLS), once `build` has run."""
    return cache_dir("registry-tools") / cache_key(tuple(sorted(
        {module for module, _ in REGISTRY_TOOLS.values()})))


def _say(message: str) -> None:
    print(message, flush=True)  # seen at once under make or a pipe, before a long wait


def build(log=_say) -> Path:
    """The binaries folder, building what is missing. Prints the cold build time. One build
    at a time per folder (a lock file): a second `make cluster` or test session started
    meanwhile waits for the first and builds nothing."""
    target = binaries_dir()
    if not _built(target):
        _build_once(target, BINARIES, log)
        if not (target / kueue_manager.MANIFESTS).exists():
            kueue_manager.render_manifests(target / "kubectl", target)
    _build_once(registry_tools_dir(), REGISTRY_TOOLS, log)
    return target


def _build_once(target: Path, binaries: dict[str, tuple[str, str]], log) -> None:
    """Build what of `binaries` `target` lacks, one process at a time (a lock file)."""
    if all((target / b).exists() for b in binaries):
        return
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another process is building {_what(binaries)} into {target}: waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [b for b in binaries if not (target / b).exists()]
        if missing:
            _build(target, missing, log, binaries)


def _built(target: Path) -> bool:
    return all((target / b).exists() for b in (*BINARIES, kueue_manager.MANIFESTS))


def _what(binaries: dict[str, tuple[str, str]]) -> str:
    return {id(BINARIES): "the control plane", id(LINT_TOOLS): "actionlint"}.get(
        id(binaries), "the registry tools")


def _build(target: Path, missing: list[str], log,
           binaries: dict[str, tuple[str, str]] = BINARIES) -> None:
    what = _what(binaries)
    log(f"building {what} ({', '.join(missing)}) into {target}; "
        "cold, this takes minutes (docs/design/development.md, \"Build times\")")
    version_flags = []
    major, minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        version_flags += [f"-X {package}.gitVersion={KUBERNETES_VERSION}",
                          f"-X {package}.gitMajor={major}", f"-X {package}.gitMinor={minor}"]
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly -buildvcs=false"}
    started = time.monotonic()
    # kube-apiserver first: it compiles the shared code the other three reuse from the cache.
    for binary in missing:
        module, package = binaries[binary]
        flags = {"kube": version_flags, "kueue": kueue_manager.VERSION_FLAGS,
                 "helm": (f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",)
                 }.get(module, ())
        ldflags = " ".join(("-s -w", *flags))
        partial = target / f".{binary}.partial"
        one = time.monotonic()
        result = subprocess.run(["go", "build", "-trimpath", "-ldflags", ldflags, "-o",
                                 str(partial), package], cwd=HERE / module, env=env,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise ControlPlaneError(f"building {binary} failed:\n{result.stderr[-4000:]}")
        partial.rename(target / binary)
        log(f"  {binary}: {time.monotonic() - one:.0f} s")
    log(f"{what} built in {time.monotonic() - started:.0f} s")


# --- certificates and credentials -----------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(folder: Path, address: str = "127.0.0.1") -> None:
    """A CA, the API server's serving certificate (for 127.0.0.1 and `address`), its client
    certificate for kubelets, and the service-account signing key."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "apiserver.crt").exists():
        return
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "365", "-subj", "/CN=finetune-control-plane-ca", cwd=folder)
    (folder / "san.cnf").write_text(
        "[req]\ndistinguished_name=dn\n[dn]\n[ext]\n"
        f"subjectAltName=IP:127.0.0.1,IP:{address},IP:10.96.0.1,DNS:localhost,"
        "DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,"
        "DNS:kubernetes.default.svc.cluster.local\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out",
             "apiserver.csr", "-subj", "/CN=kube-apiserver", cwd=folder)
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "apiserver.crt", "-days", "365", "-extfile",
             "san.cnf", "-extensions", "ext", cwd=folder)
    # what the API server shows a kubelet (logs, exec, port-forward)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kubelet-client.key", "-out",
             "kubelet-client.csr", "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client",
             cwd=folder)
    _openssl("x509", "-req", "-in", "kubelet-client.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "kubelet-client.crt", "-days", "365", cwd=folder)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=folder)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)


def kubeconfig(server: str, user: str, token: str | None = None, ca: Path | None = None,
               namespace: str = "default") -> dict:
    """A kubeconfig with one context, as `kubectl config` writes it: `server` (with its CA
    unless it is plain http, as an emulator is) and one user (a bearer token, if given)."""
    cluster: dict = {"server": server}
    if ca is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca.read_bytes()).decode()
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": user,
        "clusters": [{"name": "finetune-control-plane", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token} if token else {}}],
        "contexts": [{"name": user, "context": {
            "cluster": "finetune-control-plane", "user": user, "namespace": namespace}}],
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- installing the product ----------------------------------------------------------------
RELEASE = "finetune"


@dataclass
class Installation:
    plane: ControlPlane
    service_account: str
    operator_kubeconfig: Path
    """Only a token of the chart's ServiceAccount: never admin credentials."""
    operator_env: dict[str, str]
    """The FINETUNE_* settings the chart's Deployment gives the operator."""

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
        """kubectl as the cluster's admin (a user, or a test in the user's seat)."""
        return self.plane.kubectl_run(*args, **kwargs)


def render_chart(namespace: str = OPERATOR_NAMESPACE, values: dict | None = None) -> list[dict]:
    """The chart's objects, rendered by the real Helm engine (helm-python-sdk, in the dev
    extra) as `helm install` would; `values` default to the chart's ci/images-values.yaml
    (the two images every install names: KWOK's pods pull nothing)."""
    import helm_python as helm

    chart_dir = REPO / "charts" / "finetune-operator"
    if values is None:
        values = yaml.safe_load((chart_dir / "ci" / "images-values.yaml").read_text())
    chart = helm.Chart.load(str(chart_dir))
    out = chart.render(values, name=RELEASE, namespace=namespace, is_install=True)
    return [d for path, text in out.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


# --- the processes --------------------------------------------------------------------------
@dataclass
class ControlPlane:
    """One control plane whose state (certificates, etcd data, logs, pids, kubeconfig) lives
    in `folder`. Ports are chosen free at `start` and kept in `folder/state.json`."""

    folder: Path
    bin: Path = field(default_factory=binaries_dir)
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    kueue: bool = True
    """Start Kueue too (cluster/kueue_manager.py), with the queues of cluster/."""
    node: bool = False
    """Start a real node too (cluster/real_node.py): the API server then listens on the host's
    end of the node's link instead of 127.0.0.1, and KWOK's CPU node is left out."""
    address: str = "127.0.0.1"
    real_node: real_node.RealNode | None = None
    registry: node_registry.NodeRegistry | None = None
    """With the real node: the registry its kubelet pulls our images from (node_registry.py)."""

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.ports['apiserver']}"

    def attach(self) -> None:
        """The ports and address of the plane another process started, from state.json:
        with the real node the API server listens on the host's end of the node's link, not
        127.0.0.1 (`make cluster-install` wrote a kubeconfig no one could log in with)."""
        state = json.loads((self.folder / "state.json").read_text())
        self.ports, self.address = state["ports"], state["address"]

    @property
    def admin_kubeconfig(self) -> Path:
        return self.folder / "admin.kubeconfig"

    @property
    def kubectl(self) -> Path:
        return self.bin / "kubectl"

    def spawn(self, name: str, *args: str, binary: Path | None = None,
              env: dict[str, str] | None = None) -> None:
        log = open(self.folder / "logs" / f"{name}.log", "ab")  # noqa: SIM115 (kept open)
        self.processes[name] = subprocess.Popen(
            [str(binary or self.bin / name), *args], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **env} if env else None,
            stdin=subprocess.DEVNULL, start_new_session=True)
        (self.folder / "pids" / name).write_text(str(self.processes[name].pid))

    def start(self, timeout: float = 90.0) -> None:
        """Start everything and wait until the API server is ready, the nodes Ready and the
        controllers' service accounts exist. Raises with the failing process's log tail."""
        for sub in ("logs", "pids", "pki"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        network = None
        if self.node:
            pause = images.pause_image(self.bin / "pause", _say)  # before anything starts
            network = real_node.free_network()
            network.create()
            self.address = network.host_ip
            self.registry = node_registry.NodeRegistry(self.folder / "registry", self.address)
            self.real_node = real_node.RealNode(self.folder / "node", self.bin, network,
                                                sandbox_image=pause,
                                                registry_hosts=self.folder / "node" / "certs.d")
        make_pki(self.folder / "pki", self.address)
        pki = self.folder / "pki"
        self.ports = {k: free_port() for k in
                      ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler",
                       "kwok", "kueue-webhook", "kueue-health", "kueue-metrics")}
        (self.folder / "state.json").write_text(json.dumps({
            "ports": self.ports, "address": self.address,
            "node": network.index if network else None,
            "registry": self.registry.host if self.registry else None}))
        users = [ADMIN_TOKEN_USER, "controller-manager", "scheduler", "kwok",
                 *(real_node.NODE_USERS if self.node else ())]
        tokens = {user: base64.b32encode(os.urandom(20)).decode().lower() for user in users}
        node_lines = "".join(
            f"{tokens[component]},{user},{10 + i}" + (f',"{groups}"' if groups else "") + "\n"
            for i, (component, (user, groups)) in enumerate(real_node.NODE_USERS.items())
            if component in tokens)
        (pki / "tokens.csv").write_text(
            f"{tokens[ADMIN_TOKEN_USER]},{ADMIN_TOKEN_USER},1,\"system:masters\"\n"
            f"{tokens['controller-manager']},system:kube-controller-manager,2\n"
            f"{tokens['scheduler']},system:kube-scheduler,3\n"
            f"{tokens['kwok']},kwok,4,\"system:masters\"\n" + node_lines)
        kubelet_flags = (
            "--kubelet-preferred-address-types", "InternalIP",
            "--kubelet-client-certificate", str(pki / "kubelet-client.crt"),
            "--kubelet-client-key", str(pki / "kubelet-client.key")) if self.node else ()
        etcd_url = f"http://127.0.0.1:{self.ports['etcd']}"
        self.spawn("etcd", "--data-dir", str(self.folder / "etcd"), "--unsafe-no-fsync",
                   "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                   "--listen-peer-urls", f"http://127.0.0.1:{self.ports['etcd-peer']}",
                   "--initial-advertise-peer-urls",
                   f"http://127.0.0.1:{self.ports['etcd-peer']}",
                   "--initial-cluster",
                   f"default=http://127.0.0.1:{self.ports['etcd-peer']}",
                   "--log-level", "warn")
        self.spawn("kube-apiserver",
                   "--etcd-servers", etcd_url, "--bind-address", self.address,
                   "--advertise-address", self.address, *kubelet_flags,
                   "--secure-port", str(self.ports["apiserver"]),
                   "--authorization-mode", "Node,RBAC",
                   "--token-auth-file", str(pki / "tokens.csv"),
                   "--client-ca-file", str(pki / "ca.crt"),
                   "--tls-cert-file", str(pki / "apiserver.crt"),
                   "--tls-private-key-file", str(pki / "apiserver.key"),
                   "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                   "--service-account-key-file", str(pki / "sa.pub"),
                   "--service-account-signing-key-file", str(pki / "sa.key"),
                   "--service-cluster-ip-range", SERVICE_CIDR,
                   "--audit-log-path", str(self.folder / "logs" / "audit.jsonl"),
                   "--audit-policy-file", str(self._audit_policy()),
                   "--profiling=false", "-v=1")
        admin = kubeconfig(self.server, "admin", tokens[ADMIN_TOKEN_USER], pki / "ca.crt")
        self.admin_kubeconfig.write_text(json.dumps(admin, indent=2))
        self._wait_ready(timeout)
        for component in ("controller-manager", "scheduler", "kwok"):
            user = {"controller-manager": "system:kube-controller-manager",
                    "scheduler": "system:kube-scheduler", "kwok": "kwok"}[component]
            path = self.folder / f"{component}.kubeconfig"
            path.write_text(json.dumps(kubeconfig(self.server, user, tokens[component],
                                                  pki / "ca.crt")))
        cm = str(self.folder / "controller-manager.kubeconfig")
        self.spawn("kube-controller-manager", "--kubeconfig", cm,
                   "--authentication-kubeconfig", cm, "--authorization-kubeconfig", cm,
                   "--controllers", "*", "--use-service-account-credentials=true",
                   "--leader-elect=false", "--bind-address", "127.0.0.1",
                   "--secure-port", str(self.ports["controller-manager"]),
                   "--service-account-private-key-file", str(pki / "sa.key"),
                   "--root-ca-file", str(pki / "ca.crt"),
                   "--service-cluster-ip-range", SERVICE_CIDR, "-v=1")
        sched = str(self.folder / "scheduler.kubeconfig")
        self.spawn("kube-scheduler", "--kubeconfig", sched,
                   "--authentication-kubeconfig", sched, "--authorization-kubeconfig", sched,
                   "--leader-elect=false", "--bind-address", "127.0.0.1",
                   "--secure-port", str(self.ports["scheduler"]), "-v=1")
        self.spawn("kwok", "--kubeconfig", str(self.folder / "kwok.kubeconfig"),
                   "--manage-all-nodes=false",
                   "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                   "--cidr", POD_CIDR, "--node-ip=127.0.0.1",
                   "--node-lease-duration-seconds=40",
                   "--server-address", f"127.0.0.1:{self.ports['kwok']}",
                   "-c", str(HERE / "kwok-stages.yaml"))
        nodes = yaml.safe_load((HERE / "nodes.yaml").read_text())  # anchors resolved here
        if self.registry is not None:
            self.spawn("registry", "serve", str(self.registry.configure(pki)),
                       binary=registry_tools_dir() / "registry",
                       env={"OTEL_TRACES_EXPORTER": "none"})  # else: a refused export a minute
            self.registry.wait_ready(self.processes["registry"])
            self.registry.containerd_hosts(self.folder / "node" / "certs.d")
        if self.real_node is not None:
            credentials = real_node.NodeCredentials(pki / "ca.crt", {
                component: self.kubeconfig_for(user, tokens[component])
                for component, (user, _) in real_node.NODE_USERS.items()})
            self.real_node.start(credentials, self.kubectl_run,
                                 lambda: images.load(self.real_node, pause, _say), timeout)
            # the real node is the cluster's CPU node: KWOK's stays out
            nodes["items"] = [n for n in nodes["items"] if n["metadata"]["name"] != "aks-cpu-0"]
        self.kubectl_run("apply", "-f", "-", input=json.dumps(nodes))
        self._wait_nodes_ready(timeout)
        if self.kueue:
            kueue_manager.start(self, timeout)

    def kubeconfig_for(self, user: str, token: str) -> dict[str, Any]:
        """A kubeconfig of this control plane holding only `user`'s token."""
        return kubeconfig(self.server, user, token, self.folder / "pki" / "ca.crt")

    def _audit_policy(self) -> Path:
        """Every request of a service account of `OPERATOR_NAMESPACE` (the operator's, when
        it runs as the chart's) at Metadata level, nothing else: what tests read to count
        the operator's calls, its creates and the ones RBAC refused."""
        path = self.folder / "pki" / "audit-policy.yaml"
        path.write_text(json.dumps({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata",
                       "userGroups": [f"system:serviceaccounts:{OPERATOR_NAMESPACE}"]},
                      {"level": "None"}]}))
        return path

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                tail = (self.folder / "logs" / f"{name}.log").read_text(errors="replace")
                raise ControlPlaneError(f"{name} exited with {process.returncode}:\n"
                                        f"{tail[-3000:]}")
        if self.real_node is not None:
            try:
                self.real_node.check_alive()
            except real_node.NodeError as error:
                raise ControlPlaneError(f"the real node's {error}") from None

    def _wait_ready(self, timeout: float) -> None:
        context = ssl.create_default_context(cafile=str(self.folder / "pki" / "ca.crt"))
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.server}/readyz", context=context,
                                            timeout=2) as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"kube-apiserver not ready within {timeout:.0f} s; "
                                        f"see {self.folder / 'logs' / 'kube-apiserver.log'}")
            time.sleep(0.3)

    def _wait_nodes_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            ready = self.kubectl_run(
                "get", "nodes", "-o",
                "jsonpath={range .items[*]}{.status.conditions[?(@.type=='Ready')].status}"
                "{'\\n'}{end}", check=False)
            sa = self.kubectl_run("get", "serviceaccount", "default", "-o", "name",
                                  check=False)
            statuses = ready.stdout.split()
            if statuses and all(s == "True" for s in statuses) and sa.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"nodes not Ready within {timeout:.0f} s: {statuses}; "
                                        f"see {self.folder / 'logs' / 'kwok.log'}")
            time.sleep(0.5)

    def kubectl_run(self, *args: str, check: bool = True, input: str | None = None,
                    kubeconfig_path: Path | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(self.kubectl), "--kubeconfig", str(kubeconfig_path or self.admin_kubeconfig),
             *args], capture_output=True, text=True, input=input)
        if check and result.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    def install(self, operator_namespace: str = OPERATOR_NAMESPACE) -> Installation:
        """Install as users do, except the operator's pod: the CRDs by `kubectl apply`; the
        chart rendered by the Helm engine and applied, all but its Deployment (the operator
        runs as a local process instead); and a kubeconfig holding only a token of the
        chart's ServiceAccount, so the API server enforces the chart's RBAC on it."""
        crds = sorted((REPO / "crds").glob("*.yaml"))
        self.kubectl_run("apply", "-f", str(REPO / "crds"))
        self.kubectl_run("wait", "--for=condition=Established", "--timeout=60s", *(
            f"crd/{yaml.safe_load(crd.read_text())['metadata']['name']}" for crd in crds))
        # discovery afresh: kubectl's cached discovery predates the CRD
        self.kubectl_run("api-resources", "--api-group=finetune.dev")
        # a new CRD's lists are refused (429, "storage is (re)initializing") until its watch
        # cache is up: an operator started at once would log its first watch as an ERROR
        deadline = time.monotonic() + 30
        for crd in crds:
            names = yaml.safe_load(crd.read_text())
            plural = f"{names['spec']['names']['plural']}.{names['spec']['group']}"
            while (self.kubectl_run("get", plural, "-A", check=False).returncode != 0
                   and time.monotonic() < deadline):
                time.sleep(0.2)
        self.kubectl_run("create", "namespace", operator_namespace)
        objects = render_chart(operator_namespace)
        deployment = next(o for o in objects if o["kind"] == "Deployment")
        rest = [o for o in objects if o["kind"] != "Deployment"]
        self.kubectl_run("apply", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": rest}))
        pod = deployment["spec"]["template"]["spec"]
        account = pod["serviceAccountName"]
        token = self.kubectl_run("create", "token", account, "-n", operator_namespace,
                                 "--duration", "24h").stdout.strip()
        path = self.folder / "operator.kubeconfig"
        path.write_text(json.dumps(kubeconfig(
            self.server, f"system:serviceaccount:{operator_namespace}:{account}", token,
            self.folder / "pki" / "ca.crt")))
        env = {e["name"]: e["value"] for e in pod["containers"][0].get("env", [])
               if "value" in e}
        return Installation(self, account, path, env)

    def running(self) -> bool:
        """Whether a process this folder started (maybe from another process) still runs."""
        pids = self.folder / "pids"
        return pids.exists() and any(alive(int(p.read_text())) for p in pids.glob("*")
                                     if p.read_text().strip().isdigit())

    def stop(self) -> None:
        """SIGTERM everything this folder started (also from another process), one at a
        time, clients first and etcd last, each SIGKILLed if still there after 10 s. All at
        once, the API server lost etcd while it shut down and waited out the 10 s every
        time (it sometimes ignores SIGTERM for ~45 s anyway)."""
        self._stop_node()
        pids = {}
        for pidfile in sorted((self.folder / "pids").glob("*")):
            with contextlib.suppress(ValueError):
                pids[pidfile.name] = int(pidfile.read_text())
            pidfile.unlink()
        order = ["registry", "kueue", "kwok", "kube-scheduler", "kube-controller-manager",
                 "kube-apiserver", "etcd"]
        for pid in [pids[n] for n in order if n in pids]:
            terminate(pid)
        # whatever a lost pid file left running (a test session killed while it started one)
        for pid in processes_naming(self.folder, self.bin):
            terminate(pid, grace=2)
        for process in self.processes.values():
            with contextlib.suppress(Exception):
                process.wait(timeout=5)
        self.processes.clear()

    def _stop_node(self) -> None:
        """The real node first (its pods, containerd, mounts, network), while the API
        server is still there; found from state.json when another process started it."""
        node = self.real_node
        if node is None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                index = json.loads((self.folder / "state.json").read_text())["node"]
                if index is not None:
                    node = real_node.RealNode(self.folder / "node", self.bin,
                                              real_node.NodeNetwork(index))
        if node is not None:
            node.stop()
        self.real_node = None

    def stop_one(self, name: str) -> None:
        """Stop one process of this control plane (a component's restart, in a test)."""
        pidfile = self.folder / "pids" / name
        with contextlib.suppress(FileNotFoundError, ValueError):
            terminate(int(pidfile.read_text()))
            pidfile.unlink()
        process = self.processes.pop(name, None)
        if process is not None:
            with contextlib.suppress(Exception):
                process.wait(timeout=5)


def actionlint(log=_say) -> int:
    """actionlint on .github/workflows, built first where missing; its exit code. Without
    Go (a machine that builds nothing) it says so and passes: CI has Go."""
    import shutil as _shutil

    if not (lint_tools_dir() / "actionlint").exists() and _shutil.which("go") is None:
        log("actionlint not run: Go is not installed to build it")
        return 0
    _build_once(lint_tools_dir(), LINT_TOOLS, log)
    workflows = sorted(str(p) for p in (REPO / ".github" / "workflows").glob("*.y*ml"))
    return subprocess.run([str(lint_tools_dir() / "actionlint"), *workflows]).returncode


# --- the command line -----------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["build", "build-images", "build-product-images",
                                           "up", "install", "images", "pull-secret", "down",
                                           "bin", "actionlint"])
    parser.add_argument("--folder", type=Path, default=REPO / ".cluster",
                        help="state folder (default: .cluster in the repository)")
    parser.add_argument("--no-kueue", dest="kueue", action="store_false",
                        help="up: without Kueue (make cluster KUEUE=0)")
    parser.add_argument("--no-node", dest="node", action="store_false",
                        help="up: without the real node, KWOK's nodes only (make cluster NODE=0)")
    parser.add_argument("--namespace", action="append", default=[],
                        help="pull-secret: the namespace to make the registry's pull Secret in "
                             "(repeatable; made if missing)")
    args = parser.parse_args(argv)
    try:
        if args.action == "bin":
            print(binaries_dir())
            return 0
        if args.action == "actionlint":
            return actionlint()
        if args.action == "build":
            build()
            return 0
        if args.action in ("build-images", "build-product-images"):
            if reason := real_node.unavailable():  # buildah and debootstrap included
                print(f"images not built: {reason}; the tests that need them are skipped")
                return 0
            started = time.monotonic()
            if args.action == "build-images":  # the pause image needs the Go build
                images.pause_image(build() / "pause", _say)
            images.build_product_images(_say)  # no Go: beside the Go build, in .ci/run
            print(f"images ready in {time.monotonic() - started:.0f} s")
            return 0
        node = args.node and args.action == "up"
        if node and (reason := real_node.unavailable()):
            print(f"no real node: {reason}; KWOK's nodes only", file=sys.stderr)
            node = False
        plane = ControlPlane(args.folder, bin=binaries_dir(), kueue=args.kueue, node=node)
        if args.action == "install":
            if not plane.running():
                raise ControlPlaneError(f"no control plane is running from {args.folder}: "
                                        "`make cluster` first")
            plane.attach()
            installed = plane.install()
            settings = " ".join(f"{k}={shlex.quote(v)}"
                                for k, v in sorted(installed.operator_env.items()))
            print(f"CRD and chart installed (all but the operator's Deployment).\n"
                  f"Run the operator as the chart's ServiceAccount "
                  f"({installed.service_account}):\n"
                  f"  KUBECONFIG={installed.operator_kubeconfig} {settings} "
                  f".venv/bin/finetune operator")
            return 0
        if args.action == "images":
            return _images(plane, args.folder)
        if args.action == "pull-secret":
            registry, _ = _registry_and_node(plane, args.folder)
            made = pull_secrets(plane, registry, tuple(args.namespace), create=True)
            print(f"pull Secret {node_registry.PULL_SECRET} for {registry.host} in "
                  f"{', '.join(made) or 'no namespace (--namespace NAME)'}")
            return 0
        if args.action == "down":
            plane.stop()
            print(f"control plane in {args.folder} stopped")
            return 0
        if plane.running():
            print(f"a control plane is already running from {args.folder}: "
                  f"{stop_command(args.folder)} first", file=sys.stderr)
            return 1
        build()
        shutil.rmtree(args.folder, ignore_errors=True)
        started = time.monotonic()
        try:
            plane.start()
        except BaseException:
            plane.stop()
            raise
        print(f"control plane ready in {time.monotonic() - started:.0f} s at {plane.server}\n"
              f"  export KUBECONFIG={plane.admin_kubeconfig}\n"
              f"  kubectl: {plane.kubectl}\n"
              + (f"  Kueue {kueue_manager.KUEUE_VERSION}: ClusterQueue gpu, LocalQueue "
                 "team-a in namespace ml-team (cluster/kueue-queues.yaml)\n"
                 if plane.kueue else "")
              + (f"  real node {real_node.NODE_NAME} ({plane.real_node.network.node_ip}, pods "
                 f"{plane.real_node.network.pod_cidr}): CPU pods run for real; KWOK plays "
                 "the GPU pools\n" if plane.real_node else "")
              + f"  logs: {args.folder / 'logs'}; stop with {stop_command(args.folder)}")
        return 0
    except (ControlPlaneError, kueue_manager.KueueError, node_registry.RegistryError,
            images.ImageError) as error:
        print(f"control plane: {error}", file=sys.stderr)
        return 1


PULLING_NAMESPACES = (OPERATOR_NAMESPACE, "default", "ml-team")
"""Where `images` makes the registry's pull Secret: the chart's namespace, and those the
examples' jobs run in (ml-team where Kueue's queues made it)."""


def _images(plane: ControlPlane, folder: Path) -> int:
    """Build our two images, push them to the running cluster's registry, make its pull
    Secret where pods pull them, and write the chart's values that run them."""
    registry, node = _registry_and_node(plane, folder)
    started = time.monotonic()
    values = images.helm_values(images.published(registry, node, _say),
                                node_registry.PULL_SECRET)
    made = pull_secrets(plane, registry, PULLING_NAMESPACES)
    (folder / "images.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    print(f"images built and pushed to {registry.host} in {time.monotonic() - started:.0f} s; "
          f"pull Secret {node_registry.PULL_SECRET} in {', '.join(made)} (another namespace: "
          f"`make cluster-pull-secret NAMESPACE=...`); their chart values: "
          f"{folder / 'images.yaml'}\n"
          f"  helm install finetune charts/finetune-operator -n {OPERATOR_NAMESPACE} "
          f"-f {folder / 'images.yaml'} --wait")
    return 0


def _registry_and_node(plane: ControlPlane, folder: Path
                       ) -> tuple[node_registry.NodeRegistry, real_node.RealNode]:
    state = json.loads((folder / "state.json").read_text()) if plane.running() else {}
    if state.get("node") is None or not state.get("registry"):
        raise ControlPlaneError(f"no real node runs from {folder}: our images are pushed to "
                                "its registry (`make cluster` as root, with the packages "
                                "`make tools` installs)")
    registry = node_registry.NodeRegistry(folder / "registry", state["address"])
    node = real_node.RealNode(folder / "node", plane.bin, real_node.NodeNetwork(state["node"]))
    return registry, node


def pull_secrets(plane: ControlPlane, registry: node_registry.NodeRegistry,
                 namespaces: tuple[str, ...], create: bool = False) -> list[str]:
    """The registry's pull Secret in each of `namespaces` that exists (or is made, where
    `create` or it is the operator's); the namespaces it is in."""
    made = []
    for namespace in namespaces:
        exists = plane.kubectl_run("get", "namespace", namespace, check=False).returncode == 0
        if not exists and not (create or namespace == OPERATOR_NAMESPACE):
            continue
        if not exists:
            plane.kubectl_run("create", "namespace", namespace)
        plane.kubectl_run("apply", "-f", "-", input=json.dumps(
            registry.pull_secret(namespace)))
        made.append(namespace)
    return made


def stop_command(folder: Path) -> str:
    """How to stop the control plane of `folder` (from the repo's root, as the Makefile
    runs this script): `make cluster-down` stops the repo's own (.cluster) only."""
    if folder.resolve() == (REPO / ".cluster").resolve():
        return "`make cluster-down`"
    return f"`.venv/bin/python cluster/controlplane.py --folder {folder} down`"


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
