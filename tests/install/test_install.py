"""Installing the product on a real Kubernetes API server as a user does, and logging in as
the chart's ServiceAccount: the CRD by `kubectl apply`, the operator from a `pip install .`
without the training stack, one clear line for every way a login can fail."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import time
from urllib.parse import parse_qs, urlsplit

import pytest

from finetune_operator import crd
from finetune_operator.controller.reconcilers import CRD_UPGRADE
from tests.conftest import REPO
from tests.support import waits
from tests.support.cluster_fixtures import (
    OPERATOR_NAMESPACE,
    OperatorProcess,
    controlplane,
    standing_in,
)


def test_the_crd_is_accepted_served_and_explained(installation):
    """The API server checks every CEL rule against every default when the CRD is applied;
    it refused ours until the defaults were written out (tests/api/test_crd.py)."""
    kubectl = installation.kubectl
    crd = json.loads(kubectl("get", "crd", "finetunejobs.finetune.dev", "-o", "json").stdout)
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True" and established["NamesAccepted"] == "True"
    explained = kubectl("explain", "ftj.spec.method").stdout
    assert "What is trained." in explained and "enum: lora, qlora, full" in explained
    assert "targetModules" in kubectl("explain", "ftj.spec.method.lora").stdout
    assert "offload" in kubectl("explain", "finetunejob.spec.strategy").stdout
    assert "ftj" in kubectl("api-resources", "--api-group=finetune.dev").stdout


def test_the_operator_install_has_what_it_imports(operator_install):
    """`pip install .` without extras is the operator image: no torch, and everything the
    operator imports (prometheus-client was only in the trainer extra)."""
    python = str(operator_install / "python")
    help_text = subprocess.run([str(operator_install / "finetune"), "operator", "--help"],
                               capture_output=True, text=True)
    assert help_text.returncode == 0, help_text.stderr
    imports = subprocess.run([python, "-c", (
        "import importlib.util, finetune_operator.controller.reconcilers, "
        "finetune_operator.backends.kubernetes.backend; "
        "from finetune_operator.cli.operate import operator_command as c;"
        "print(importlib.util.find_spec('torch') is None,"
        "     [p.name for p in c.params if getattr(p, 'hidden', False)])")],
        capture_output=True, text=True)
    assert imports.returncode == 0, imports.stderr
    # no torch, and no hidden option: no way in that users do not have
    assert imports.stdout.strip() == "True []"


def test_the_operator_runs_as_the_charts_service_account(installation, operator_process):
    """Only the ServiceAccount's token in its kubeconfig, and it runs: kopf logs in through
    the same credentials as the operator's own calls."""
    config = json.loads(installation.operator_kubeconfig.read_text())
    assert [list(u["user"]) for u in config["users"]] == [["token"]]
    whoami = installation.kubectl("auth", "whoami", "-o", "json",
                                  kubeconfig_path=installation.operator_kubeconfig)
    user = json.loads(whoami.stdout)["status"]["userInfo"]["username"]
    assert user == f"system:serviceaccount:{OPERATOR_NAMESPACE}:{installation.service_account}"
    assert operator_process.process is not None and operator_process.process.poll() is None
    assert "is not this operator's" not in operator_process.log.read_text()  # CRDs current


@pytest.mark.asyncio
async def test_a_crd_an_upgrade_left_behind_is_named_with_the_command_that_upgrades_it(
        installation, operator_install, operator_process, tmp_path):
    """Helm installs crds/ once and never upgrades it: an operator upgraded alone reads
    fields the API server does not serve. At start it compares the served CRDs with its own
    (as the chart's ServiceAccount) and says what differs and how to upgrade them."""
    kubectl = installation.kubectl
    stale = crd.crd()
    strategy = stale["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["strategy"]
    del strategy["properties"]["packedAttention"]  # a field added after the installed chart's
    del strategy["default"]["packedAttention"]
    await asyncio.to_thread(kubectl, "apply", "--server-side", "--force-conflicts", "-f", "-",
                            input=json.dumps(stale))
    upgraded = OperatorProcess(operator_install, installation.operator_kubeconfig,
                               operator_process.settings, tmp_path / "operator.log",
                               interval=operator_process.interval)
    try:
        async with standing_in(operator_process, upgraded):
            said = upgraded.log.read_text()
    finally:
        await asyncio.to_thread(kubectl, "apply", "--server-side", "--force-conflicts", "-f",
                                str(REPO / "crds" / "finetunejobs.finetune.dev.yaml"))
    assert ("the CRD finetunejobs.finetune.dev on this cluster is not this operator's: it "
            f"lacks spec.strategy.packedAttention — upgrade it: {CRD_UPGRADE}") in said, said
    assert "finetunesweeps.finetune.dev on this cluster" not in said  # that one is current


def test_it_lists_and_watches_only_its_own_children(installation, operator_process):
    """The children's watches carry the managed-by label selector (#23): on a shared cluster
    the API server sends the operator its own pods and Jobs, not every pod's every change.
    From the API server's audit log of the operator's own requests."""
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{installation.service_account}"
    seen: dict[str, list[str]] = {}
    audit = installation.plane.folder / "logs" / "audit.jsonl"
    for line in audit.read_text().splitlines():
        event = json.loads(line)
        resource = event.get("objectRef", {}).get("resource")
        if (event.get("user", {}).get("username") == user and event.get("verb") in (
                "list", "watch") and resource in ("pods", "jobs", "services", "configmaps")
                and not event.get("objectRef", {}).get("name")):
            seen.setdefault(resource, []).append(event["requestURI"])
    assert set(seen) == {"pods", "jobs", "services", "configmaps"}, seen
    unfiltered = [uri for uris in seen.values() for uri in uris if parse_qs(urlsplit(uri).query)
                  .get("labelSelector") != ["app.kubernetes.io/managed-by=finetune-operator"]]
    assert unfiltered == []


def _operator_once(bin_dir, kubeconfig) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / "finetune"), "operator", "--metrics-port", "0",
                           "--health-port", "0"], capture_output=True, text=True,
                          timeout=waits.seconds_left(),
                          env={"PATH": "/usr/bin:/bin", "KUBECONFIG": kubeconfig})


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_every_way_a_login_fails_is_one_line_naming_the_fix(
        installation, operator_install, tmp_path):
    plane = installation.plane
    ca = plane.folder / "pki" / "ca.crt"

    def config(name: str, server: str, token: str) -> str:
        path = tmp_path / f"{name}.kubeconfig"
        path.write_text(json.dumps(controlplane.kubeconfig(server, name, token, ca)))
        return str(path)

    refused = _one_line(_operator_once(operator_install, config("bad", plane.server, "nope")))
    assert "401 Unauthorized" in refused and "kubectl create token" in refused

    unreachable = _one_line(_operator_once(
        operator_install, config("gone", "https://127.0.0.1:9", "x")))
    assert "cannot reach the API server at https://127.0.0.1:9" in unreachable
    assert "is the cluster up" in unreachable

    missing = _one_line(_operator_once(operator_install, str(tmp_path / "absent.kubeconfig")))
    assert "no usable Kubernetes credentials" in missing and "set KUBECONFIG" in missing

    # a service account that exists but was never given the chart's RBAC
    installation.kubectl("create", "serviceaccount", "nobody", "-n", "default")
    token = installation.kubectl("create", "token", "nobody", "-n", "default").stdout.strip()
    forbidden = _one_line(_operator_once(operator_install,
                                         config("nobody", plane.server, token)))
    assert "403 Forbidden" in forbidden and "install the chart's RBAC" in forbidden

    # allowed the FineTuneJobs but not the workers (a hand-made Role): kopf retried the
    # forbidden watches for ever, then stopped answering, SIGTERM included
    installation.kubectl("create", "clusterrole", "jobs-only", "--verb=get,list,watch",
                         "--resource=finetunejobs.finetune.dev,finetunesweeps.finetune.dev")
    installation.kubectl("create", "clusterrolebinding", "jobs-only", "--clusterrole=jobs-only",
                         "--serviceaccount=default:nobody")
    deadline = time.monotonic() + waits.seconds_left()
    while True:  # the API server's RBAC cache takes the binding in: within a second here
        partial = _one_line(_operator_once(operator_install,
                                           config("partial", plane.server, token)))
        if "403 Forbidden" not in partial or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert partial.startswith("finetune operator: the credentials may not create configmaps, "
                              "create events, create finetunejobs, "), partial
    assert "watch pods" in partial and "patch finetunejobs/status" in partial
    assert "list finetunejobs" not in partial and "install the chart's RBAC" in partial


def test_with_only_the_rights_it_needs_it_starts_warning_what_goes_without_the_rest(
        installation, tmp_path):
    """A hand-made ClusterRole of exactly kube.NEEDED_ACCESS: the operator starts, and says
    per right the chart would also grant what goes without it (a job queued by Kueue, an
    RWX check, runPolicy.suspend, an Azure ML job's finalizer)."""
    from finetune_operator import kube

    rules = [{"apiGroups": [group], "resources": [resource], "verbs": [verb]}
             for group, resource, verb in kube.NEEDED_ACCESS]
    installation.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "needed-only"}, "rules": rules}))
    installation.kubectl("create", "serviceaccount", "needed-only", "-n", "default")
    installation.kubectl("create", "clusterrolebinding", "needed-only",
                         "--clusterrole=needed-only", "--serviceaccount=default:needed-only")
    token = installation.kubectl("create", "token", "needed-only", "-n", "default").stdout
    path = tmp_path / "needed-only.kubeconfig"
    path.write_text(json.dumps(controlplane.kubeconfig(
        installation.plane.server, "needed-only", token.strip(),
        installation.plane.folder / "pki" / "ca.crt")))

    async def check() -> list[str]:
        client = kube.Kube(str(path))
        try:
            return await kube.check_access(client)
        finally:
            await client.close()

    deadline = time.monotonic() + waits.seconds_left()
    while True:  # the API server's RBAC cache takes the binding in: within a second here
        try:
            warnings = asyncio.run(check())
            break
        except kube.LoginError as error:
            assert "403 Forbidden" in str(error) or "may not" in str(error), error
            assert time.monotonic() < deadline, error
            time.sleep(0.5)
    assert len(warnings) == len(kube.OPTIONAL_ACCESS), warnings
    assert ("the credentials may not get persistentvolumeclaims: a multi-node job is launched "
            "without checking that its output claim is ReadWriteMany (the chart's RBAC grants "
            "it)") in warnings
    assert any(w.startswith("the credentials may not patch workloads: ") for w in warnings)


def _signed_client_certificate(pki, user: str, folder) -> tuple[str, str]:
    """A client certificate for `user`, signed by the cluster's CA (its --client-ca-file)."""
    key, csr, crt = folder / f"{user}.key", folder / f"{user}.csr", folder / f"{user}.crt"
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(csr), "-subj", f"/CN={user}"], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"),
                    "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-out", str(crt),
                    "-days", "1"], check=True, capture_output=True)
    return base64.b64encode(crt.read_bytes()).decode(), base64.b64encode(key.read_bytes()).decode()


def test_it_logs_in_with_client_certificates_and_exec_plugins_as_kubectl_does(
        installation, operator_install, tmp_path):
    """The same kubeconfig works for kubectl and for the operator: a client certificate, and
    an exec plugin (how kubelogin logs in on AKS) handing out the ServiceAccount's token."""
    plane = installation.plane
    base = json.loads(installation.operator_kubeconfig.read_text())
    token = base["users"][0]["user"]["token"]
    namespace = "login-check"
    installation.kubectl("create", "namespace", namespace)

    user = "finetune-cert-user"
    certificate, key = _signed_client_certificate(plane.folder / "pki", user, tmp_path)
    for role in installation.kubectl("get", "clusterrole", "-o", "name", "-l",
                                     "app.kubernetes.io/name=finetune-operator").stdout.split():
        installation.kubectl("create", "clusterrolebinding", f"{user}-{role.split('/')[1]}",
                             f"--clusterrole={role.split('/')[1]}", f"--user={user}")
    credential = json.dumps({"apiVersion": "client.authentication.k8s.io/v1",
                             "kind": "ExecCredential", "status": {"token": token}})
    users = {
        "certificate": {"client-certificate-data": certificate, "client-key-data": key},
        "exec-plugin": {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                 "command": "/bin/sh", "args": ["-c", f"echo '{credential}'"],
                                 "interactiveMode": "Never"}},
    }
    for name, credentials in users.items():
        config = {**base, "users": [{"name": base["users"][0]["name"], "user": credentials}]}
        path = tmp_path / f"{name}.kubeconfig"
        path.write_text(json.dumps(config))
        listed = installation.kubectl("get", "ftj", "-n", namespace, kubeconfig_path=path)
        assert listed.returncode == 0  # kubectl logs in with it ...
        operator = OperatorProcess(operator_install, path, installation.operator_env,
                                   tmp_path / f"{name}.log", args=("--namespace", namespace))
        try:
            operator.start()  # ... and so does the operator: kopf watches, /healthz answers
            assert "LoginError" not in operator.log.read_text()
        finally:
            operator.stop()


def test_inside_a_pod_it_logs_in_with_the_mounted_service_account(
        installation, tmp_path, monkeypatch):
    """What the chart's pod has: KUBERNETES_SERVICE_HOST/PORT and the token and CA mounted
    (here at the paths the client reads them from, pointed at files of this test)."""
    from kubernetes.config import incluster_config

    from finetune_operator import kube

    plane = installation.plane
    token = json.loads(installation.operator_kubeconfig.read_text())["users"][0]["user"]["token"]
    (tmp_path / "token").write_text(token)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME",
                        str(plane.folder / "pki" / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(plane.ports["apiserver"]))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "not-there"))  # never read in a pod
    client = kube.Kube()

    async def check() -> None:
        try:
            # lists FineTuneJobs cluster-wide; the chart's RBAC grants the optional rights too
            assert await kube.check_access(client) == []
        finally:
            await client.close()

    asyncio.run(check())
    info = kube.connection_info(kube.configuration())
    assert info.server == plane.server and info.token == token
    assert info.scheme.lower() == "bearer"  # the in-cluster loader writes it lowercase


def test_a_port_in_use_is_one_line_naming_the_option(installation, operator_install):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [str(operator_install / "finetune"), "operator", "--metrics-port", str(port),
             "--health-port", "0"], capture_output=True, text=True, timeout=waits.seconds_left(),
            env={"PATH": "/usr/bin:/bin", "KUBECONFIG": str(installation.operator_kubeconfig)})
    line = _one_line(result)
    assert f"port {port} is in use (--metrics-port)" in line


def test_the_readmes_make_cluster_steps_take_example_02_to_succeeded(installation,
                                                                     operator_process):
    """README, `make cluster`: examples/cluster/make-cluster.yaml (claims bound to volumes of
    no storage), the hub token's Secret, then example 02 as it is written: its pods are
    scheduled onto the ndasrv4 nodes and the job ends Succeeded. Before, only ml-team.yaml
    existed, whose Azure Files claims never bind here: the pods stayed Pending."""
    import time

    from tests.conftest import REPO

    kubectl = installation.kubectl
    kubectl("apply", "-f", str(REPO / "examples/cluster/make-cluster.yaml"))
    try:
        kubectl("create", "secret", "generic", "hf-token", "-n", "ml-team",
                "--from-literal=token=unused")
        kubectl("apply", "-f", str(REPO / "examples/02-aks-fsdp-full-8b.yaml"))
        deadline, phase = time.monotonic() + waits.seconds_left(), ""
        while phase != "Succeeded":
            assert time.monotonic() < deadline, kubectl(
                "describe", "ftj", "llama-8b-full", "-n", "ml-team").stdout
            time.sleep(1)
            phase = kubectl("get", "ftj", "llama-8b-full", "-n", "ml-team", "-o",
                            "jsonpath={.status.phase}").stdout
        pods = json.loads(kubectl("get", "pods", "-n", "ml-team", "-o", "json").stdout)
        assert {p["spec"]["nodeSelector"]["agentpool"] for p in pods["items"]} == {"ndasrv4"}
        assert len({p["spec"]["nodeName"] for p in pods["items"]}) == 2  # one per node
    finally:
        kubectl("delete", "namespace", "ml-team", "--wait=false")
        kubectl("delete", "pv", "ml-team-datasets", "ml-team-checkpoints", "--wait=false")
        # at once: test_control_plane's missing-PriorityClass test needs it gone
        kubectl("delete", "priorityclass", "training-high")
