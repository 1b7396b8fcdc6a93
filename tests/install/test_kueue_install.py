"""How `make cluster` installs Kueue from its own manifests (cluster/kueue_manager.py), and
that the docs' queue example is the queues it makes."""

from __future__ import annotations

import re
import sys

import yaml

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "cluster"))
import kueue_manager

SERVICE = {"name": "kueue-webhook-service", "namespace": "kueue-system", "path": "/convert"}
MANIFESTS = [  # the shapes of Kueue v0.17's config/default, cut to what installable touches
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kueue-system"}},
    {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
     "metadata": {"name": "workloads.kueue.x-k8s.io"},
     "spec": {"conversion": {"strategy": "Webhook", "webhook": {
         "clientConfig": {"service": dict(SERVICE)}, "conversionReviewVersions": ["v1"]}}}},
    {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
     "metadata": {"name": "topologies.kueue.x-k8s.io"}, "spec": {}},
    {"apiVersion": "v1", "kind": "Service",
     "metadata": {"name": "kueue-webhook-service", "namespace": "kueue-system"},
     "spec": {"ports": [{"port": 443, "targetPort": 9443}],
              "selector": {"control-plane": "controller-manager"}}},
    {"apiVersion": "apps/v1", "kind": "Deployment",
     "metadata": {"name": "kueue-controller-manager", "namespace": "kueue-system"}},
    {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
     "metadata": {"name": "v1beta2.visibility.kueue.x-k8s.io"}},
    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
     "metadata": {"name": "kueue-mutating-webhook-configuration"},
     "webhooks": [{"name": "mjob.kb.io", "clientConfig": {"service": {
         **SERVICE, "path": "/mutate-batch-v1-job"}}}]},
]


def test_kueue_is_installed_from_its_manifests_with_its_webhooks_on_this_machine():
    objects = kueue_manager.installable(MANIFESTS, webhook_port=40123)
    kinds = [o["kind"] for o in objects]
    assert "Deployment" not in kinds and "APIService" not in kinds  # a process runs instead
    assert kinds.count("CustomResourceDefinition") == 2
    by_name = {o["metadata"]["name"]: o for o in objects}
    service = by_name["kueue-webhook-service"]
    assert service["spec"] == {"type": "ExternalName", "externalName": "localhost",
                               "ports": [{"port": 40123, "protocol": "TCP"}]}
    hook = by_name["kueue-mutating-webhook-configuration"]["webhooks"][0]
    assert hook["clientConfig"]["service"] == {**SERVICE, "path": "/mutate-batch-v1-job",
                                               "port": 40123}
    conversion = by_name["workloads.kueue.x-k8s.io"]["spec"]["conversion"]["webhook"]
    assert conversion["clientConfig"]["service"]["port"] == 40123
    assert MANIFESTS[3]["spec"]["ports"][0]["port"] == 443  # the input is left as it was


def test_kueue_listens_on_loopback_only():
    ports = {"kueue-webhook": 1, "kueue-health": 2, "kueue-metrics": 3}
    config = kueue_manager.configuration(ports, REPO / "certs")
    assert config["webhook"]["host"] == "127.0.0.1"
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:2"
    assert config["metrics"]["bindAddress"] == "127.0.0.1:3"
    assert config["featureGates"] == {"VisibilityOnDemand": False}  # it binds 0.0.0.0
    assert config["integrations"]["frameworks"] == ["batch/job"]


def test_the_docs_queue_example_is_the_queues_make_cluster_makes():
    made = yaml.safe_load(kueue_manager.QUEUES.read_text())["items"]
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in made}
    text = (REPO / "docs" / "kueue.md").read_text()
    section = text[text.index("## On `make cluster`"):text.index("## How it is tested")]
    [block] = re.findall(r"```yaml\n(.*?)```", section, re.S)
    documented = [d for d in yaml.safe_load_all(block) if d]
    assert len(documented) == 3
    for doc in documented:
        assert by_key[doc["kind"], doc["metadata"]["name"]] == doc
    example = yaml.safe_load((REPO / "examples" / "05-kueue-queued.yaml").read_text())
    local = by_key["LocalQueue", example["spec"]["kubernetes"]["queueName"]]
    assert local["metadata"]["namespace"] == example["metadata"]["namespace"]
    flavor = by_key["ResourceFlavor", example["spec"]["kubernetes"]["nodeSelector"]["agentpool"]]
    assert flavor["spec"]["nodeLabels"] == example["spec"]["kubernetes"]["nodeSelector"]
