"""The API reference (docs/api-reference.md), generated from the CRD schema like the CRD
itself, so the docs cannot drift from the types: each field's type with the ranges the
schema sets, and its default."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from finetune_operator import api

SHORT_PATTERN = 40
"""Patterns up to this long are shown; longer ones (locations) are left to the description,
which says what they take in words."""


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if node.get("type") == "array":
        return f"list of {_type(node['items'])}"
    if node.get("type") == "object" and "additionalProperties" in node:
        values = node["additionalProperties"]
        return "map of string" if values.get("type") == "string" else f"map of {_type(values)}"
    if node.get("x-kubernetes-preserve-unknown-fields") and "type" not in node:
        return "number, string or boolean"
    return node.get("type", "object")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _count(low: Any, high: Any, unit: str) -> str | None:
    """`1 to 64 items`, `at least 1 item`, `at most 32 items`; None without either."""
    def units(n: Any) -> str:
        return f"{_number(n)} {unit}{'' if n == 1 else 's'}"
    if low is not None and high is not None:
        return f"{_number(low)} to {units(high)}"
    if low is not None:
        return f"at least {units(low)}"
    return f"at most {units(high)}" if high is not None else None


def _bounds(node: dict[str, Any]) -> list[str]:
    """The limits one schema node sets on its own value, in words."""
    said = []
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None and high is not None and not (
            node.get("exclusiveMinimum") or node.get("exclusiveMaximum")):
        said.append(f"{_number(low)} to {_number(high)}")
    elif low is not None or high is not None:
        said.append(", ".join(
            f"{sign}{'' if node.get(flag) else '='} {_number(bound)}"
            for bound, sign, flag in ((low, ">", "exclusiveMinimum"),
                                      (high, "<", "exclusiveMaximum")) if bound is not None))
    for low_key, high_key, unit in (("minLength", "maxLength", "character"),
                                    ("minItems", "maxItems", "item"),
                                    ("minProperties", "maxProperties", "entry")):
        if (counted := _count(node.get(low_key), node.get(high_key), unit)) is not None:
            said.append(counted.replace("entrys", "entries"))
    pattern = node.get("pattern")
    if (pattern and len(pattern) <= SHORT_PATTERN and "|" not in pattern
            and not node.get("x-kubernetes-int-or-string")):
        said.append(f"matching `{pattern}`")
    if node.get("format"):
        said.append(node["format"])
    return said


def _limits(node: dict[str, Any]) -> str:
    """` (1 to 64 items; each 1 to 128 characters)`: the node's limits and those of each of
    its items or map values, as the CRD sets them; empty where it sets none."""
    said = _bounds(node)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            said += [f"each {part}" for part in _bounds(node[key])]
    return f" ({'; '.join(said)})" if said else ""


def _annotated_models(annotation: Any) -> list[tuple[type[BaseModel], str]]:
    """The models a field holds, with the path suffix of their fields: `[]` in a list.
    Maps are left out, as `_rows` leaves out their values."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _annotated_models(args[0])
    if origin in (typing.Union, types.UnionType):
        return [found for arg in args for found in _annotated_models(arg)]
    if origin is list:
        return [(model, "[]" + suffix) for model, suffix in _annotated_models(args[0])]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, "")]
    return []


def _factory_defaults(model: type[BaseModel], path: str = "",
                      depth: int = 0) -> dict[str, Any]:
    """path → default of every field under `model` that a default_factory fills: pydantic
    leaves those out of the JSON schema, so the CRD has no default there (the operator's
    model fills them in when it reads the object). Empty lists and maps are left out."""
    found: dict[str, Any] = {}
    if depth > 16:
        return found
    for name, field in model.model_fields.items():
        field_path = f"{path}.{field.alias or name}".lstrip(".")
        if field.default_factory is not None and not field.default_factory_takes_validated_data:
            value = to_jsonable_python(field.get_default(call_default_factory=True),
                                       by_alias=True, exclude_none=True)
            if value not in ([], {}):
                found[field_path] = value
        for inner, suffix in _annotated_models(field.annotation):
            found.update(_factory_defaults(inner, field_path + suffix, depth + 1))
    return found


def _rows(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any], bool]]:
    """(path, schema, required) for every field under `node`, depth first."""
    rows = []
    required = set(node.get("required", []))
    for name, child in node.get("properties", {}).items():
        child_path = f"{path}.{name}"
        rows.append((child_path, child, name in required))
        target = child["items"] if child.get("type") == "array" else child
        rows.extend(_rows(target, child_path + ("[]" if target is not child else "")))
    return rows


def render_markdown(*kinds: tuple[str, str, dict[str, Any]]) -> str:
    """The reference of each (kind, short name, openAPIV3Schema), one after the other."""
    lines = [
        "# API reference",
        "",
        "<!-- Generated by `make crds` from finetune_operator/api.py. Do not edit by hand. -->",
    ]
    for kind, short, schema in kinds:
        model = getattr(api, kind, None)
        made = (_factory_defaults(model) if isinstance(model, type)
                and issubclass(model, BaseModel) else {})
        lines += [
            "", f"## {kind}", "",
            f"`apiVersion: {api.API_VERSION}`, `kind: {kind}`, short name `{short}`. The same "
            f"text is served by `kubectl explain {short}.<field>`.",
        ]
        for root in ("spec", "status"):
            lines += ["", f"### {kind} {root}", "",
                      "| field | type | default | description |", "|---|---|---|---|"]
            for path, node, required in _rows(schema["properties"][root], root):
                value = node.get("default", made.get(path))  # the CRD's, where it has one
                default = "" if value is None else f"`{json.dumps(value)}`"
                shown = "required" if required else default
                description = node.get("description", "").replace("|", "\\|")
                lines.append(f"| `{path}` | {_type(node)}{_limits(node)} | {shown} | "
                             f"{description} |")
    return "\n".join(lines) + "\n"
