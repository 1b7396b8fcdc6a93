"""Check objects against the generated CRD the way the API server would.

jsonschema (draft 4 understands OpenAPI v3.0's boolean exclusiveMinimum) stands in for
the structural schema validation, with unknown fields refused as `kubectl apply`'s
strict field validation does; cel-python evaluates the `x-kubernetes-validations`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(schema)

    def walk(node: dict[str, Any]) -> None:
        if "properties" in node and node.get("type") == "object":
            node.setdefault("additionalProperties", False)
            for child in node["properties"].values():
                walk(child)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key])

    walk(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def openapi(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def schema_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(_strict(openapi(crd)))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)]


def _scoped(schema: dict[str, Any], obj: Any, path: str = "") -> Iterator[tuple[str, dict, Any]]:
    """(path, schema node, object) for every schema node that has a value in `obj`."""
    yield path, schema, obj
    if isinstance(obj, dict):
        for name, child in schema.get("properties", {}).items():
            if name in obj:
                yield from _scoped(child, obj[name], f"{path}.{name}" if path else name)
    if isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            yield from _scoped(schema["items"], item, f"{path}[{i}]")


def cel_failures(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Messages of the CEL rules `obj` breaks; `obj` must already carry its defaults."""
    env = celpy.Environment()
    failed = []
    for path, node, value in _scoped(openapi(crd), obj):
        for rule in node.get("x-kubernetes-validations", []):
            program = env.program(env.compile(rule["rule"]))
            if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
                failed.append(f"{path}: {rule['message']}")
    return failed
