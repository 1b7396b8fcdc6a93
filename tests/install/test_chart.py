"""The Helm chart, rendered by the real Helm engine (helm-python-sdk): valid objects,
least-privilege RBAC, values the schema refuses, and the operator settings it passes; and
the chart README's RBAC tables, CRD names and helm commands, which must agree with it."""

from __future__ import annotations

import re

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from finetune_operator.settings import OperatorSettings, Taint
from tests.conftest import REPO

CHART = REPO / "charts/finetune-operator"
IMAGES_VALUES = CHART / "ci" / "images-values.yaml"
IMAGES = yaml.safe_load(IMAGES_VALUES.read_text())
"""The two images every install sets (the chart requires them)."""
NON_DEFAULT = {
    "watchNamespaces": ["ml-team", "research"],
    "azureWorkloadIdentity": {"clientId": "11111111-2222-3333-4444-555555555555"},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "gpu": {"taint": None},
    "trainer": {"image": {"repository": "acr.example.com/trainer", "tag": "2"},
                "imagePullSecrets": [{"name": "acr-pull"}]},
    "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}],
}


def render(values=None, images=True) -> list[dict]:
    """The chart rendered with `values` over the images every install sets (`images`)."""
    chart = helm.Chart.load(str(CHART))
    merged = _merged(IMAGES, values or {}) if images else values
    out = chart.render(merged, name="ft", namespace="finetune-system", is_install=True)
    return [d for path, text in out.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = (_merged(base[key], value) if isinstance(value, dict)
                    and isinstance(base.get(key), dict) else value)
    return out


def by_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def operator_env(objects) -> dict[str, str]:
    container = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"]}


def test_lint_is_clean():
    report = helm.lint(str(CHART), IMAGES, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.process
def test_the_helm_cli_lints_it_strict():
    """What a user's CI runs: `helm lint --strict` with the helm CLI (v3.22, built from its Go
    module beside the control plane, cluster/helm)."""
    import shutil
    import subprocess
    import sys

    if shutil.which("go") is None:
        pytest.skip("the helm CLI is built from its Go module: no Go")
    sys.path.insert(0, str(REPO / "cluster"))
    import controlplane

    helm_cli = controlplane.build() / "helm"
    done = subprocess.run([str(helm_cli), "lint", "--strict", str(CHART), "-f",
                           str(IMAGES_VALUES)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


# Kinds of other projects' CRDs, which kubernetes-validate has no schema for: the Prometheus
# Operator's (the monitoring objects are checked in tests/metrics) and kopf's peering.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("kopf.dev/v1", "KopfPeering"),
    ("kopf.dev/v1", "ClusterKopfPeering"),
}
MONITORING = {
    "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
    "prometheusRule": {"enabled": True},
    "grafana": {"dashboards": {"enabled": True}},
}


@pytest.mark.parametrize("values", [None, NON_DEFAULT, {**NON_DEFAULT, "replicas": 2},
                                    MONITORING],
                         ids=["defaults", "non-default", "peering", "monitoring"])
@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_every_object_is_valid_kubernetes(values, version):
    for obj in render(values):
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_chart_ships_the_generated_crds_and_kopfs_peering_crds():
    chart = helm.Chart.load(str(CHART))
    assert sorted(c["name"] for c in chart.crds) == [
        "crds/finetunejobs.finetune.dev.yaml", "crds/finetunesweeps.finetune.dev.yaml",
        "crds/kopf-peering.yaml"]
    peering = list(yaml.safe_load_all((CHART / "crds/kopf-peering.yaml").read_text()))
    assert sorted(d["spec"]["names"]["kind"] for d in peering) == [
        "ClusterKopfPeering", "KopfPeering"]
    for crd in peering:
        kubernetes_validate.validate(crd, "1.30", strict=True)


def _rules(objects):
    return [rule for kind in ("ClusterRole", "Role") for role in by_kind(objects, kind)
            for rule in role["rules"]]


def operator_roles(objects) -> list[dict]:
    """The ClusterRoles and Roles bound to the operator's ServiceAccount (not the ones for
    people, which aggregate into the built-in roles and are bound to nobody)."""
    account = by_kind(objects, "ServiceAccount")[0]["metadata"]["name"]
    bound = {(b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace"))
             for kind in ("ClusterRoleBinding", "RoleBinding") for b in by_kind(objects, kind)
             if any(s["kind"] == "ServiceAccount" and s["name"] == account
                    for s in b["subjects"])}
    return [r for kind in ("ClusterRole", "Role") for r in by_kind(objects, kind)
            if (kind, r["metadata"]["name"], r["metadata"].get("namespace")) in bound]


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["cluster-wide", "namespaced"])
def test_rbac_is_least_privilege(values):
    rules = _rules(render(values))
    assert rules
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule
        assert "secrets" not in rule["resources"], rule
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule


def test_namespaced_mode_grants_jobs_only_in_the_watched_namespaces():
    objects = render(NON_DEFAULT)
    roles = by_kind(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml-team", "research"]
    cluster_resources = {r for role in operator_roles(objects) if role["kind"] == "ClusterRole"
                         for rule in role["rules"] for r in rule["resources"]}
    assert cluster_resources == {"customresourcedefinitions", "namespaces"}
    args = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml-team" in args and "--all-namespaces" not in args


def test_the_operator_pod_is_locked_down():
    pod = by_kind(render(), "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    context = pod["containers"][0]["securityContext"]
    assert context == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                       "capabilities": {"drop": ["ALL"]}}


def test_workload_identity_annotation_and_label():
    objects = render(NON_DEFAULT)
    account = by_kind(objects, "ServiceAccount")[0]
    assert account["metadata"]["annotations"]["azure.workload.identity/client-id"] == (
        "11111111-2222-3333-4444-555555555555")
    template = by_kind(objects, "Deployment")[0]["spec"]["template"]
    assert template["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    assert by_kind(objects, "ServiceMonitor")[0]["metadata"]["labels"]["release"] == "prom"


TRAINER = "myacr.azurecr.io/finetune-trainer:0.1.0"  # ci/images-values.yaml's


@pytest.mark.parametrize(("values", "expected"), [
    (None, OperatorSettings(trainer_image=TRAINER)),
    (NON_DEFAULT, OperatorSettings(trainer_image="acr.example.com/trainer:2", gpu_taint=None,
                                   trainer_pull_secrets=["acr-pull"])),
    # Helm merges maps with the defaults: `value: null` removes the default value
    ({"gpu": {"taint": {"key": "nvidia.com/gpu", "value": None}}},
     OperatorSettings(trainer_image=TRAINER, gpu_taint=Taint(key="nvidia.com/gpu"))),
    # the workers pull with the operator pod's Secrets unless told otherwise
    ({"imagePullSecrets": [{"name": "registry"}]},
     OperatorSettings(trainer_image=TRAINER, trainer_pull_secrets=["registry"])),
], ids=["defaults", "non-default", "other-taint", "operators-pull-secrets"])
def test_values_reach_the_operator_as_its_settings(values, expected):
    """The chart and OperatorSettings.from_env agree on every FINETUNE_* variable."""
    assert OperatorSettings.from_env(operator_env(render(values))) == expected


@pytest.mark.parametrize("unset", ["image", "trainer"])
def test_an_install_without_our_images_is_refused_saying_how_to_build_them(unset):
    """#51, item 8: the chart defaulted to ghcr.io images that are not published, and the
    first `helm install` ended in ImagePullBackOff: now it refuses to render, saying what to
    build and set."""
    values = _merged(IMAGES, {"image": {"repository": ""}} if unset == "image" else
                     {"trainer": {"image": {"repository": ""}}})
    field = "image.repository" if unset == "image" else "trainer.image.repository"
    dockerfile = "operator/Dockerfile" if unset == "image" else "trainer/Dockerfile"
    with pytest.raises(helm.HelmError, match=rf"{field} is not set: build the \w+ image "
                                             rf"from {dockerfile}.*make cluster-images"):
        render(values, images=False)


@pytest.mark.parametrize(("values", "message"), [
    ({"replicas": 9}, "replicas"),
    ({"logLevel": "loud"}, "logLevel"),
    ({"imagePullPolicy": "Always"}, "imagePullPolicy"),
    ({"azureWorkloadIdentity": {"clientId": "not-a-guid"}}, "clientId"),
    ({"watchNamespaces": ["Bad_Name"]}, "watchNamespaces"),
])
def test_the_schema_refuses_bad_values(values, message):
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match=message):
        chart.validate_schema(values)


@pytest.mark.parametrize("values", [{"replicas": 3}, {**NON_DEFAULT, "replicas": 3}],
                         ids=["cluster-wide", "namespaced"])
def test_several_replicas_peer_through_a_peering_object_they_may_patch(values):
    objects = render(values)
    deployment = by_kind(objects, "Deployment")[0]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "--peering=ft-finetune-operator" in (
        deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    namespaced = "watchNamespaces" in values
    kind, plural = (("KopfPeering", "kopfpeerings") if namespaced else
                    ("ClusterKopfPeering", "clusterkopfpeerings"))
    peerings = by_kind(objects, kind)
    assert {p["metadata"]["name"] for p in peerings} == {"ft-finetune-operator"}
    assert len(peerings) == (2 if namespaced else 1)  # one per watched namespace
    patchable = [rule for rule in _rules(objects) if plural in rule["resources"]
                 and "patch" in rule["verbs"]]
    assert patchable and all(r["resourceNames"] == ["ft-finetune-operator"] for r in patchable)


def test_one_replica_runs_standalone():
    objects = render()
    deployment = by_kind(objects, "Deployment")[0]
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert not any(a.startswith("--peering") for a in
                   deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert not by_kind(objects, "ClusterKopfPeering")
    assert not [r for r in _rules(objects) if r["apiGroups"] == ["kopf.dev"]]


# --- the RBAC tables of the chart README (#58): they cannot drift from the chart -------------

README = CHART / "README.md"
RBAC_VALUES = {"cluster-wide": None, "namespaced": NON_DEFAULT,
               "peering": {"replicas": 2}, "namespaced-peering": {**NON_DEFAULT, "replicas": 2}}
"""Every mode the operator's rules differ by: together they render every rule the chart has."""


def readme_table(heading: str) -> list[list[str]]:
    """The rows of the first table after the paragraph starting `heading` in the README,
    each cell as written."""
    text = README.read_text()
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:  # past the header and its rule
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def quoted(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def granted(roles) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for role in roles for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def people_roles(objects) -> list[dict]:
    operators = operator_roles(objects)
    return [r for r in by_kind(objects, "ClusterRole") if r not in operators]


def test_the_readmes_table_of_the_operators_rbac_is_what_the_chart_grants():
    """Every (API group, resource, verb) the chart grants the operator, in any mode, is a
    row of the README's table, with a reason, and every row is granted in some mode."""
    rendered = set().union(*(granted(operator_roles(render(v))) for v in RBAC_VALUES.values()))
    table = set()
    for group, resource, verbs, why in readme_table("**What the operator may do.**"):
        assert why, f"{resource}: say why it is needed"
        group = "" if group == "core" else quoted(group)[0]
        table |= {(group, quoted(resource)[0], verb) for verb in quoted(verbs)}
    assert sorted(rendered - table) == [], "granted, but not in the README's table"
    assert sorted(table - rendered) == [], "in the README's table, but not granted"


def test_the_readmes_table_of_the_roles_for_people_is_what_the_chart_renders():
    """The two ClusterRoles aggregated into edit/admin/view: names, labels and rules."""
    prefix = ("ft-finetune-operator", "<release>-finetune-operator")
    roles = {r["metadata"]["name"].removeprefix(prefix[0]): r for r in people_roles(render())}
    rows = readme_table("**What people may do.**")
    assert sorted(roles) == sorted(quoted(name)[0].removeprefix(prefix[1]) for name, *_ in rows)
    for name, into, resources, verbs in rows:
        role = roles[quoted(name)[0].removeprefix(prefix[1])]
        labels = {k.removeprefix("rbac.authorization.k8s.io/aggregate-to-")
                  for k, v in role["metadata"]["labels"].items()
                  if k.startswith("rbac.authorization.k8s.io/aggregate-to-") and v == "true"}
        assert labels == set(quoted(into)), name
        assert granted([role]) == {("finetune.dev", r, v) for r in quoted(resources)
                                   for v in quoted(verbs)}, name


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["cluster-wide", "namespaced"])
def test_people_get_finetunejobs_through_the_built_in_roles_unless_turned_off(values):
    """On by default in either mode, bound to nobody, no status writes; off, none rendered
    and the operator's own RBAC unchanged."""
    objects = render(values)
    people = people_roles(objects)
    assert sorted(r["metadata"]["name"] for r in people) == [
        "ft-finetune-operator-edit", "ft-finetune-operator-view"]
    for group, resource, verb in granted(people):
        assert group == "finetune.dev", group
        assert resource.split("/")[0] in ("finetunejobs", "finetunesweeps"), resource
        assert not resource.endswith("/status") or verb in ("get", "list", "watch"), resource
    off = render(_merged(values or {}, {"rbac": {"aggregateToDefaultRoles": False}}))
    assert people_roles(off) == []
    assert operator_roles(off) == operator_roles(objects)


def test_the_readme_names_every_crd_the_chart_installs():
    text = README.read_text()
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            assert f"`{crd['metadata']['name']}`" in text, crd["metadata"]["name"]


def test_the_readmes_helm_commands_name_the_release_namespace():
    """A release installed with -n is found again only with the same -n (#58)."""
    commands = re.findall(r"^(helm (?:install|upgrade|uninstall)\b.*)$", README.read_text(),
                          re.M)
    assert commands and all(" -n " in c for c in commands), commands
