"""Security properties, checked on what is really deployed and really rendered.

- The chart's RBAC, whatever the values: no wildcard verb, resource, API group or name, no
  Secret access anywhere, no way to escalate (bind, escalate, impersonate, pods/exec,
  tokens), bound only to the operator's own service account.
- Every pod runs non-root with a read-only root filesystem, no privilege escalation and
  every capability dropped (IPC_LOCK added for InfiniBand only), whatever the values or
  the FineTuneJob, and the API has no field that would loosen that.
- A FineTuneJob cannot set the variables the backend sets for the gang (each reserved
  name, and the PET_ prefix): refused at validation and by the CRD's CEL rule, naming it.

That credentials never reach logs, events, status, objects or metrics is checked with the
real operator in tests/operator/test_no_secrets.py.
"""

from __future__ import annotations

import copy

import pytest

from finetune_operator.backends import check_manifest
from finetune_operator.backends.kubernetes import workers
from finetune_operator.backends.kubernetes.rules import RESERVED_ENV_NAMES, RESERVED_ENV_PREFIXES
from finetune_operator.settings import OperatorSettings
from finetune_operator.validation import parse_job
from tests.conftest import CLUSTER_EXAMPLES, load_yaml, minimal_job
from tests.install.test_chart import MONITORING, NON_DEFAULT, by_kind, render
from tests.support.crd_schema import cel_failures, schema_errors

CHART_VALUES = {
    "defaults": None,
    "non-default": NON_DEFAULT,
    "replicas": {"replicas": 3},
    "namespaced-replicas": {**NON_DEFAULT, "replicas": 2},
    "monitoring": MONITORING,
}
ESCALATING_VERBS = {"escalate", "bind", "impersonate", "*"}
# subresources and kinds that hand out more than the operator's own rights
ESCALATING_RESOURCES = {"secrets", "pods/exec", "pods/attach", "pods/portforward",
                        "serviceaccounts", "serviceaccounts/token", "nodes", "nodes/proxy",
                        "roles", "rolebindings", "clusterroles", "clusterrolebindings",
                        "certificatesigningrequests", "persistentvolumes",
                        "mutatingwebhookconfigurations", "validatingwebhookconfigurations"}


def roles(values):
    objects = render(values)
    return objects, by_kind(objects, "ClusterRole") + by_kind(objects, "Role")


@pytest.mark.parametrize("values", CHART_VALUES.values(), ids=CHART_VALUES.keys())
def test_rbac_has_no_wildcards_no_secrets_and_no_escalation(values):
    objects, found = roles(values)
    assert found and all(role["rules"] for role in found)
    for role in found:
        kind, name = role["kind"], role["metadata"]["name"]
        assert "aggregationRule" not in role, name  # nothing can be added to it later
        for rule in role["rules"]:
            where = f"{kind} {name}: {rule}"
            assert "nonResourceURLs" not in rule, where
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert not any("*" in item for item in rule.get(key, [])), where
            assert not ESCALATING_VERBS & set(rule["verbs"]), where
            assert not ESCALATING_RESOURCES & set(rule["resources"]), where
            if "pods" in rule["resources"]:  # pods are the Job controller's to create
                assert set(rule["verbs"]) <= {"get", "list", "watch"}, where
    account = by_kind(objects, "ServiceAccount")[0]["metadata"]["name"]
    for binding in by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                        "namespace": "finetune-system"}]
        assert binding["roleRef"]["name"] in {r["metadata"]["name"] for r in found}


@pytest.mark.parametrize("values", CHART_VALUES.values(), ids=CHART_VALUES.keys())
def test_the_operator_pod_is_locked_down_whatever_the_values(values):
    for deployment in by_kind(render(values), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
        assert not any("hostPath" in v for v in pod.get("volumes", []))
        for container in pod["containers"] + pod.get("initContainers", []):
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]}}


SETTINGS = OperatorSettings()
K8S_EXAMPLES = {p.name: load_yaml(p) for p in CLUSTER_EXAMPLES
                if load_yaml(p)["spec"].get("backend", "kubernetes") == "kubernetes"}
VOLUMES = [{"name": "creds", "mountPath": "/creds", "secret": {"secretName": "aws"}},
           {"name": "scratch", "mountPath": "/scratch", "emptyDir": {"medium": "Memory"}}]
JOBS = {
    **K8S_EXAMPLES,
    "cpu": minimal_job(resources={"gpusPerNode": 0, "processesPerNode": 2}),
    "infiniband": minimal_job(resources={"nodes": 2, "gpusPerNode": 8},
                              kubernetes={"infiniband": True}),
    "everything-a-user-can-set": minimal_job(
        resources={"gpusPerNode": 8},
        model={"uri": "hf://meta-llama/Llama-3.1-8B",
               "tokenSecretRef": {"name": "hf", "key": "token"}},
        kubernetes={"image": "registry.example.com/own/trainer:1", "spot": True,
                    "serviceAccountName": "trainer", "priorityClassName": "high",
                    "shmSize": "16Gi", "volumes": VOLUMES, "labels": {"team": "a"},
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}),
}


@pytest.mark.parametrize("doc", JOBS.values(), ids=JOBS.keys())
def test_trainer_pods_are_locked_down_whatever_the_job(doc):
    job = parse_job(copy.deepcopy(doc))
    infiniband = bool(job.spec.kubernetes and job.spec.kubernetes.infiniband)
    rendered = workers.render(job, SETTINGS)
    pod = next(o for o in rendered if o["kind"] == "Job")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
    assert all(set(v) & {"configMap", "secret", "emptyDir", "persistentVolumeClaim"}
               for v in pod["volumes"])  # never hostPath, never anything else
    for container in pod["containers"] + pod.get("initContainers", []):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert "privileged" not in context and "runAsUser" not in context
        expected = {"drop": ["ALL"], "add": ["IPC_LOCK"]} if infiniband else {"drop": ["ALL"]}
        assert context["capabilities"] == expected


@pytest.mark.parametrize(("section", "field"), [
    ("kubernetes", "securityContext"), ("kubernetes", "privileged"),
    ("kubernetes", "hostNetwork"), ("kubernetes", "hostIPC"), ("kubernetes", "command"),
    ("kubernetes", "args"), ("kubernetes", "capabilities"), ("kubernetes", "runAsUser"),
])
def test_nothing_in_the_api_loosens_the_pod(section, field, committed_crd):
    """What could weaken the pod is not a field: refused by name, here and by the CRD."""
    doc = minimal_job(**{section: {field: True}})
    job, problems = check_manifest(doc)
    assert job is None
    assert [(p.path, p.message) for p in problems] == [
        (f"spec.{section}.{field}", "is not a known field")]
    assert schema_errors(committed_crd, doc)


def test_a_host_path_volume_is_not_a_field(committed_crd):
    doc = minimal_job(kubernetes={"volumes": [{"name": "host", "mountPath": "/host",
                                               "hostPath": {"path": "/"}}]})
    job, problems = check_manifest(doc)
    assert job is None
    assert ("spec.kubernetes.volumes[0].hostPath", "is not a known field") in [
        (p.path, p.message) for p in problems]
    assert schema_errors(committed_crd, doc)


RESERVED = [*RESERVED_ENV_NAMES, *(f"{prefix}NNODES" for prefix in RESERVED_ENV_PREFIXES),
            *(f"{prefix}ANY_NEW_FLAG" for prefix in RESERVED_ENV_PREFIXES)]


@pytest.mark.parametrize("name", RESERVED)
@pytest.mark.parametrize("how", ["value", "valueFrom"])
def test_every_reserved_variable_is_refused_naming_it(name, how, committed_crd):
    entry = ({"name": name, "value": "1"} if how == "value" else
             {"name": name, "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}})
    doc = minimal_job(kubernetes={"env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, entry]})
    job, problems = check_manifest(doc)
    errors = [p for p in problems if p.severity == "error"]
    assert [p.path for p in errors] == ["spec.kubernetes.env[1].name"]
    assert f"{name} is reserved" in errors[0].message
    assert errors[0].fix == f"remove {name} from env"
    # the API server refuses it too, before the operator sees it
    defaulted = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert any("reserved" in message for message in cel_failures(committed_crd, defaulted))


# What the backend sets that a user may still override (caches, NCCL's logging and
# transport knobs, the hub token when it is not from tokenSecretRef, how long torchrun waits
# for the workers' checkpoint after SIGTERM): everything else it sets decides who is who in
# the gang and must be reserved.
TUNABLE = {"HF_HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG", "NCCL_IB_DISABLE",
           "NCCL_NET_GDR_LEVEL", "HF_TOKEN", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}


def test_every_variable_the_backend_sets_is_reserved_or_a_known_tunable():
    job = parse_job(JOBS["infiniband"] | {"spec": {
        **JOBS["infiniband"]["spec"],
        "model": {"uri": "hf://org/model", "tokenSecretRef": {"name": "hf", "key": "t"}}}})
    pod = next(o for o in workers.render(job, SETTINGS) if o["kind"] == "Job")
    names = {e["name"] for e in pod["spec"]["template"]["spec"]["containers"][0]["env"]}
    unclassified = {n for n in names - TUNABLE
                    if n not in RESERVED_ENV_NAMES and not n.startswith(RESERVED_ENV_PREFIXES)}
    assert not unclassified, (f"{sorted(unclassified)}: add to RESERVED_ENV_NAMES "
                              "(validation.py) or, if a user may override it, to TUNABLE")
