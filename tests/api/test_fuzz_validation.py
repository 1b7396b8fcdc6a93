"""Whatever a user writes, validation answers with problems or a job — never a traceback."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finetune_operator.api import AzureMLSpec, KubernetesSpec, Resources, RunPolicy
from finetune_operator.validation import check_document
from finetune_trainer.config import (
    DatasetSource,
    Hyperparameters,
    MethodConfig,
    ModelSource,
    ObjectiveConfig,
    OutputConfig,
    StrategyConfig,
)
from tests.conftest import minimal_job
from tests.support.crd_schema import cel_failures

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True), st.text(max_size=30))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12)
SECTIONS = ["backend", "model", "dataset", "method", "objective", "strategy", "hyperparameters",
            "resources", "output", "runPolicy", "kubernetes", "azureml"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(section=st.sampled_from(SECTIONS), value=values)
def test_any_section_value_gets_an_answer(section, value):
    doc = minimal_job()
    doc["spec"][section] = value
    job, problems = check_document(doc)
    assert job is not None or problems
    assert all(p.path and p.message and p.fix for p in problems)


@settings(max_examples=200, deadline=None)
@given(doc=values)
def test_any_document_gets_an_answer(doc):
    job, problems = check_document(doc)
    assert job is None and problems


def _fields(model) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


KNOWN_FIELDS = {name: _fields(model) for name, model in (
    ("model", ModelSource), ("dataset", DatasetSource), ("method", MethodConfig),
    ("objective", ObjectiveConfig),
    ("strategy", StrategyConfig), ("hyperparameters", Hyperparameters),
    ("resources", Resources), ("output", OutputConfig), ("runPolicy", RunPolicy),
    ("kubernetes", KubernetesSpec), ("azureml", AzureMLSpec))}


@st.composite
def section_with_known_keys(draw):
    section = draw(st.sampled_from(sorted(KNOWN_FIELDS)))
    fields = draw(st.dictionaries(st.sampled_from(KNOWN_FIELDS[section]), values, max_size=4))
    return section, fields


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(change=section_with_known_keys())
def test_known_fields_with_any_values_get_an_answer(change):
    section, fields = change
    doc = minimal_job()
    base = doc["spec"].get(section)
    doc["spec"][section] = {**base, **fields} if isinstance(base, dict) else fields
    job, problems = check_document(doc)
    assert job is not None or problems
    assert all(p.path and p.message and p.fix for p in problems)


@pytest.fixture(scope="module")
def crd_rules(committed_crd):
    """The CRD, with cel-python's recursion limit raised before the examples run (its
    Environment raises it: hypothesis warns of a limit changed under a running test)."""
    import celpy

    celpy.Environment()
    return committed_crd


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.one_of(st.sampled_from(["sft", "dpo"]), scalars),
       dpo=st.one_of(st.none(), st.dictionaries(
           st.sampled_from(["beta", "loss", "labelSmoothing"]),
           st.one_of(st.sampled_from(["sigmoid", "ipo", "robust"]),
                     st.floats(-1, 2, allow_nan=False), st.sampled_from([0.0, 0.1]), values),
           max_size=3)),
       data_format=st.sampled_from(["auto", "chat", "instruction", "text", "preference"]))
def test_any_objective_gets_an_answer_and_the_crd_agrees(crd_rules, kind, dpo, data_format):
    """Objective and data format, as validate and the CRD's CEL rules see them: a manifest
    validate accepts, the API server accepts; one the objective rules refuse, it refuses."""
    doc = minimal_job(dataset={"uri": "pvc://data/train.jsonl", "format": data_format},
                      objective={"type": kind, **({} if dpo is None else {"dpo": dpo})})
    job, problems = check_document(doc)
    assert job is not None or problems
    assert all(p.path and p.message and p.fix for p in problems)
    if job is None:
        return
    errors = [p for p in problems if p.severity == "error"]
    defaulted = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    refused = cel_failures(crd_rules, defaulted)
    assert bool(errors) == bool(refused), ([str(p) for p in errors], refused)
    assert not errors or all(p.path.startswith(("spec.objective", "spec.dataset.format"))
                             for p in errors), [str(p) for p in errors]
