"""A FineTuneJob end to end on real pods (`make e2e`; part of `make test`): the control plane
with its real node (cluster/real_node.py), our two images built from their Dockerfiles by
buildah and loaded into the node (cluster/node_images.py), the chart installed by the helm CLI
with the operator as a Deployment in the cluster, and example 06 applied as a user applies
it: two worker pods train the tiny LoRA job from the trainer image, torchrun's rendezvous
goes through the headless Service, the checkpoints and the adapter land on a ReadWriteMany
claim, the operator (in its pod) reads the trainer's progress, and the job ends Succeeded.

Skipped, saying why, where the machine cannot host the node (no root, no Debian packages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support.cluster_fixtures import missing_tools, running

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "cluster"))
import controlplane  # noqa: E402
import node_images as images  # noqa: E402
import real_node  # noqa: E402

pytestmark = pytest.mark.cluster
EXAMPLE = REPO / "examples" / "06-kind-e2e.yaml"
FINETUNE = Path(sys.executable).parent / "finetune"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if reason := missing_tools() or real_node.unavailable() or images.available():
        pytest.skip(reason)
    controlplane.build()
    with running(controlplane.ControlPlane(tmp_path_factory.mktemp("e2e"), kueue=False,
                                           node=True)) as plane:
        yield plane


@pytest.fixture(scope="module")
def built_images(cluster) -> dict[str, str]:
    """The operator's and the trainer's images, built (cached by their inputs) and loaded,
    as `make cluster-images` does."""
    return images.product_images(cluster.real_node, print)


def helm(cluster, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([str(cluster.bin / "helm"), "--kubeconfig",
                             str(cluster.admin_kubeconfig), *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-3000:])
    return result


@pytest.fixture(scope="module")
def release(cluster, built_images):
    """`helm install -f <the images' values>`, as the README's cluster section says."""
    values = cluster.folder / "images.yaml"
    values.write_text(yaml.safe_dump(images.helm_values(built_images)))
    helm(cluster, "install", "finetune", str(REPO / "charts" / "finetune-operator"),
         "-n", "finetune-system", "--create-namespace", "-f", str(values), "--wait",
         "--timeout", "3m")
    yield "finetune"
    helm(cluster, "uninstall", "finetune", "-n", "finetune-system", "--wait")


@pytest.fixture(scope="module")
def claim(cluster, tmp_path_factory) -> Path:
    """examples/cluster/e2e-claim.yaml, as its comment says to apply it, with a folder of this
    test's own in place of /tmp/finetune-e2e. Returns that folder."""
    folder = tmp_path_factory.mktemp("claim")
    folder.chmod(0o777)  # `mkdir -m 0777`: the workers run as uid 1000
    documents = list(yaml.safe_load_all((REPO / "examples/cluster/e2e-claim.yaml").read_text()))
    volume = next(d for d in documents if d["kind"] == "PersistentVolume")
    volume["spec"]["hostPath"]["path"] = str(folder)
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": documents}))
    return folder


def finetune(cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI from this machine, as a user runs it against the cluster."""
    return subprocess.run([str(FINETUNE), *args], capture_output=True, text=True,
                          timeout=timeout,
                          env={**os.environ, "KUBECONFIG": str(cluster.admin_kubeconfig)})


def worker_pods(cluster, job: str) -> list[dict]:
    listed = cluster.kubectl_run("get", "pods", "-l", f"finetune.dev/job={job}", "-o", "json")
    return json.loads(listed.stdout)["items"]


def scrape_a_worker(cluster, job: str, deadline: float) -> str:
    """The trainer's Prometheus /metrics from a running worker pod's IP, as Prometheus
    scrapes it (port 9108)."""
    while time.monotonic() < deadline:
        for pod in worker_pods(cluster, job):
            address = (pod.get("status") or {}).get("podIP")
            if address and pod["status"].get("phase") == "Running":
                try:
                    with urllib.request.urlopen(f"http://{address}:9108/metrics",
                                                timeout=2) as response:
                        text = response.read().decode()
                    if "finetune_step " in text or "finetune_step{" in text:
                        return text
                except OSError:
                    pass
        time.sleep(0.5)
    raise AssertionError("no worker answered /metrics with finetune_step while it ran")


@pytest.mark.timeout(900)  # a cold load of the trainer image (6 GB) into the node: ~2 min
def test_example_06_trains_on_two_real_pods_to_succeeded(cluster, release, claim):
    spec = yaml.safe_load(EXAMPLE.read_text())
    job = spec["metadata"]["name"]
    began = time.monotonic()
    cluster.kubectl_run("apply", "-f", str(EXAMPLE))
    follow = subprocess.Popen([str(FINETUNE), "logs", job, "-f"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "KUBECONFIG": str(cluster.admin_kubeconfig)})
    try:
        metrics = scrape_a_worker(cluster, job, time.monotonic() + 600)
        wait = cluster.kubectl_run("wait", f"ftj/{job}", "--for=jsonpath={.status.phase}="
                                   "Succeeded", "--timeout=600s", check=False)
        status = json.loads(cluster.kubectl_run("get", "ftj", job, "-o", "json").stdout)
        assert wait.returncode == 0, json.dumps(status.get("status"), indent=1)[-4000:]
        followed, _ = follow.communicate(timeout=120)
    finally:
        follow.kill()
    print(f"example 06 on real pods: Succeeded in {time.monotonic() - began:.0f} s")
    assert "finetune_loss" in metrics, metrics[:2000]
    pods = worker_pods(cluster, job)
    assert len({p["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index")
                for p in pods}) == 2
    assert {p["spec"]["nodeName"] for p in pods} == {real_node.NODE_NAME}
    progress = status["status"]["progress"]
    steps = spec["spec"]["hyperparameters"]["maxSteps"]
    assert progress["step"] == steps, progress  # read by the operator, in its pod
    assert status["status"].get("restarts", 0) == 0
    assert f"step {steps}/{steps}" in followed, followed[-3000:]  # `finetune logs -f`

    said = finetune(cluster, "status", job)
    assert said.returncode == 0 and "Succeeded" in said.stdout, said.stdout + said.stderr

    final = claim / job / "final"
    assert (final / "adapter_model.safetensors").is_file(), sorted(claim.rglob("*"))
    answered = run_to_end(cluster, "ask", release, [
        "python", "-m", "finetune_trainer.generate", f"/out/{job}/final", "What is FSDP?"])
    assert answered.strip(), "the adapter, loaded back from the claim, answered nothing"

    children = cluster.kubectl_run("get", "jobs,services,configmaps,pods", "-l",
                                   f"finetune.dev/job={job}", "-o", "name").stdout.split()
    cluster.kubectl_run("delete", "ftj", job, "--wait", "--timeout=120s")
    # the garbage collector removes them (owner references), the pods with their Job
    gone = cluster.kubectl_run("wait", "--for=delete", *children, "--timeout=120s",
                               check=False)
    assert gone.returncode == 0, gone.stderr


def run_to_end(cluster, name: str, release: str, command: list[str]) -> str:
    """`command` in a pod of the trainer image with the claim at /out; its log."""
    image = json.loads(cluster.kubectl_run(
        "get", "deploy", "-n", "finetune-system", f"{release}-finetune-operator", "-o",
        "json").stdout)["spec"]["template"]["spec"]["containers"][0]["env"]
    trainer = next(e["value"] for e in image if e["name"] == "FINETUNE_TRAINER_IMAGE")
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": name, "image": trainer, "imagePullPolicy": "Never", "command": command,
            "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
            "volumes": [{"name": "out",
                         "persistentVolumeClaim": {"claimName": "finetune-e2e"}}]}}))
    done = cluster.kubectl_run("wait", f"pod/{name}", "--for=jsonpath={.status.phase}="
                               "Succeeded", "--timeout=300s", check=False)
    log = cluster.kubectl_run("logs", name, check=False)
    assert done.returncode == 0, log.stdout[-3000:] + log.stderr
    return log.stdout
