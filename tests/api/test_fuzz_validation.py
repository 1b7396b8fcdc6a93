"""Whatever a user writes, validation answers with problems or a job — never a traceback."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finetune_operator.api import AzureMLSpec, KubernetesSpec, Resources, RunPolicy
from finetune_operator.validation import check_document
from finetune_trainer.config import (
    DatasetSource,
    Hyperparameters,
    MethodConfig,
    ModelSource,
    OutputConfig,
    StrategyConfig,
)
from tests.conftest import minimal_job

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True), st.text(max_size=30))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12)
SECTIONS = ["backend", "model", "dataset", "method", "strategy", "hyperparameters", "resources",
            "output", "runPolicy", "kubernetes", "azureml"]


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
