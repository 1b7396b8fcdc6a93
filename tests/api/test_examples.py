"""Every example a user copies is accepted by the models, the CRD schema and its CEL rules."""

from __future__ import annotations

import pytest
import yaml

from finetune_operator.validation import check_document, parse_job
from tests.conftest import EXAMPLES, REPO, load_yaml
from tests.support.crd_schema import cel_failures, schema_errors


def test_there_are_the_promised_examples():
    names = " ".join(p.name for p in EXAMPLES)
    for wanted in ("cpu-lora", "fsdp-full", "qlora-spot", "azureml-zero3", "kueue"):
        assert wanted in names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path, committed_crd):
    doc = load_yaml(path)
    job, problems = check_document(doc)
    assert job is not None
    assert [p for p in problems if p.severity == "error"] == []
    assert schema_errors(committed_crd, doc) == []
    assert cel_failures(committed_crd, job.model_dump(by_alias=True, exclude_none=True,
                                                      mode="json")) == []


def test_examples_cover_both_backends_and_all_methods():
    jobs = [parse_job(load_yaml(p)) for p in EXAMPLES]
    assert {j.spec.backend for j in jobs} == {"kubernetes", "azureml"}
    assert {j.spec.method.type for j in jobs} == {"lora", "qlora", "full"}
    assert any(j.spec.kubernetes and j.spec.kubernetes.queue_name for j in jobs)
    assert any(j.spec.model.uri.startswith("azureml://registries/") for j in jobs)


@pytest.mark.parametrize("setup", ["ml-team.yaml", "make-cluster.yaml"])
def test_the_cluster_setup_the_examples_expect_is_valid_and_shared(setup):
    """examples/cluster/ml-team.yaml (AKS) and make-cluster.yaml (`make cluster`): the
    namespace, PriorityClass and claims examples 02, 03 and 05 name; the output claim is
    ReadWriteMany (every rank writes checkpoints)."""
    import kubernetes_validate

    objects = list(yaml.safe_load_all((REPO / "examples/cluster" / setup).read_text()))
    for obj in objects:
        kubernetes_validate.validate(obj, "1.32", strict=True)
    claims = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PersistentVolumeClaim"}
    assert claims["checkpoints"]["spec"]["accessModes"] == ["ReadWriteMany"]
    named = {o["metadata"]["name"] for o in objects}
    example = yaml.safe_load((REPO / "examples/02-aks-fsdp-full-8b.yaml").read_text())
    assert example["metadata"]["namespace"] in named
    assert example["spec"]["kubernetes"]["priorityClassName"] in named
    for section in ("dataset", "output"):
        assert example["spec"][section]["uri"].split("/")[2] in claims
