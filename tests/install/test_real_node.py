"""The real node of `make cluster` (cluster/real_node.py): kubelet, containerd + runc, CNI, CoreDNS
and kube-proxy in a network namespace of their own. Pods run for real here, where KWOK only
pretends: logs and exec through the API server, two pods of an Indexed Job finding each other
by name through a headless Service (what torchrun's rendezvous needs), a memory limit
enforced, pods reaching the API server by its Service and the host reaching pods by their IP.
Stopping leaves no process, mount, namespace, cgroup or changed sysctl behind.

Skipped, saying why, where the machine cannot host the node (no root, no Debian packages)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import waits
from tests.support.cluster_fixtures import missing_tools, running

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "cluster"))
import controlplane  # noqa: E402
import node_images as images  # noqa: E402
import real_node as node  # noqa: E402

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def base_image() -> str:
    if reason := missing_tools() or node.unavailable():
        pytest.skip(reason)
    controlplane.build()
    return images.base_image(print)


@pytest.fixture(scope="module")
def plane(tmp_path_factory, base_image):
    """A control plane with the real node (no Kueue: not what these tests are about)."""
    with running(controlplane.ControlPlane(tmp_path_factory.mktemp("node-plane"), kueue=False,
                                           node=True)) as plane:
        images.load(plane.real_node, base_image, print)
        yield plane


def pod(name: str, base_image: str, script: str, **spec) -> dict:
    """A pod on the real node running `script` in the base image's Python."""
    container = {"name": "main", "image": base_image, "imagePullPolicy": "Never",
                 "command": ["python3", "-u", "-c", script], **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"finetune.dev/node": "real"}, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1, "containers": [container], **spec}}


def apply(plane, *objects: dict) -> None:
    plane.kubectl_run("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def wait_for(plane, what: str, condition: str) -> None:
    """kubectl wait, as long as the test may run."""
    result = plane.kubectl_run("wait", what, f"--for={condition}",
                               f"--timeout={waits.seconds_left():.0f}s", check=False)
    if result.returncode != 0:
        described = plane.kubectl_run("describe", what, check=False).stdout
        raise AssertionError(f"{what} not {condition}: {result.stderr}\n{described[-3000:]}")


def test_stopping_leaves_nothing_behind(tmp_path, base_image):
    """No process, mount, network namespace, link, cgroup or changed sysctl, with a pod
    running when the cluster is stopped. First in the module: before its shared node
    starts, so that the sysctls are compared with the machine's own."""
    before = {key: (Path("/proc/sys") / key).read_text() for key in node.KUBELET_SYSCTLS}
    plane = controlplane.ControlPlane(tmp_path / "plane", kueue=False, node=True)
    try:
        plane.start()
        images.load(plane.real_node, base_image, print)
        apply(plane, pod("sleeper", base_image, "import time; time.sleep(600)"))
        wait_for(plane, "pod/sleeper", "condition=Ready")
        network, cgroup = plane.real_node.network, plane.real_node.cgroup
        # from another process, as `make cluster-down` does
        subprocess.run([sys.executable, str(REPO / "cluster" / "controlplane.py"), "--folder",
                        str(tmp_path / "plane"), "down"], check=True, capture_output=True)
    finally:
        plane.stop()
    assert not network.exists()
    assert not Path(f"/run/{network.namespace}").exists()
    assert not Path(f"/var/lib/{network.namespace}").exists()
    assert not [h for h in Path("/sys/fs/cgroup").iterdir() if (h / cgroup).exists()]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(tmp_path) not in mounts and network.namespace not in mounts
    alive = subprocess.run(["pgrep", "-f", f"{tmp_path}|{network.namespace}"],
                           capture_output=True, text=True).stdout.split()
    assert alive == []
    if not any(node.NodeNetwork(i).exists() for i in range(1, 250)):  # no other node now
        assert {key: (Path("/proc/sys") / key).read_text()
                for key in node.KUBELET_SYSCTLS} == before


def test_a_pod_runs_for_real_with_its_logs_and_exec(plane, base_image):
    apply(plane, pod("hello", base_image,
                     "import platform, time; print('hello from', platform.node()); "
                     "time.sleep(600)"))
    wait_for(plane, "pod/hello", "condition=Ready")
    deadline = time.monotonic() + waits.seconds_left()
    while "hello from hello" not in (logs := plane.kubectl_run("logs", "hello").stdout):
        assert time.monotonic() < deadline, logs
        time.sleep(0.5)
    echoed = plane.kubectl_run("exec", "-i", "hello", "--", "python3", "-c",
                               "import sys; print(sys.stdin.read().upper())", input="ping")
    assert echoed.stdout.strip() == "PING"
    described = json.loads(plane.kubectl_run("get", "pod", "hello", "-o", "json").stdout)
    assert described["spec"]["nodeName"] == node.NODE_NAME
    assert described["status"]["podIP"].startswith("10.244.")
    plane.kubectl_run("delete", "pod", "hello", "--wait=false")


def test_cluster_install_writes_an_operator_kubeconfig_that_logs_in(plane):
    """`make cluster-install` (`controlplane.py install`, a process of its own) on a plane with
    the real node, whose API server listens on the node link's host end: the kubeconfig it
    printed for `finetune operator` named 127.0.0.1, where nothing listens."""
    installed = subprocess.run([sys.executable, str(REPO / "cluster/controlplane.py"), "install",
                                "--folder", str(plane.folder)], capture_output=True, text=True,
                               timeout=waits.seconds_left())
    assert installed.returncode == 0, installed.stdout + installed.stderr
    kubeconfig = plane.folder / "operator.kubeconfig"
    assert f"KUBECONFIG={kubeconfig} " in installed.stdout
    assert plane.address != "127.0.0.1" and plane.server in kubeconfig.read_text()
    asked = subprocess.run([str(plane.kubectl), "--kubeconfig", str(kubeconfig), "auth", "can-i",
                            "watch", "finetunejobs.finetune.dev", "--all-namespaces"],
                           capture_output=True, text=True, timeout=waits.seconds_left())
    assert asked.stdout.strip() == "yes", asked.stdout + asked.stderr


def test_two_pods_of_an_indexed_job_reach_each_other_by_name(plane, base_image):
    """The shape of a FineTuneJob's workers: an Indexed Job behind a headless Service; pod 0
    listens, pod 1 connects to `<job>-0.<service>` through the cluster's DNS."""
    script = (
        "import os, socket, time\n"
        "if os.environ['JOB_COMPLETION_INDEX'] == '0':\n"
        "    server = socket.create_server(('', 29500))\n"
        "    connection, _ = server.accept()\n"
        "    print('got', connection.recv(64).decode())\n"
        "else:\n"
        f"    deadline = time.time() + {waits.seconds_left():.0f}\n"  # pod 0 may start late
        "    while True:\n"
        "        try:\n"
        "            peer = socket.create_connection(('pair-0.pair', 29500), timeout=2)\n"
        "            break\n"
        "        except OSError:\n"
        "            assert time.time() < deadline\n"
        "            time.sleep(0.5)\n"
        "    peer.sendall(b'hello from rank 1')\n")
    template = pod("unused", base_image, script)
    template["metadata"] = {"labels": {"app": "pair"}}
    template["spec"]["subdomain"] = "pair"
    apply(plane,
          {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "pair"},
           "spec": {"clusterIP": "None", "selector": {"app": "pair"},
                    "publishNotReadyAddresses": True, "ports": [{"port": 29500}]}},
          {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "pair"},
           "spec": {"completions": 2, "parallelism": 2, "completionMode": "Indexed",
                    "backoffLimit": 0, "template": {k: template[k]
                                                    for k in ("metadata", "spec")}}})
    wait_for(plane, "job/pair", "condition=Complete")
    zero = plane.kubectl_run("get", "pods", "-l", "batch.kubernetes.io/job-completion-index=0",
                             "-o", "name").stdout.split()[0]
    assert "got hello from rank 1" in plane.kubectl_run("logs", zero).stdout


def test_a_memory_limit_is_enforced_and_said_as_oomkilled(plane, base_image):
    apply(plane, pod("hungry", base_image, "blocks = [bytearray(2**20) for _ in range(400)]",
                     container={"resources": {"limits": {"memory": "64Mi", "cpu": "1"}}}))
    wait_for(plane, "pod/hungry", "jsonpath={.status.phase}=Failed")
    status = json.loads(plane.kubectl_run("get", "pod", "hungry", "-o", "json").stdout)
    terminated = status["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["reason"] == "OOMKilled"


def test_pods_reach_the_api_server_and_the_host_reaches_pods(plane, base_image):
    """The kubernetes Service (kube-proxy) from a pod; a pod's IP from this host, as an
    operator outside the node reaches the trainer's progress server."""
    script = (
        "import http.server, ssl, urllib.error, urllib.request\n"
        "try:\n"
        "    urllib.request.urlopen('https://kubernetes.default.svc/version',\n"
        "                           context=ssl._create_unverified_context(), timeout=5)\n"
        "    said = 'answered'\n"
        "except urllib.error.HTTPError as error:\n"
        "    said = f'answered {error.code}'\n"
        "class Reply(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(said.encode())\n"
        "http.server.HTTPServer(('', 8080), Reply).serve_forever()\n")
    apply(plane, pod("web", base_image, script))
    wait_for(plane, "pod/web", "condition=Ready")
    address = plane.kubectl_run("get", "pod", "web", "-o",
                                "jsonpath={.status.podIP}").stdout
    deadline = time.monotonic() + waits.seconds_left()
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}:8080/", timeout=2) as response:
                said = response.read().decode()
                break
        except OSError:
            assert time.monotonic() < deadline, f"{address}:8080 never answered the host"
            time.sleep(0.5)
    assert said.startswith("answered")  # the API server's own reply (its 401/403 included)
    plane.kubectl_run("delete", "pod", "web", "--wait=false")


def test_a_changed_build_leaves_no_step_images_of_the_one_before(tmp_path, base_image):
    """`--layers` keeps each step as an untagged image, the next build's cache. A build
    whose input changed left the earlier build's steps behind (a trainer step is 6 GB: CI
    ran out of disk): after it, the earlier steps are gone, its own stay, and an unchanged
    rebuild of the unchanged step reuses it."""
    log = images.cache() / "logs" / "finetune-probe-steps.log"
    built: list[str] = []

    def steps() -> set[str]:
        listed = json.loads(images.buildah("images", "--all", "--no-trunc", "--json"))
        return {row["id"].removeprefix("sha256:")[:11] for row in listed
                if not row.get("names")}

    def build(words: str, last: str = "second") -> str:
        dockerfile = tmp_path / "Dockerfile"
        dockerfile.write_text(f"ARG BASE\nFROM ${{BASE}}\nRUN echo {words} > /first\n"
                              f"RUN echo {last} > /second\n")
        built.append(images.dockerfile_image(dockerfile, "finetune-probe-steps", base_image,
                                              {}, print))
        return built[-1]

    earlier = steps()
    try:
        first = build("one")
        of_first = steps() - earlier
        assert of_first and of_first <= set(images.STEP.findall(log.read_text())), (
            "a --layers build leaves its steps as images, named in its log")
        build("two")
        of_second = steps() - earlier
        assert of_second and of_second <= set(images.STEP.findall(log.read_text()))
        assert not of_first & of_second, "the first build's steps were left behind"
        assert not images.exists(first)
        (step,) = of_second
        build("two", "third")
        assert f"Using cache {step}" in log.read_text() and step in steps(), (
            "a build whose first step is unchanged reuses it, and it stays for the next")
    finally:
        log.unlink(missing_ok=True)
        for reference in set(built):
            subprocess.run(["buildah", *images._storage(), "rmi", "--force", reference],
                           capture_output=True)
        images.drop_stale_steps()


def test_the_operator_image_builds_from_its_dockerfile_and_runs_as_its_user(plane, base_image):
    """operator/Dockerfile built as users build it (from the repository, `--build-arg BASE`),
    loaded into the node, run as a pod: the image's own user, the `finetune` entrypoint."""
    reference = images.dockerfile_image(REPO / "operator" / "Dockerfile", "finetune-operator",
                                        base_image, {}, print)
    images.load(plane.real_node, reference, print)
    manifest = pod("operator-image", reference, "")
    manifest["spec"]["containers"][0].pop("command")
    manifest["spec"]["containers"][0]["args"] = ["--version"]
    apply(plane, manifest)
    wait_for(plane, "pod/operator-image", "jsonpath={.status.phase}=Succeeded")
    assert "finetune" in plane.kubectl_run("logs", "operator-image").stdout
    who = pod("operator-user", reference, "")
    who["spec"]["containers"][0]["command"] = ["id", "-u"]
    apply(plane, who)
    wait_for(plane, "pod/operator-user", "jsonpath={.status.phase}=Succeeded")
    assert plane.kubectl_run("logs", "operator-user").stdout.strip() == "65532"
