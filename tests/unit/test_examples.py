"""Every example a user copies is accepted by the models, the CRD schema and its CEL rules."""

from __future__ import annotations

import pytest

from finetune_operator.validation import check_document, parse_job
from tests.conftest import EXAMPLES, load_yaml
from tests.crd_schema import cel_failures, schema_errors


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
