"""A real node beside KWOK's fake ones: kubelet, containerd + runc, CNI (bridge), CoreDNS and
kube-proxy, in a network namespace of their own joined to the host by a veth pair.

    host                                   namespace finetune-node-N
    kube-apiserver on 10.250.N.1  <-veth->  10.250.N.2: kubelet, containerd, CoreDNS (:53),
    route 10.244.N.0/24 via 10.250.N.2      kube-proxy; bridge cni0 10.244.N.1 -> pods

Nothing leaves the machine: the namespace has no default route and the host does not forward
(its ip_forward is left as it is). The host reaches pod IPs by its route into the namespace,
as an operator on the host would reach pods over a VNet. Stopping leaves nothing behind: every
process of the node runs in cgroups under /finetune-node-N and is killed from there; mounts
under the node's folders are unmounted; the namespace, the veth pair and the route go; the
VM-wide sysctls the kubelet sets are put back.

Facts this rests on (measured on this kind of machine, ../shared/CONTROL-PLANE.md): cgroup v1
"hybrid" needs `failCgroupV1: false` and runc (crun refuses); root without CAP_SYS_RESOURCE
needs containerd's `restrict_oom_score_adj`; kubelet refuses a loopback node IP; `ip netns
exec` remounts /sys and hides the cgroups, `nsenter --net` does not.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from build_cache import cache_dir
from processes import alive

NODE_NAME = "finetune-node"
CNI_PLUGINS = Path("/usr/lib/cni")
DEBIAN_PACKAGES = {
    # what the node needs: (a file it installs, the Debian package)
    "containerd": ("/usr/bin/containerd", "containerd"),
    "runc": ("/usr/sbin/runc", "runc"),
    "CNI plugins": (str(CNI_PLUGINS / "bridge"), "containernetworking-plugins"),
    "iptables": ("/usr/sbin/iptables", "iptables"),
    "buildah": ("/usr/bin/buildah", "buildah"),
    "debootstrap": ("/usr/sbin/debootstrap", "debootstrap"),
}
KUBELET_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
"""VM-wide settings the kubelet changes at start: saved before the first node, put back when
the last one stops."""
SAVED_SYSCTLS = Path("/run/finetune-node-sysctls.json")
CGROUP_ROOT = Path("/sys/fs/cgroup")


class NodeError(RuntimeError):
    """Something a user can act on: the message says what and how."""


def unavailable() -> str | None:
    """Why this machine cannot host the real node, or None when it can."""
    if os.geteuid() != 0:
        return "the real node needs root (network namespaces, cgroups, mounts)"
    if shutil.which("nsenter") is None or shutil.which("ip") is None:
        return "the real node needs `ip` (iproute2) and `nsenter` (util-linux)"
    missing = [package for path, package in DEBIAN_PACKAGES.values() if not Path(path).exists()]
    if missing:
        return (f"the real node needs Debian's {', '.join(missing)} "
                f"(`make tools` installs them as root: apt-get install {' '.join(missing)})")
    if not (CGROUP_ROOT / "pids").is_dir():
        return "the real node expects cgroup v1 controllers under /sys/fs/cgroup (hybrid mode)"
    return None


def _run(*args: str, check: bool = True, input: str | None = None
         ) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, input=input)
    if check and result.returncode != 0:
        raise NodeError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


# --- the network ---------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeNetwork:
    """The addresses of node N: a /24 for the link to the host, a /24 for its pods."""

    index: int

    @property
    def namespace(self) -> str:
        return f"finetune-node-{self.index}"

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.namespace}"

    @property
    def host_link(self) -> str:
        return f"ftnode{self.index}"

    @property
    def host_ip(self) -> str:
        """The host's end of the link: where the API server listens for the node."""
        return f"10.250.{self.index}.1"

    @property
    def node_ip(self) -> str:
        return f"10.250.{self.index}.2"

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.index}.0/24"

    def exists(self) -> bool:
        return Path(self.netns_path).exists() or Path(f"/sys/class/net/{self.host_link}").exists()

    def create(self) -> None:
        """The namespace, the veth pair (eth0 inside), addresses, the host's route to the
        pods, and forwarding inside the namespace only."""
        _run("ip", "netns", "add", self.namespace)
        try:
            _run("ip", "link", "add", self.host_link, "type", "veth", "peer", "name", "eth0",
                 "netns", self.namespace)
            _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_link)
            _run("ip", "link", "set", self.host_link, "up")
            inside = ("nsenter", f"--net={self.netns_path}")
            _run(*inside, "ip", "addr", "add", f"{self.node_ip}/24", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            # per namespace: the host's own ip_forward is not touched
            _run(*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run("ip", "route", "add", self.pod_cidr, "via", self.node_ip)
        except NodeError:
            self.remove()
            raise

    def remove(self) -> None:
        _run("ip", "link", "del", self.host_link, check=False)  # the peer and the route too
        _run("ip", "netns", "del", self.namespace, check=False)


def free_network() -> NodeNetwork:
    for index in range(1, 250):
        network = NodeNetwork(index)
        if not network.exists() and not _slot_lock(index, probe=True):
            return network
    raise NodeError("no free node network (10.250.N.0/24): stop other clusters first")


def _slot_lock(index: int, probe: bool = False):
    """The lock of node N's containerd state in the cache (held by its containerd process
    for as long as it runs); with `probe`, whether another node holds it."""
    path = node_cache() / f"containerd-{index}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "w")  # noqa: SIM115 (handed to containerd)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return True if probe else None
    if probe:
        handle.close()
        return False
    return handle


def node_cache() -> Path:
    """Where each node's containerd keeps its images between runs."""
    return cache_dir("node")


# --- cgroups ---------------------------------------------------------------------------------
def _hierarchies() -> list[Path]:
    """Each cgroup v1 hierarchy (and the v2 one of hybrid mode) a process is placed in."""
    return [p for p in CGROUP_ROOT.iterdir() if p.is_dir() and (p / "cgroup.procs").exists()]


def _cgroup_paths(name: str) -> list[Path]:
    return [h / name for h in _hierarchies()]


def _make_cgroups(name: str) -> None:
    for path in _cgroup_paths(name):
        path.mkdir(exist_ok=True)
        if path.parent.name == "cpuset":  # a new cpuset has no CPUs until it is given some
            for setting in ("cpuset.cpus", "cpuset.mems"):
                (path / setting).write_text((path.parent / setting).read_text())


def _processes_in(name: str) -> set[int]:
    pids: set[int] = set()
    for top in _cgroup_paths(name):
        for procs in top.rglob("cgroup.procs") if top.exists() else ():
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in procs.read_text().split()}
    return pids


def _remove_cgroups(name: str) -> None:
    for top in _cgroup_paths(name):
        if not top.exists():
            continue
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()),
                                key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


# --- sysctls ------------------------------------------------------------------------------
def _save_sysctls() -> None:
    """Before the first node on this machine starts: what the kubelet will change."""
    if SAVED_SYSCTLS.exists():
        return
    values = {key: (Path("/proc/sys") / key).read_text().strip() for key in KUBELET_SYSCTLS}
    SAVED_SYSCTLS.write_text(json.dumps(values))


def _restore_sysctls() -> None:
    """After the last node stops: the values saved before the first."""
    if not SAVED_SYSCTLS.exists() or any(NodeNetwork(i).exists() for i in range(1, 250)):
        return
    for key, value in json.loads(SAVED_SYSCTLS.read_text()).items():
        with contextlib.suppress(OSError):
            (Path("/proc/sys") / key).write_text(value)
    SAVED_SYSCTLS.unlink()


# --- mounts -------------------------------------------------------------------------------
def _mounts_under(*folders: Path) -> list[str]:
    prefixes = [str(f.resolve()) + "/" for f in folders]
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any((point + "/").startswith(p) for p in prefixes):
            points.append(point)
    return points


def _unmount_under(*folders: Path) -> None:
    for point in sorted(_mounts_under(*folders), key=len, reverse=True):
        _run("umount", "-l", point, check=False)


# --- the node -----------------------------------------------------------------------------
NODE_USERS = {
    # component: (user, groups) of its token
    "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
    "kube-proxy": ("system:kube-proxy", ""),
    "coredns": ("coredns", ""),
}


@dataclass
class NodeCredentials:
    """What the control plane hands the node: the cluster's CA and a kubeconfig per
    component, each holding one token of `NODE_USERS`."""

    ca: Path
    kubeconfigs: dict[str, dict]


class RealNode:
    """Node N of a control plane whose state lives in `folder` (configs, logs, the kubelet's
    root); containerd's images live in the cache, one store per N, so images load once."""

    def __init__(self, folder: Path, bin: Path, network: NodeNetwork,
                 sandbox_image: str | None = None, registry_hosts: Path | None = None):
        self.folder = folder
        self.sandbox_image = sandbox_image
        self.registry_hosts = registry_hosts
        """containerd's `config_path` (`certs.d/<host>/hosts.toml`): how to reach the
        registries the node pulls from (node_registry.py writes the cluster's)."""
        self.bin = bin
        self.network = network
        self.cgroup = network.namespace
        self.run_dir = Path("/run") / network.namespace
        self.kubelet_dir = Path("/var/lib") / network.namespace
        """The kubelet's root: pods' volumes (on disk, not in /run's memory) and its unix
        sockets, whose paths must stay under 108 bytes (a test's folder is longer)."""
        self.processes: dict[str, subprocess.Popen] = {}

    # paths
    @property
    def containerd_root(self) -> Path:
        return node_cache() / f"containerd-{self.network.index}"

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    def ctr(self, *args: str, check: bool = True, input: str | None = None
            ) -> subprocess.CompletedProcess:
        """containerd's own client, in the namespace the kubelet uses (k8s.io)."""
        return _run("ctr", "--address", str(self.containerd_socket), "-n", "k8s.io", *args,
                    check=check, input=input)

    def start(self, credentials: NodeCredentials, kubectl, load_images,
              timeout: float = 90.0) -> None:
        """Configure and start the node's processes: containerd, then `load_images()` (the
        pod sandbox at least), then CoreDNS, kube-proxy and the kubelet. Returns once they
        run; the node's readiness is the control plane's to wait for."""
        for sub in ("logs", "pids", "config", "cni", "pod-logs"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.kubelet_dir.mkdir(parents=True, exist_ok=True)
        _make_cgroups(self.cgroup)
        _save_sysctls()
        lock = _slot_lock(self.network.index)
        if lock is None:
            raise NodeError(f"containerd state {self.containerd_root} is in use by another "
                            "node: stop it first")
        self._write_configs(credentials)
        config = self.folder / "config"
        self._spawn("containerd", ["containerd", "--config", str(config / "containerd.toml")],
                    pass_fds=(lock.fileno(),))
        lock.close()
        self._wait(lambda: self.ctr("version", check=False).returncode == 0, timeout,
                   "containerd did not answer")
        load_images()
        kubectl("apply", "-f", "-", input=json.dumps(coredns_rbac()))
        self._spawn("coredns", [str(self.bin / "coredns"), "-conf",
                                str(config / "Corefile")])
        self._spawn("kube-proxy", [str(self.bin / "kube-proxy"), "--config",
                                   str(config / "kube-proxy.yaml")])
        self._spawn("kubelet", [
            str(self.bin / "kubelet"), "--config", str(config / "kubelet.yaml"),
            "--kubeconfig", str(config / "kubelet.kubeconfig"),
            "--hostname-override", NODE_NAME, "--node-ip", self.network.node_ip,
            "--root-dir", str(self.kubelet_dir),
            "--node-labels", "finetune.dev/node=real,kubernetes.io/os=linux", "-v=1"])

    def _spawn(self, name: str, command: list[str], pass_fds: tuple[int, ...] = ()) -> None:
        """`command` inside the node's network namespace and cgroup (so that stopping finds
        every process it starts, containerd's shims and the containers included)."""
        procs = [path / "cgroup.procs" for path in _cgroup_paths(self.cgroup)]

        def enter_cgroup() -> None:
            os.setsid()
            for path in procs:
                path.write_text(str(os.getpid()))

        log = open(self.folder / "logs" / f"{name}.log", "ab")  # noqa: SIM115 (kept open)
        self.processes[name] = subprocess.Popen(
            ["nsenter", f"--net={self.network.netns_path}", *command], stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=enter_cgroup,
            pass_fds=pass_fds)
        (self.folder / "pids" / name).write_text(str(self.processes[name].pid))

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise NodeError(f"{what} within {timeout:.0f} s; see {self.folder / 'logs'}")
            time.sleep(0.3)

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                tail = (self.folder / "logs" / f"{name}.log").read_text(errors="replace")
                raise NodeError(f"{name} exited with {process.returncode}:\n{tail[-3000:]}")

    def stop(self) -> None:
        """Every process of the node (kubelet first, containers and shims included), then
        its mounts, cgroups, network and the kubelet's sysctls. Safe to call twice, and from
        another process than the one that started it."""
        pids = {}
        for pidfile in (self.folder / "pids").glob("*") if (self.folder / "pids").exists() \
                else ():
            with contextlib.suppress(ValueError):
                pids[pidfile.name] = int(pidfile.read_text())
            pidfile.unlink()
        for name in ("kubelet", "kube-proxy", "coredns"):
            if name in pids:
                _signal(pids[name], signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(pids[n]) for n in pids
                                                  if n != "containerd"):
            time.sleep(0.1)
        for _ in range(50):  # containers, shims, containerd: whatever is left in the cgroup
            left = _processes_in(self.cgroup)
            if not left:
                break
            for pid in left:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.1)
        for process in self.processes.values():
            with contextlib.suppress(Exception):
                process.wait(timeout=5)
        self.processes.clear()
        _unmount_under(self.folder, self.run_dir, self.kubelet_dir, self.containerd_root)
        _remove_cgroups(self.cgroup)
        self.network.remove()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(self.kubelet_dir, ignore_errors=True)
        _restore_sysctls()

    # configuration
    def _write_configs(self, credentials: NodeCredentials) -> None:
        config = self.folder / "config"
        net = self.network
        for component, kubeconfig in credentials.kubeconfigs.items():
            (config / f"{component}.kubeconfig").write_text(json.dumps(kubeconfig))
        (config / "containerd.toml").write_text(containerd_config(
            self.containerd_root, self.run_dir, self.folder / "cni", self.sandbox_image,
            self.registry_hosts))
        (self.folder / "cni" / "10-finetune.conflist").write_text(json.dumps(
            cni_config(net.pod_cidr, self.run_dir / "cni-ipam")))
        (config / "resolv.conf").write_text(f"nameserver {net.node_ip}\n")
        (config / "kubelet.yaml").write_text(json.dumps(kubelet_config(
            net, self.cgroup, self.containerd_socket, credentials.ca, config / "resolv.conf",
            self.folder / "pod-logs")))
        (config / "kube-proxy.yaml").write_text(json.dumps(kube_proxy_config(
            net, config / "kube-proxy.kubeconfig")))
        (config / "Corefile").write_text(corefile(net.node_ip, config / "coredns.kubeconfig"))


def containerd_config(root: Path, run_dir: Path, cni_conf: Path, sandbox_image: str,
                      registry_hosts: Path | None = None) -> str:
    """containerd 1.6's CRI, as the kubelet needs it here: runc with cgroupfs, the sandbox
    image built from cluster/pause, CNI from Debian's plugins, pod network namespaces under
    the node's run folder (so stopping finds them), no apparmor, oom_score_adj kept within
    what root may set without CAP_SYS_RESOURCE, and the registries' hosts.toml folder."""
    registries = (f'  [plugins."io.containerd.grpc.v1.cri".registry]\n'
                  f'    config_path = "{registry_hosts}"\n') if registry_hosts else ""
    return f"""version = 2
root = "{root}"
state = "{run_dir / 'containerd'}"
[grpc]
  address = "{run_dir / 'containerd.sock'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  disable_hugetlb_controller = true
  netns_mounts_under_state_dir = true
  enable_unprivileged_ports = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_PLUGINS}"
    conf_dir = "{cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
{registries}"""


def cni_config(pod_cidr: str, ipam_dir: Path) -> dict:
    """A bridge with the pods' gateway, host-local addresses kept under the node's run
    folder, and port mappings."""
    return {"cniVersion": "1.0.0", "name": "finetune", "plugins": [
        {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
         "hairpinMode": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]],
                  "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(ipam_dir)}},
        {"type": "portmap", "capabilities": {"portMappings": True}}]}


def kubelet_config(net: NodeNetwork, cgroup: str, socket: Path, ca: Path, resolv: Path,
                   pod_logs: Path) -> dict:
    """The kubelet on this machine: cgroup v1 (hybrid) with cgroupfs and a cgroup root of
    its own; swap tolerated; x509 clients of the cluster's CA only; CoreDNS on the node's
    address; no image garbage collection or disk-pressure evictions (the images are the
    cache, and the host's disk is not the node's to guard)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": net.node_ip, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{socket}",
        "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{cgroup}", "failCgroupV1": False,
        "cgroupsPerQOS": True, "failSwapOn": False,
        "clusterDNS": [net.node_ip], "clusterDomain": "cluster.local",
        "resolvConf": str(resolv), "podLogsDir": str(pod_logs),
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%",
                         "imagefs.available": "0%", "nodefs.inodesFree": "0%"},
        "serializeImagePulls": False, "registerNode": True,
        "nodeStatusReportFrequency": "10s", "syncFrequency": "10s",
    }


def kube_proxy_config(net: NodeNetwork, kubeconfig_path: Path) -> dict:
    """iptables mode inside the node's namespace; conntrack's VM-wide settings left alone."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "iptables", "clusterCIDR": net.pod_cidr, "hostnameOverride": NODE_NAME,
        "bindAddress": net.node_ip, "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "clientConnection": {"kubeconfig": str(kubeconfig_path)},
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        "iptables": {"localhostNodePorts": False},
    }


def corefile(node_ip: str, kubeconfig_path: Path) -> str:
    """Cluster DNS on the node's address: Services and pods of cluster.local; everything
    else unanswered (no upstream: nothing leaves the machine)."""
    return f""".:53 {{
    bind {node_ip}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig_path}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 30
}}
"""


def coredns_rbac() -> dict:
    """What CoreDNS's kubernetes plugin reads, for its token's user `coredns`."""
    return {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "finetune-node:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["services", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "finetune-node:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "finetune-node:coredns"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                       "name": "coredns"}]}]}


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


