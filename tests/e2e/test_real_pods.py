"""A FineTuneJob end to end on real pods (`make e2e`; part of `make test`): the control plane
with its real node (cluster/real_node.py), our two images built from their Dockerfiles by
buildah and pushed to the cluster's registry (cluster/node_registry.py), which the kubelet
pulls them from with a pull Secret; the chart released to that registry as a release is
(scripts/release.py) and installed from `oci://` by the helm CLI, with the operator as a
Deployment in the cluster, and example 06 applied as a user applies it: two worker pods
train the tiny LoRA job from the trainer image, torchrun's rendezvous goes through the
headless Service, the checkpoints and the adapter land on a ReadWriteMany claim, the operator
(in its pod) reads the trainer's progress, and the job ends Succeeded.

Skipped, saying why, where the machine cannot host the node (no root, no Debian packages)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support.argocd import argo_health
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
    if reason := missing_tools() or real_node.unavailable():
        pytest.skip(reason)
    controlplane.build()
    with running(controlplane.ControlPlane(tmp_path_factory.mktemp("e2e"), kueue=False,
                                           node=True)) as plane:
        yield plane


@pytest.fixture(scope="module")
def built_images(cluster) -> dict[str, str]:
    """The operator's and the trainer's images, built (cached by their inputs) and pushed to
    the cluster's registry, with its pull Secret where pods pull them, as `make
    cluster-images` does: {"operator": reference, "trainer": reference} in the registry."""
    pushed = images.published(cluster.registry, cluster.real_node, print)
    controlplane.pull_secrets(cluster, cluster.registry, ("finetune-system", "default"))
    return pushed


def helm(cluster, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([str(cluster.bin / "helm"), "--kubeconfig",
                             str(cluster.admin_kubeconfig), *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-3000:])
    return result


def released_version() -> str:
    """The newest version CHANGELOG.md has a section for (a release needs one)."""
    return re.search(r"^## \[(\d+\.\d+\.\d+[^\]]*)\]", (REPO / "CHANGELOG.md").read_text(),
                     re.MULTILINE)[1]


def released_chart(cluster) -> list[str]:
    """What `helm install`/`upgrade` take to use the chart the `release` fixture released:
    its oci:// reference, version, and the registry's CA and credentials."""
    auth = cluster.folder / "helm-registry.json"
    auth.write_text(json.dumps(cluster.registry.docker_config()))
    return [f"oci://{cluster.registry.host}/charts/finetune-operator", "--version",
            released_version(), "--ca-file", str(cluster.registry.ca), "--registry-config",
            str(auth)]


@pytest.fixture(scope="module")
def release(cluster, built_images):
    """The chart released into the cluster's registry as the release workflow releases it
    (images tagged with the version, then scripts/release.py: packaged with them pinned and
    `helm push`ed), and installed from there as the chart README says: `helm install
    oci://… --version V` with the pull Secret, no values file."""
    chart, _, version, *trust = released_chart(cluster)
    for reference in built_images.values():
        cluster.registry.tag(reference, version)
    published = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "release.py"), "chart", "--version", version,
         "--to", chart.rsplit("/", 1)[0], "--images", cluster.registry.host,
         "--helm", str(cluster.bin / "helm"), "--out", str(cluster.folder / "release"),
         *trust], capture_output=True, text=True, timeout=300)
    assert published.returncode == 0, published.stderr
    helm(cluster, "install", "finetune", *released_chart(cluster), "-n", "finetune-system",
         "--set", "imagePullSecrets[0].name=registry-pull", "--wait", "--timeout", "3m")
    yield "finetune"
    if installed(cluster, "finetune"):  # the last test uninstalls it, as a user would
        helm(cluster, "uninstall", "finetune", "-n", "finetune-system", "--wait")


def installed(cluster, release: str) -> bool:
    return subprocess.run([str(cluster.bin / "helm"), "--kubeconfig",
                           str(cluster.admin_kubeconfig), "status", release, "-n",
                           "finetune-system"], capture_output=True).returncode == 0


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
    user = {**os.environ, "KUBECONFIG": str(cluster.admin_kubeconfig)}
    follow = subprocess.Popen([str(FINETUNE), "logs", job, "-f"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=user)
    watch = subprocess.Popen([str(FINETUNE), "status", job, "--watch", "--interval", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=user)
    try:
        metrics = scrape_a_worker(cluster, job, time.monotonic() + 600)
        wait = cluster.kubectl_run("wait", f"ftj/{job}", "--for=jsonpath={.status.phase}="
                                   "Succeeded", "--timeout=600s", check=False)
        status = json.loads(cluster.kubectl_run("get", "ftj", job, "-o", "json").stdout)
        assert wait.returncode == 0, json.dumps(status.get("status"), indent=1)[-4000:]
        followed, _ = follow.communicate(timeout=120)
        watched, _ = watch.communicate(timeout=60)  # --watch ends with the job: exit 0
    finally:
        follow.kill()
        watch.kill()
    print(f"example 06 on real pods: Succeeded in {time.monotonic() - began:.0f} s")
    assert "finetune_loss" in metrics, metrics[:2000]
    pods = worker_pods(cluster, job)
    assert len({p["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index")
                for p in pods}) == 2
    assert {p["spec"]["nodeName"] for p in pods} == {real_node.NODE_NAME}
    progress = status["status"]["progress"]
    steps = spec["spec"]["hyperparameters"]["maxSteps"]
    assert progress["step"] == steps, progress  # read by the operator, in its pod
    assert argo_health(status)["status"] == "Healthy"  # the chart's Argo CD health check
    assert status["status"].get("restarts", 0) == 0
    assert f"step {steps}/{steps}" in followed, followed[-3000:]  # `finetune logs -f`
    # `finetune status --watch`: printed again as the phase and the step moved, then exit 0
    assert watch.returncode == 0, watched[-3000:]
    assert "Running" in watched and "Succeeded" in watched, watched[-3000:]
    assert f"{steps}/{steps}" in watched, watched[-3000:]

    said = finetune(cluster, "status", job)
    assert said.returncode == 0 and "Succeeded" in said.stdout, said.stdout + said.stderr

    final = claim / job / "final"
    assert (final / "adapter_model.safetensors").is_file(), sorted(claim.rglob("*"))
    answered = run_to_end(cluster, "ask", release, [
        "python", "-m", "finetune_trainer.generate", f"/out/{job}/final", "What is FSDP?"])
    assert answered.strip(), "the adapter, loaded back from the claim, answered nothing"

    remove(cluster, job)


@pytest.fixture(autouse=True)
def no_job_left_training(request):
    """A test that fails before its own `remove` left its job training on the one real node,
    whose CPUs every later test then waited for: one failure became ten (11-28, the killed
    trainer's job, 20,000 steps). After a failed test, its jobs go."""
    yield
    report, cluster = getattr(request.node, "report_call", None), request.node.funcargs.get(
        "cluster")
    if report is None or not report.failed or cluster is None:
        return
    for name in cluster.kubectl_run("get", "ftj", "-o", "name", check=False).stdout.split():
        remove(cluster, name.rsplit("/", 1)[-1])


def remove(cluster, job: str) -> None:
    """`kubectl delete ftj`, then its children gone: the garbage collector removes them
    (owner references), the pods with their Job (so the next job finds the node's CPUs)."""
    children = cluster.kubectl_run("get", "jobs,services,configmaps,pods", "-l",
                                   f"finetune.dev/job={job}", "-o", "name").stdout.split()
    cluster.kubectl_run("delete", "ftj", job, "--wait", "--timeout=120s")
    gone = cluster.kubectl_run("wait", "--for=delete", *children, "--timeout=120s",
                               check=False) if children else None
    assert gone is None or gone.returncode == 0, gone.stderr


def run_to_end(cluster, name: str, release: str, command: list[str]) -> str:
    """`command` in a pod of the trainer image with the claim at /out; its log."""
    image = json.loads(cluster.kubectl_run(
        "get", "deploy", "-n", "finetune-system", f"{release}-finetune-operator", "-o",
        "json").stdout)["spec"]["template"]["spec"]["containers"][0]["env"]
    trainer = next(e["value"] for e in image if e["name"] == "FINETUNE_TRAINER_IMAGE")
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": name, "image": trainer, "command": command,
            "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
            "imagePullSecrets": [{"name": "registry-pull"}],
            "volumes": [{"name": "out",
                         "persistentVolumeClaim": {"claimName": "finetune-e2e"}}]}}))
    done = cluster.kubectl_run("wait", f"pod/{name}", "--for=jsonpath={.status.phase}="
                               "Succeeded", "--timeout=300s", check=False)
    log = cluster.kubectl_run("logs", name, check=False)
    assert done.returncode == 0, log.stdout[-3000:] + log.stderr
    return log.stdout


# --- every strategy on real pods -----------------------------------------------------------
STRATEGIES = {"fsdp": "lora", "zero2": "full", "zero3": "lora"}
"""Besides example 06's DDP: each strategy's own collectives and checkpoint format, between
two pods. ZeRO on CPU workers opens DeepSpeed's shared-memory op, which the image must carry
built (trainer/Dockerfile): a ZeRO job once failed on every attempt there."""


def strategy_job(strategy: str, method: str) -> dict:
    """Example 06 under `strategy` and `method`, 2 steps, its output a folder of its own; a
    quarter of a CPU asked per pod, so that the three jobs' six pods fit the 2-core node at
    once (the request only schedules: each pod may use what is free)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    name = f"{strategy}-{method}"
    doc["metadata"] = {"name": name, "namespace": "default"}
    doc["spec"]["strategy"]["type"] = strategy
    if method == "full":
        doc["spec"]["method"] = {"type": "full"}
    doc["spec"]["hyperparameters"].update(maxSteps=2, logEverySteps=1)
    doc["spec"]["resources"]["cpu"] = "250m"
    doc["spec"]["output"] = {"uri": f"pvc://finetune-e2e/{name}", "checkpointEverySteps": 1}
    return doc


@pytest.mark.timeout(600)
def test_every_strategy_trains_on_two_real_pods_to_succeeded(cluster, release, claim):
    """FSDP (LoRA), ZeRO-2 (full weights) and ZeRO-3 (LoRA), at once: each Succeeded on two
    pods of the CPU trainer image, with no restart, its last step read by the operator and its
    model on the claim (an adapter, or ZeRO-2's whole weights). FSDP's adapter is exported to
    the registry too (`output.export`), pulled back with oras and asked a question."""
    began = time.monotonic()
    jobs = [strategy_job(strategy, method) for strategy, method in STRATEGIES.items()]
    exporting(cluster, jobs[0])  # FSDP's LoRA adapter, pushed to the registry at the end
    for doc in jobs:
        cluster.kubectl_run("apply", "-f", "-", input=json.dumps(doc))
    took = {}
    for doc in jobs:
        name = doc["metadata"]["name"]
        ended = until(lambda n=name: job_status(cluster, n).get("phase") in (
            "Succeeded", "Failed") and job_status(cluster, n), f"{name} ended", timeout=420,
            cluster=cluster, name=name)
        took[name] = time.monotonic() - began
        assert ended["phase"] == "Succeeded", json.dumps(ended, indent=1)[-3000:]
        assert ended.get("restarts", 0) == 0, ended
        assert ended["progress"]["step"] == 2, ended["progress"]
        pods = worker_pods(cluster, name)
        assert len({p["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index")
                    for p in pods}) == 2, [p["metadata"]["name"] for p in pods]
        weights = ("model.safetensors" if doc["spec"]["method"]["type"] == "full"
                   else "adapter_model.safetensors")
        assert (claim / name / "final" / weights).is_file(), sorted(
            (claim / name).rglob("*"))
    print("every strategy on real pods: " + ", ".join(
        f"{name} Succeeded after {seconds:.0f} s" for name, seconds in took.items()))
    pulled_back_and_answering(cluster, release, claim, "fsdp-lora")
    for doc in jobs:
        remove(cluster, doc["metadata"]["name"])


def exporting(cluster, doc: dict) -> dict:
    """`doc` pushing its adapter to the cluster's (private) registry, as a user whose
    registry has a CA of its own writes it: `output.export` with the pull Secret's
    credentials, and the CA mounted from a ConfigMap where the trainer's HTTP client reads
    it (REQUESTS_CA_BUNDLE)."""
    name = doc["metadata"]["name"]
    cluster.kubectl_run("apply", "-f", "-", input=cluster.kubectl_run(
        "create", "configmap", "registry-ca", "-n", "default",
        f"--from-file=ca.crt={cluster.registry.ca}", "--dry-run=client", "-o", "json").stdout)
    doc["spec"]["output"]["export"] = [{"uri": f"oci://{cluster.registry.host}/models/{name}:e2e",
                                        "secretName": "registry-pull"}]
    doc["spec"].setdefault("kubernetes", {}).update(
        env=[{"name": "REQUESTS_CA_BUNDLE", "value": "/etc/registry-ca/ca.crt"}],
        volumes=[{"name": "registry-ca", "mountPath": "/etc/registry-ca", "readOnly": True,
                  "configMap": {"name": "registry-ca"}}])
    return doc


def pulled_back_and_answering(cluster, release: str, claim: Path, name: str) -> None:
    """The job ended `Exported=True`; `oras pull` of its reference (as KAITO's init container
    pulls an adapter) gives back final/'s files, model card included, byte for byte, and the
    pulled adapter loads with peft in a pod of the trainer image and answers a prompt."""
    exported = next(c for c in job_status(cluster, name)["conditions"]
                    if c["type"] == "Exported")
    reference = f"{cluster.registry.host}/models/{name}:e2e"
    assert exported["status"] == "True" and exported["reason"] == "Pushed", exported
    assert reference in exported["message"], exported
    pulled = claim / f"pulled-{name}"
    oras = subprocess.run([str(controlplane.registry_tools_dir() / "oras"), "pull",
                           "--ca-file", str(cluster.registry.ca), "--registry-config",
                           str(cluster.folder / "helm-registry.json"), "-o", str(pulled),
                           reference], capture_output=True, text=True, timeout=300)
    assert oras.returncode == 0, oras.stderr
    final, data = claim / name / "final", pulled / "data"  # KAITO's layout: files in data/
    for file in ("adapter_model.safetensors", "adapter_config.json", "README.md"):
        assert (data / file).read_bytes() == (final / file).read_bytes(), file
    answered = run_to_end(cluster, f"ask-{name}", release, [
        "python", "-m", "finetune_trainer.generate", f"/out/pulled-{name}/data",
        "What is FSDP?"])
    assert answered.strip(), "the pulled adapter answered nothing"


def test_an_op_the_image_cannot_build_fails_the_job_after_one_restart(cluster, release,
                                                                       claim):
    """`offload: nvme` on CPU workers, as a manifest written for GPUs would ask it: DeepSpeed's
    NVMe swapper builds its pin_memory op on first use, and the CPU image has no compiler for
    it (it carries only the ops CPU training needs). Every rank fails so before step 1: the
    gang restarts once, then the job fails (WorkerSetupFailed) quoting the build's own line,
    not the compiler's command line, and never using the rest of its restart budget."""
    doc = strategy_job("zero3", "lora")
    doc["metadata"]["name"] = "no-compiler"
    doc["spec"]["strategy"].update(offload="nvme", nvmePath="/tmp/nvme-swap")
    doc["spec"]["output"]["uri"] = "pvc://finetune-e2e/no-compiler"
    began = time.monotonic()
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(doc))
    status = until(lambda: job_status(cluster, "no-compiler").get("phase") == "Failed"
                   and job_status(cluster, "no-compiler"), "Failed", timeout=420,
                   cluster=cluster, name="no-compiler")
    print(f"an op the image cannot build: Failed in {time.monotonic() - began:.0f} s")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "WorkerSetupFailed", failed
    assert argo_health({"kind": "FineTuneJob", "status": status}) == {  # the chart's Argo CD
        "status": "Degraded", "message": status.get("message", "Failed")}  # check
    assert status["restarts"] == 1, status
    assert "op 'pin_memory' could not be built in this image: /bin/sh: 1: c++: not found" in \
        failed["message"], failed
    assert "-MMD" not in failed["message"], failed
    events = json.loads(cluster.kubectl_run("get", "events", "--field-selector",
                                            "involvedObject.name=no-compiler", "-o",
                                            "json").stdout)["items"]
    restarting = [e["message"] for e in events if e["reason"] == "Restarting"]
    assert restarting and "c++: not found" in restarting[0], restarting
    remove(cluster, "no-compiler")


# --- faults with real processes ------------------------------------------------------------
def long_job(name: str, **spec) -> dict:
    """Example 06 made long enough for a fault to land while it trains (the tiny model does
    ~10 steps a second here), checkpointing every 50 steps on the claim."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name, "namespace": "default"}
    doc["spec"]["hyperparameters"].update(maxSteps=20000, logEverySteps=10)
    doc["spec"]["output"] = {"uri": f"pvc://finetune-e2e/{name}", "checkpointEverySteps": 50}
    for section, values in spec.items():
        doc["spec"].setdefault(section, {}).update(values)
    return doc


def job_status(cluster, name: str) -> dict:
    found = cluster.kubectl_run("get", "ftj", name, "-o", "json", check=False)
    return (json.loads(found.stdout).get("status") or {}) if found.returncode == 0 else {}


def until(check, what: str, timeout: float = 180, cluster=None, name: str = ""):
    """Poll `check()` until it returns something true; fail naming `what` and the status.

    With a job named, `timeout` is how long its status may stand still: a busy machine is slow,
    not stuck, so every step, phase, restart or condition it records gives the wait another
    `timeout`, up to four in all (CI's machine once took 143 s from running pods to the
    preflight's figure)."""
    start = time.monotonic()
    deadline, seen = start + timeout, None
    while not (value := check()):
        now = time.monotonic()
        if cluster and name and (moved := status_mark(job_status(cluster, name))) != seen:
            seen, deadline = moved, min(now + timeout, start + 4 * timeout)
        if now > deadline:
            status = job_status(cluster, name) if cluster and name else {}
            raise AssertionError(f"not within {now - start:.0f} s: {what}\n"
                                 f"{json.dumps(status, indent=1)[-3000:]}")
        time.sleep(1)
    return value


def status_mark(status: dict) -> tuple:
    """What of a job's status moves while it makes headway."""
    return (status.get("phase"), status.get("restarts"),
            (status.get("progress") or {}).get("step"),
            tuple((c.get("type"), c.get("status"), c.get("reason"))
                  for c in status.get("conditions") or ()))


def running_worker(cluster, job: str, index: int, not_in: set[str] = frozenset()) -> str | None:
    for pod in worker_pods(cluster, job):
        labels = pod["metadata"]["labels"]
        if (labels.get("batch.kubernetes.io/job-completion-index") == str(index)
                and pod["status"].get("phase") == "Running"
                and not pod["metadata"].get("deletionTimestamp")
                and pod["metadata"]["name"] not in not_in):
            return pod["metadata"]["name"]
    return None


def trained_past(cluster, job: str, step: int) -> bool:
    return (job_status(cluster, job).get("progress") or {}).get("step", 0) >= step


def resumed_from(cluster, job: str, pod: str) -> int | None:
    """The step rank 0's trainer in `pod` said it resumed from, once it has said so."""
    log = cluster.kubectl_run("logs", pod, "-c", "trainer", check=False).stdout
    for line in log.splitlines():
        if line.startswith("resuming from ") and "(step " in line:
            return int(line.split("(step ")[1].split("/")[0])
    return None


def test_a_killed_trainer_restarts_the_gang_which_resumes_from_its_last_checkpoint(
        cluster, release, claim):
    """A worker's trainer process SIGKILLed (what an uncaught CUDA error does): one gang
    restart, counted, and the new workers resume from the newest checkpoint, not step 0."""
    from tests.support.testbed import KILL_TRAINER

    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(long_job("killed")))
    until(lambda: trained_past(cluster, "killed", 120), "past step 120", cluster=cluster,
          name="killed")
    first = {p["metadata"]["name"] for p in worker_pods(cluster, "killed")}
    victim = running_worker(cluster, "killed", 1)
    cluster.kubectl_run("exec", victim, "-c", "trainer", "--", "python", "-c", KILL_TRAINER,
                        "torch.OutOfMemoryError: CUDA out of memory")
    until(lambda: job_status(cluster, "killed").get("restarts") == 1, "the restart counted",
          cluster=cluster, name="killed")
    rank0 = until(lambda: running_worker(cluster, "killed", 0, not_in=first),
                  "a new rank-0 pod running", cluster=cluster, name="killed")
    step = until(lambda: resumed_from(cluster, "killed", rank0), "the new rank 0 resuming",
                 cluster=cluster, name="killed")
    assert step >= 100 and step % 50 == 0, step  # the newest checkpoint, not the start
    events = cluster.kubectl_run("get", "events", "--field-selector",
                                 "involvedObject.name=killed", "-o", "json").stdout
    restarting = [e["message"] for e in json.loads(events)["items"]
                  if e["reason"] == "Restarting"]
    # the killed rank's own error line (its error file's), not rank 0's lost connection to
    # it, though rank 0's pod often ends first, nor a frame of a traceback
    assert restarting and re.search(r"rank 1 was ended by SIGKILL: torch.OutOfMemoryError",
                                    restarting[0]), restarting
    assert ".py(" not in restarting[0], restarting
    remove(cluster, "killed")


def test_an_evicted_worker_restarts_the_gang_without_using_the_budget(cluster, release, claim):
    """A drain's eviction (the eviction API, as `kubectl drain` calls it): the gang restarts
    from its checkpoint and the restart budget is untouched."""
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(long_job("evicted")))
    until(lambda: trained_past(cluster, "evicted", 60), "past step 60", cluster=cluster,
          name="evicted")
    first = {p["metadata"]["name"] for p in worker_pods(cluster, "evicted")}
    victim = running_worker(cluster, "evicted", 0)
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": victim, "namespace": "default"}}
    cluster.kubectl_run("create", "--raw",
                        f"/api/v1/namespaces/default/pods/{victim}/eviction", "-f", "-",
                        input=json.dumps(eviction))
    rank0 = until(lambda: running_worker(cluster, "evicted", 0, not_in=first),
                  "a new rank-0 pod running", cluster=cluster, name="evicted")
    step = until(lambda: resumed_from(cluster, "evicted", rank0), "the new rank 0 resuming",
                 cluster=cluster, name="evicted")
    assert step >= 50, step
    assert job_status(cluster, "evicted").get("restarts", 0) == 0
    remove(cluster, "evicted")


def test_a_tag_the_registry_lacks_is_named_with_its_field(cluster, release, claim):
    """`spec.kubernetes.image` naming a tag the registry does not have: the kubelet's own
    reason and words, the field to fix, in the status."""
    image = f"{cluster.registry.host}/finetune-trainer:typo"
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(long_job(
        "typo", kubernetes={"image": image}, runPolicy={"startupDeadlineSeconds": 60})))
    message = until(lambda: "not found" in (m := job_status(cluster, "typo").get(
        "message", "")) and m, "the pull error in the status", cluster=cluster, name="typo")
    assert re.search(r"(ErrImagePull|ImagePullBackOff): .*" + re.escape(image), message)
    assert "the registry has no such image: spec.kubernetes.image names it" in message
    remove(cluster, "typo")


def test_a_pull_refused_without_its_secret_goes_on_once_the_secret_is_made(
        cluster, release, claim):
    """The registry's repositories are private: a job naming a pull Secret its namespace
    lacks pulls without credentials, the registry says 401, and the status says which Secret
    to make; made, the kubelet's next retry pulls and the job trains, with no re-apply."""
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(long_job(
        "private", kubernetes={"imagePullSecrets": ["late-pull"]})))
    message = until(lambda: "401 Unauthorized" in (m := job_status(cluster, "private").get(
        "message", "")) and m, "the refused pull in the status", cluster=cluster,
        name="private")
    assert ("refused the pull with the credentials of spec.kubernetes.imagePullSecrets "
            "(late-pull)") in message, message
    assert "kubectl create secret docker-registry" in message, message
    assert cluster.registry.password not in message
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(
        cluster.registry.pull_secret("default", "late-pull")))
    until(lambda: trained_past(cluster, "private", 1), "training once the Secret exists",
          cluster=cluster, name="private")
    assert job_status(cluster, "private").get("restarts", 0) == 0
    remove(cluster, "private")


def test_a_memory_limit_too_small_is_said_plainly_with_the_fix(cluster, release, claim):
    """Workers whose memory cannot hold the trainer: OOMKilled by the kernel, and the status
    says so with the field to raise."""
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(long_job(
        "small", resources={"memory": "200Mi"}, runPolicy={"backoffLimit": 0})))
    until(lambda: job_status(cluster, "small").get("phase") == "Failed", "Failed",
          timeout=240, cluster=cluster, name="small")
    message = job_status(cluster, "small")["message"]
    assert "OOMKilled" in message and "spec.resources.memory" in message, message
    remove(cluster, "small")


def test_suspend_checkpoints_on_sigterm_and_resume_continues_from_that_step(
        cluster, release, claim):
    """`runPolicy.suspend`: the workers get SIGTERM, checkpoint the step they are at within
    the grace period (no periodic checkpoint is due) and exit; unsuspended, the new workers
    resume from that step."""
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(long_job(
        "paused", output={"checkpointEverySteps": 100000})))
    until(lambda: trained_past(cluster, "paused", 40), "past step 40", cluster=cluster,
          name="paused")
    first = {p["metadata"]["name"] for p in worker_pods(cluster, "paused")}
    cluster.kubectl_run("patch", "ftj", "paused", "--type", "merge", "-p",
                        '{"spec": {"runPolicy": {"suspend": true}}}')
    until(lambda: job_status(cluster, "paused").get("phase") == "Suspended"
          and not worker_pods(cluster, "paused"), "Suspended, its pods gone", cluster=cluster,
          name="paused")
    saved = sorted((claim / "paused" / "checkpoints").glob("step-*"))
    assert saved, "no checkpoint written on SIGTERM"
    at = int(saved[-1].name.removeprefix("step-"))
    assert at >= 40, saved
    cluster.kubectl_run("patch", "ftj", "paused", "--type", "merge", "-p",
                        '{"spec": {"runPolicy": {"suspend": false}}}')
    rank0 = until(lambda: running_worker(cluster, "paused", 0, not_in=first),
                  "a new rank-0 pod running", cluster=cluster, name="paused")
    assert until(lambda: resumed_from(cluster, "paused", rank0), "the new rank 0 resuming",
                 cluster=cluster, name="paused") == at
    assert job_status(cluster, "paused").get("restarts", 0) == 0
    remove(cluster, "paused")


def test_the_operators_pod_deleted_mid_job_creates_nothing_twice(cluster, release, claim):
    """The Deployment's new operator pod adopts the running job: the same worker Job (its
    uid), training on."""
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(long_job("adopted")))
    until(lambda: trained_past(cluster, "adopted", 20), "past step 20", cluster=cluster,
          name="adopted")
    before = cluster.kubectl_run("get", "job", "adopted", "-o",
                                 "jsonpath={.metadata.uid}").stdout
    step = job_status(cluster, "adopted")["progress"]["step"]
    cluster.kubectl_run("delete", "pod", "-n", "finetune-system", "-l",
                        "app.kubernetes.io/name=finetune-operator", "--grace-period=0",
                        "--force")
    cluster.kubectl_run("rollout", "status", "-n", "finetune-system",
                        f"deploy/{release}-finetune-operator", "--timeout=120s")
    until(lambda: trained_past(cluster, "adopted", step + 30), "progress read by the new pod",
          cluster=cluster, name="adopted")
    assert cluster.kubectl_run("get", "job", "adopted", "-o",
                               "jsonpath={.metadata.uid}").stdout == before
    assert job_status(cluster, "adopted").get("restarts", 0) == 0
    remove(cluster, "adopted")


def test_a_missing_secret_is_named_by_the_field_that_names_it(cluster, release, claim):
    """The kubelet's CreateContainerConfigError for a Secret the namespace lacks, traced to
    `spec.kubernetes.env[0]` with the command that makes it."""
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(long_job(
        "nosecret", kubernetes={"env": [{"name": "WANDB_API_KEY", "valueFrom": {
            "secretKeyRef": {"name": "wandb", "key": "token"}}}]})))
    message = until(lambda: "has no Secret 'wandb'" in (m := job_status(
        cluster, "nosecret").get("message", "")) and m, "the missing Secret in the status",
        cluster=cluster, name="nosecret")
    assert "spec.kubernetes.env[0] (WANDB_API_KEY)" in message, message
    assert "kubectl create secret generic wandb -n default" in message, message
    remove(cluster, "nosecret")


# --- the release's life: upgrade and uninstall ----------------------------------------------
CHART = REPO / "charts" / "finetune-operator"
CRD_UPGRADE = ["apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds")]
"""The chart README's command that upgrades the CRDs, which Helm never does."""


def operator_pods(cluster, release: str) -> list[dict]:
    listed = cluster.kubectl_run("get", "pods", "-n", "finetune-system", "-l",
                                 f"app.kubernetes.io/instance={release}", "-o", "json")
    return [p for p in json.loads(listed.stdout)["items"]
            if not p["metadata"].get("deletionTimestamp")]


def next_operator_image(cluster, local: str) -> str:
    """A new operator image, as a new release publishes one: the built image with a layer
    of metadata more (its own digest), under a name of its own so that the first stays
    for the next run, pushed to the cluster's registry."""
    container = images.buildah("from", "--pull=never", local).strip()
    try:
        images.buildah("config", "--label", "finetune.dev/release=next", container)
        name = f"localhost/finetune-operator-next:{local.rsplit(':', 1)[1]}"
        images.buildah("commit", "--quiet", container, name)
    finally:
        images.buildah("rm", container)
    return cluster.registry.push(name, images.buildah, print)


def test_helm_upgrade_mid_job_rolls_a_new_operator_and_the_job_trains_on(
        cluster, release, claim, built_images):
    """`helm upgrade --reuse-values` with a new operator image and a values change while a
    job trains: the Deployment rolls to the new image with the new setting, and the new
    operator adopts the job (the same worker Job, no restart) and reads its progress on."""
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(long_job("upgraded")))
    until(lambda: trained_past(cluster, "upgraded", 20), "past step 20", cluster=cluster,
          name="upgraded")
    before = cluster.kubectl_run("get", "job", "upgraded", "-o",
                                 "jsonpath={.metadata.uid}").stdout
    local = "localhost/" + built_images["operator"].split("/", 1)[1]
    new = next_operator_image(cluster, local)
    repository, tag = new.rsplit(":", 1)
    helm(cluster, "upgrade", release, *released_chart(cluster), "-n", "finetune-system",
         "--reuse-values",
         "--set", f"image.repository={repository},image.tag={tag},logLevel=debug", "--wait",
         "--timeout", "3m")
    pods = until(lambda: (p := operator_pods(cluster, release)) and all(
        x["spec"]["containers"][0]["image"] == new for x in p) and p, "only the new operator")
    container = pods[0]["spec"]["containers"][0]
    assert "--log-level=debug" in container.get("args", []) + container.get("command", []), \
        container
    step = job_status(cluster, "upgraded")["progress"]["step"]
    until(lambda: trained_past(cluster, "upgraded", step + 30), "progress read by the new "
          "operator", cluster=cluster, name="upgraded")
    assert cluster.kubectl_run("get", "job", "upgraded", "-o",
                               "jsonpath={.metadata.uid}").stdout == before
    assert job_status(cluster, "upgraded").get("restarts", 0) == 0
    remove(cluster, "upgraded")


def older_crd() -> dict:
    """The FineTuneJob CRD as a cluster installed before DPO holds it: no spec.objective,
    nor the rules that read it."""
    crd = yaml.safe_load((CHART / "crds" / "finetunejobs.finetune.dev.yaml").read_text())

    def without_objective(node):
        if isinstance(node, dict):
            node.get("properties", {}).pop("objective", None)
            if "x-kubernetes-validations" in node:
                node["x-kubernetes-validations"] = [
                    r for r in node["x-kubernetes-validations"] if "objective" not in r["rule"]]
            for value in node.values():
                without_objective(value)
        elif isinstance(node, list):
            for value in node:
                without_objective(value)

    without_objective(crd["spec"]["versions"][0]["schema"])
    return crd


def test_helm_upgrade_leaves_the_crd_and_the_readmes_command_upgrades_it(
        cluster, release, built_images):
    """Helm never upgrades crds/: after `helm upgrade` an older CRD stays, refuses the new
    fields (a DPO job), and the new operator says so with the command; the chart README's
    command upgrades it, and the job is accepted."""
    dpo = yaml.safe_load((REPO / "examples" / "08-dpo-lora.yaml").read_text())
    dpo["spec"].update(model={"uri": "pvc://finetune-e2e/models/tiny"},
                       dataset={**dpo["spec"]["dataset"], "uri": "pvc://finetune-e2e/pairs.jsonl"},
                       output={"uri": "pvc://finetune-e2e/dpo"})
    cluster.kubectl_run("apply", "--server-side", "--force-conflicts", "-f", "-",
                        input=json.dumps(older_crd()))
    cluster.kubectl_run("wait", "--for=condition=Established",
                        "crd/finetunejobs.finetune.dev", "--timeout=60s")
    repository, tag = built_images["operator"].rsplit(":", 1)
    helm(cluster, "upgrade", release, *released_chart(cluster), "-n", "finetune-system",
         "--reuse-values",
         "--set", f"image.repository={repository},image.tag={tag},reconcilers=12", "--wait",
         "--timeout", "3m")
    served = json.loads(cluster.kubectl_run("get", "crd", "finetunejobs.finetune.dev", "-o",
                                            "json").stdout)
    spec = served["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "objective" not in spec["properties"], "helm upgrade changed crds/"
    refused = cluster.kubectl_run("apply", "--dry-run=server", "-f", "-",
                                  input=json.dumps(dpo), check=False)
    assert refused.returncode != 0 and "objective" in refused.stderr, refused
    pod = until(lambda: next((p["metadata"]["name"] for p in operator_pods(cluster, release)
                              if "--reconcilers=12" in p["spec"]["containers"][0]["args"]),
                             None), "the upgraded operator's pod")
    said = until(lambda: "lacks spec.objective" in (log := cluster.kubectl_run(
        "logs", "-n", "finetune-system", pod, check=False).stdout) and log,
        "the operator's warning of the older CRD")
    assert " ".join(CRD_UPGRADE[:3]) in said, said[-2000:]

    cluster.kubectl_run(*CRD_UPGRADE)
    cluster.kubectl_run("wait", "--for=condition=Established",
                        "crd/finetunejobs.finetune.dev", "--timeout=60s")
    accepted = cluster.kubectl_run("apply", "--dry-run=server", "-f", "-",
                                   input=json.dumps(dpo), check=False)
    assert accepted.returncode == 0, accepted.stderr


def test_helm_uninstall_removes_the_operator_and_keeps_the_crds(cluster, release):
    """`helm uninstall`: the Deployment, its pods, ServiceAccount, RBAC and Service go; the
    CRDs stay (Helm keeps crds/), as the chart README says."""
    selector = f"app.kubernetes.io/instance={release}"

    def left() -> list[str]:
        return cluster.kubectl_run("get", "deploy,pods,serviceaccounts,services", "-n",
                                   "finetune-system", "-l", selector, "-o", "name").stdout.split(
            ) + cluster.kubectl_run("get", "clusterroles,clusterrolebindings", "-l", selector,
                                    "-o", "name").stdout.split()

    kinds = {name.split("/")[0] for name in left()}
    assert {"deployment.apps", "pod", "serviceaccount", "service", "clusterrole.rbac."
            "authorization.k8s.io"} <= kinds, kinds
    helm(cluster, "uninstall", release, "-n", "finetune-system", "--wait")
    until(lambda: not left(), "the release's objects gone (the operator's pod terminating)",
          timeout=120)
    # a job applied with no operator left: `finetune status` and `logs` say none acts on it
    job = long_job("orphan")
    cluster.kubectl_run("apply", "-f", "-", input=json.dumps(job))
    said = finetune(cluster, "status", "orphan")
    assert said.returncode == 0 and "no operator has acted on it yet" in said.stdout, said
    logs = finetune(cluster, "logs", "orphan")
    assert logs.returncode == 1 and "no operator has acted on it yet" in logs.stderr, logs
    cluster.kubectl_run("delete", "ftj", "orphan")
    crds = cluster.kubectl_run("get", "crd", "-o", "name").stdout.split()
    assert {"customresourcedefinition.apiextensions.k8s.io/finetunejobs.finetune.dev",
            "customresourcedefinition.apiextensions.k8s.io/finetunesweeps.finetune.dev"} <= set(
                crds), crds
