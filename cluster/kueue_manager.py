"""Kueue beside the control plane of `make cluster`: its controller manager built from the
published module (cluster/kueue), installed from its own manifests (the module's
config/default, rendered at build time) and run as a process on this machine, as the
ServiceAccount those manifests make.

What differs from a Deployment in a cluster, and why:
- the webhook Service is an ExternalName to `localhost`: the API server refuses loopback
  addresses in an EndpointSlice, and the manager listens on 127.0.0.1 only;
- the webhook port is chosen free (not 443): several control planes may run at once;
- Kueue's internal certificate management writes its certificate into a Secret and waits
  until it appears in its `certDir`; a kubelet would mount it there, `start` copies it;
- its visibility API server (an APIService) is off: it would listen on every interface.
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
KUEUE_VERSION = "v0.17.0"
NAMESPACE = "kueue-system"
SERVICE_ACCOUNT = "kueue-controller-manager"
WEBHOOK_SERVICE = "kueue-webhook-service"
WEBHOOK_SECRET = "kueue-webhook-server-cert"
MANIFESTS = "kueue-manifests.yaml"
"""Kueue's own objects as `kubectl kustomize config/default` renders them, kept beside the
binaries (the module cache may be cleaned; the manifests stay with the build)."""
QUEUES = HERE / "kueue-queues.yaml"
"""The flavors and queues of the fake GPU pools (cluster/nodes.yaml)."""
NOT_RUN = {"Deployment", "APIService"}
"""Kinds of Kueue's manifests this machine runs otherwise (a process) or not at all."""
VERSION_FLAGS = (f"-X sigs.k8s.io/kueue/pkg/version.GitVersion={KUEUE_VERSION}",)


class KueueError(RuntimeError):
    """Kueue did not come up: the message says what, and which log says why."""


def render_manifests(kubectl: Path, target: Path) -> Path:
    """Kueue's manifests rendered from the module's config/default into `target`."""
    module = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/kueue"],
                            cwd=HERE / "kueue", check=True, capture_output=True,
                            text=True).stdout.strip()
    rendered = subprocess.run([str(kubectl), "kustomize", f"{module}/config/default"],
                              check=True, capture_output=True, text=True).stdout
    path = target / MANIFESTS
    partial = target / f".{MANIFESTS}.partial"
    partial.write_text(rendered)
    partial.rename(path)
    return path


def installable(manifests: list[dict[str, Any]], webhook_port: int) -> list[dict[str, Any]]:
    """Kueue's objects as installed here (pure): all but what runs otherwise (NOT_RUN), its
    webhook Service an ExternalName to localhost, and every call to its webhooks (admission
    and the CRDs' conversion) sent to `webhook_port`."""
    objects = []
    for original in manifests:
        obj = copy.deepcopy(original)
        kind = obj["kind"]
        if kind in NOT_RUN:
            continue
        if kind == "Service" and obj["metadata"]["name"] == WEBHOOK_SERVICE:
            obj["spec"] = {"type": "ExternalName", "externalName": "localhost",
                           "ports": [{"port": webhook_port, "protocol": "TCP"}]}
        for hook in obj.get("webhooks") or []:
            hook["clientConfig"]["service"]["port"] = webhook_port
        conversion = (obj.get("spec") or {}).get("conversion") or {}
        if kind == "CustomResourceDefinition" and conversion.get("strategy") == "Webhook":
            conversion["webhook"]["clientConfig"]["service"]["port"] = webhook_port
        objects.append(obj)
    return objects


def configuration(ports: dict[str, int], cert_dir: Path,
                  pods_ready_timeout: str | None = None) -> dict[str, Any]:
    """The manager's configuration: the batch/job integration, everything on loopback;
    with `pods_ready_timeout` (e.g. "10s"), Kueue's waitForPodsReady: an admitted Workload
    whose pods are not all ready in time is evicted and queued again."""
    ready = ({"waitForPodsReady": {"timeout": pods_ready_timeout, "blockAdmission": False}}
             if pods_ready_timeout else {})
    return {**ready,
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['kueue-health']}"},
        "metrics": {"bindAddress": f"127.0.0.1:{ports['kueue-metrics']}"},
        "webhook": {"host": "127.0.0.1", "port": ports["kueue-webhook"],
                    "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": WEBHOOK_SERVICE,
                                   "webhookSecretName": WEBHOOK_SECRET},
        "integrations": {"frameworks": ["batch/job"]},
        "featureGates": {"VisibilityOnDemand": False},
    }


def install(plane: Any, webhook_port: int) -> None:
    """Kueue's objects (CRDs first, established before anything of theirs), then the
    flavors and queues of the fake pools once its webhooks answer (`start`)."""
    manifests = [d for d in yaml.safe_load_all((plane.bin / MANIFESTS).read_text()) if d]
    objects = installable(manifests, webhook_port)
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    plane.kubectl_run("apply", "--server-side", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": crds}))
    plane.kubectl_run("wait", "--for=condition=Established", "--timeout=60s",
                      *(f"crd/{c['metadata']['name']}" for c in crds))
    rest = [o for o in objects if o["kind"] != "CustomResourceDefinition"]
    plane.kubectl_run("apply", "--server-side", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": rest}))


def start(plane: Any, timeout: float = 90.0) -> None:
    """Install Kueue and start its manager; return once its webhooks admit a queued Job
    (suspended by Kueue's mutating webhook) and the queues of cluster/ exist."""
    folder = plane.folder / "kueue"
    cert_dir = folder / "certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    install(plane, plane.ports["kueue-webhook"])
    token = plane.kubectl_run("create", "token", SERVICE_ACCOUNT, "-n", NAMESPACE,
                              "--duration", "48h").stdout.strip()
    kubeconfig_path = folder / "kueue.kubeconfig"
    kubeconfig_path.write_text(json.dumps(plane.kubeconfig_for(
        f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}", token)))
    (folder / "config.yaml").write_text(json.dumps(configuration(plane.ports, cert_dir)))
    run(plane, timeout)
    plane.kubectl_run("apply", "-f", str(QUEUES))


def restart(plane: Any, **settings: Any) -> None:
    """Stop the manager and start it again with `settings` of `configuration` (none: the
    defaults), as a platform engineer changes Kueue's configuration."""
    plane.stop_one("kueue")
    folder = plane.folder / "kueue"
    (folder / "config.yaml").write_text(json.dumps(
        configuration(plane.ports, folder / "certs", **settings)))
    run(plane)


def uninstall_webhooks(plane: Any) -> None:
    """Kueue's webhook configurations gone (its manager stopped first): the API server
    admits Jobs as on a cluster without Kueue; `install` and `run` bring them back."""
    plane.kubectl_run("delete", "mutatingwebhookconfiguration",
                      "kueue-mutating-webhook-configuration", "--ignore-not-found")
    plane.kubectl_run("delete", "validatingwebhookconfiguration",
                      "kueue-validating-webhook-configuration", "--ignore-not-found")


def run(plane: Any, timeout: float = 90.0) -> None:
    """Start the manager installed by `start` (again, after `plane.stop_one("kueue")`) and
    wait until its webhooks answer."""
    folder = plane.folder / "kueue"
    plane.spawn("kueue", "--config", str(folder / "config.yaml"),
                "--kubeconfig", str(folder / "kueue.kubeconfig"), "--zap-log-level", "info")
    deadline = time.monotonic() + timeout
    _mount_certificate(plane, folder / "certs", deadline)
    _wait_admitting(plane, deadline)


def _mount_certificate(plane: Any, cert_dir: Path, deadline: float) -> None:
    """What a kubelet does for the manager's pod: the webhook Secret's files in its
    certDir, once Kueue has written them into the Secret."""
    while True:
        plane.check_alive()
        found = plane.kubectl_run("get", "secret", WEBHOOK_SECRET, "-n", NAMESPACE, "-o",
                                  "json", check=False)
        data = json.loads(found.stdout).get("data") or {} if found.returncode == 0 else {}
        if data.get("tls.crt") and data.get("tls.key"):
            for name, value in data.items():
                (cert_dir / name).write_bytes(base64.b64decode(value))
            return
        if time.monotonic() > deadline:
            raise KueueError(f"Kueue wrote no webhook certificate into Secret "
                             f"{NAMESPACE}/{WEBHOOK_SECRET}; see {_log(plane)}")
        time.sleep(0.3)


PROBE_JOB = {
    "apiVersion": "batch/v1", "kind": "Job",
    "metadata": {"name": "kueue-probe", "namespace": "default",
                 "labels": {"kueue.x-k8s.io/queue-name": "probe"}},
    "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [
        {"name": "probe", "image": "probe"}]}}},
}
"""A queued Job, only ever sent as a server-side dry run: Kueue's mutating webhook answers
it `suspend: true` once it serves."""


def _wait_admitting(plane: Any, deadline: float) -> None:
    while True:
        plane.check_alive()
        probe = plane.kubectl_run("create", "--dry-run=server", "-o",
                                  "jsonpath={.spec.suspend}", "-f", "-", check=False,
                                  input=json.dumps(PROBE_JOB))
        if probe.returncode == 0 and probe.stdout.strip() == "true":
            return
        if time.monotonic() > deadline:
            said = (probe.stderr or probe.stdout).strip()
            raise KueueError(f"Kueue's webhooks do not answer ({said}); see {_log(plane)}")
        time.sleep(0.5)


def _log(plane: Any) -> Path:
    return plane.folder / "logs" / "kueue.log"
