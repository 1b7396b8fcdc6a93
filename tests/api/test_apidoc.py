"""The API reference says what the CRD allows (#58, item 4): each field's default, the one a
default_factory gives included, and its ranges, read from the generated schema itself."""

from __future__ import annotations

import re

import pytest

from finetune_operator import api, apidoc, crd

LIMITS = ("minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems",
          "minProperties", "maxProperties")


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


@pytest.fixture(scope="module")
def reference() -> str:
    return crd.generated_files()[crd.API_REFERENCE]


def row(reference: str, path: str) -> list[str]:
    """The cells (type, default, description) of the first row of `path`."""
    for line in reference.splitlines():
        if line.startswith(f"| `{path}` |"):
            return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[2:-1]]
    raise AssertionError(f"no row for {path}")


@pytest.mark.parametrize(("path", "kind", "default"), [
    ("spec.method.lora.targetModules", "list of string (1 to 64 items; each 1 to 128 "
                                       "characters)", '`["all-linear"]`'),
    ("spec.method.lora.r", "integer (1 to 1024)", "`16`"),
    ("spec.method.lora.alpha", "number (> 0)", "`32`"),
    ("spec.method.lora.dropout", "number (>= 0, < 1)", "`0.05`"),
    ("spec.template.method.lora.targetModules", "list of string (1 to 64 items; each 1 to "
                                                "128 characters)", '`["all-linear"]`'),
])
def test_a_fields_row_shows_its_range_and_default(reference, path, kind, default):
    assert row(reference, path)[:2] == [kind, default]


def test_a_short_pattern_is_shown_and_a_long_one_left_to_the_description(reference):
    assert "matching `^/\\S*$`" in row(reference, "spec.kubernetes.volumes[].mountPath")[0]
    assert "matching" not in row(reference, "spec.model.uri")[0]  # 138 characters


def test_every_limit_of_the_crd_is_in_its_row():
    """Whatever the schema bounds, the reference says, so the two cannot disagree."""
    for kind, short, schema in ((api.KIND, "ftj", crd.openapi_schema()),
                                (api.SWEEP_KIND, "ftsweep", crd.sweep_openapi_schema())):
        text = apidoc.render_markdown((kind, short, schema))
        for root in ("spec", "status"):
            for path, node, _ in apidoc._rows(schema["properties"][root], root):
                kind_cell = row(text, path)[0]
                bounded = [node, node.get("items") or {}, node.get("additionalProperties")
                           if isinstance(node.get("additionalProperties"), dict) else {}]
                for limit in LIMITS:
                    for part in bounded:
                        if limit in part:
                            assert number(part[limit]) in kind_cell, (path, limit, kind_cell)


def test_a_default_the_schema_lacks_comes_from_the_model_and_empty_ones_are_not_shown():
    """pydantic leaves a default_factory's value out of the JSON schema (the CRD then
    defaults nothing there; the operator's model fills it in)."""
    schema = crd.openapi_schema()
    assert "default" not in schema["properties"]["spec"]["properties"]["method"][
        "properties"]["lora"]["properties"]["targetModules"]
    text = apidoc.render_markdown((api.KIND, "ftj", schema))
    assert row(text, "spec.kubernetes.tolerations")[1] == ""  # default_factory=list
    assert row(text, "spec.kubernetes.labels")[1] == ""  # default_factory=dict
