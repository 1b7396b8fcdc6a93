"""Generate the CRDs (FineTuneJob, FineTuneSweep) from the API models (`make crds`, or
`python -m` this).

pydantic's JSON Schema is turned into a Kubernetes structural schema: references are
inlined, `X | None` becomes X (optional fields are simply not required), draft-2020
keywords become their OpenAPI v3.0 spelling, and the CEL rules of `validation` are
attached where they apply.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from finetune_operator import api, apidoc, yamlio
from finetune_operator.backends import all_cel_rules
from finetune_operator.validation import CelRule, in_sweep_template

REPO_ROOT = Path(__file__).resolve().parents[2]
API_REFERENCE = REPO_ROOT / "docs" / "api-reference.md"
CRD_FOLDERS = (REPO_ROOT / "crds", REPO_ROOT / "charts" / "finetune-operator" / "crds")
CRD_PATHS = tuple(folder / f"{api.PLURAL}.{api.API_GROUP}.yaml" for folder in CRD_FOLDERS)
SWEEP_CRD_PATHS = tuple(folder / f"{api.SWEEP_PLURAL}.{api.API_GROUP}.yaml"
                        for folder in CRD_FOLDERS)

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Backend", "type": "string", "jsonPath": ".spec.backend"},
    {"name": "Nodes", "type": "integer", "jsonPath": ".spec.resources.nodes"},
    {"name": "GPUs", "type": "integer", "jsonPath": ".spec.resources.gpusPerNode",
     "description": "GPUs per node"},
    {"name": "Strategy", "type": "string", "jsonPath": ".status.plan.strategy", "priority": 1,
     "description": "The strategy the workers run (strategy auto resolved at launch)"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Total", "type": "integer", "jsonPath": ".status.progress.totalSteps",
     "priority": 1},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.progress.tokensPerSecond",
     "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1,
     "description": "What the job does or waits for (a Secret the namespace lacks, ...)"},
]

SWEEP_PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Trials", "type": "integer", "jsonPath": ".status.trialCount",
     "description": "Trials made so far"},
    {"name": "Max", "type": "integer", "jsonPath": ".spec.maxTrials", "priority": 1},
    {"name": "Running", "type": "integer", "jsonPath": ".status.runningTrials"},
    {"name": "Best", "type": "number", "jsonPath": ".status.best.objective",
     "description": "The best finished trial's objective"},
    {"name": "Best-Trial", "type": "string", "jsonPath": ".status.best.name"},
    {"name": "Metric", "type": "string", "jsonPath": ".spec.objective.metric", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROP = {"title", "additionalProperties", "$defs"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[1]])
        node = {**target, **node}  # the field's own description / default win
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"unions are not structural: {branches}")
        node = {**_structural(branches[0], defs), **node}
        if "default" in node and node["default"] is None:
            del node["default"]  # "unset" is expressed by leaving the field out
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node[bound], bool):
            node["minimum" if bound == "exclusiveMinimum" else "maximum"] = node[bound]
            node[bound] = True
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP and not (key == "additionalProperties" and isinstance(value, dict)):
            continue
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs)
        elif key == "description":
            out[key] = " ".join(value.split())  # docstrings are wrapped for the source
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "properties" in out:
        out.setdefault("type", "object")
    return out


def _schema_of(model: type, mode: str = "validation") -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode=mode)
    return _structural(raw, raw.get("$defs", {}))


def _filled_defaults(node: dict[str, Any]) -> None:
    """Write every `default: {}` out in full, nested defaults included.

    The API server checks each default against the CEL rules of its object when the CRD is
    applied, and does so on the default as written, before any nested default applies:
    a rule reading `self.offload` meets `{}` and fails with "no such key", so the whole CRD
    is refused. Written out, the default is what the server would store anyway."""
    for child in node.get("properties", {}).values():
        _filled_defaults(child)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _filled_defaults(node[key])
    if node.get("type") == "object" and node.get("default") == {}:
        node["default"] = {name: child["default"]
                           for name, child in node.get("properties", {}).items()
                           if "default" in child}


def _locate(schema: dict[str, Any], scope: str) -> dict[str, Any]:
    node = schema
    for part in filter(None, scope.split(".")):
        name, each = (part[:-3], True) if part.endswith("[*]") else (part, False)
        node = node["properties"][name]
        if each:
            node = node["items"]
    return node


def _attach(schema: dict[str, Any], rules: list[CelRule]) -> None:
    for cel in rules:
        entry: dict[str, Any] = {"rule": cel.rule, "message": cel.message}
        if cel.field_path:
            entry["fieldPath"] = cel.field_path
        _locate(schema, cel.scope).setdefault("x-kubernetes-validations", []).append(entry)


def _root(description: str, spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    status.pop("required", None)
    return {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def _job_spec_schema() -> dict[str, Any]:
    spec = _schema_of(api.FineTuneJobSpec)
    spec["description"] = (api.FineTuneJobSpec.__doc__ or "").strip()
    return spec


def openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of FineTuneJob."""
    root = _root((api.FineTuneJob.__doc__ or "").strip(), _job_spec_schema(),
                 _schema_of(api.FineTuneJobStatus, mode="serialization"))
    _attach(root, all_cel_rules())
    _filled_defaults(root)
    return root


def sweep_openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of FineTuneSweep: its template is a FineTuneJob's
    spec, checked by the same rules (those about the spec, moved under the template)."""
    spec = _schema_of(api.FineTuneSweepSpec)
    spec["description"] = (api.FineTuneSweepSpec.__doc__ or "").strip()
    template_doc = spec["properties"]["template"].get("description")
    spec["properties"]["template"] = {**_job_spec_schema(), "description": template_doc}
    root = _root((api.FineTuneSweep.__doc__ or "").strip(), spec,
                 _schema_of(api.FineTuneSweepStatus, mode="serialization"))
    root["properties"]["status"]["properties"]["trials"].update(
        {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["number"]})
    _attach(root, [replace(c, scope="spec.template" + c.scope[len("spec"):],
                           message=in_sweep_template(c.message))
                   for c in all_cel_rules() if c.scope.split(".")[0] == "spec"])
    _attach(root, [CelRule("", f"self.metadata.name.size() <= {api.MAX_SWEEP_NAME_LENGTH}",
                           f"metadata.name: too long — a sweep's name takes at most "
                           f"{api.MAX_SWEEP_NAME_LENGTH} characters (its trials are named "
                           "<sweep>-<n>, and a FineTuneJob's name at most "
                           f"{api.MAX_NAME_LENGTH})")])
    _filled_defaults(root)
    return root


def _definition(kind: str, plural: str, singular: str, short_names: list[str],
                columns: list[dict[str, Any]], schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{api.API_GROUP}",
            "labels": {"app.kubernetes.io/name": "finetune-operator",
                       "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": api.API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": short_names,
                "categories": ["finetune", "ml"],
            },
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": schema},
            }],
        },
    }


def crd() -> dict[str, Any]:
    """The FineTuneJob CustomResourceDefinition."""
    return _definition(api.KIND, api.PLURAL, api.SINGULAR, api.SHORT_NAMES, PRINTER_COLUMNS,
                       openapi_schema())


def sweep_crd() -> dict[str, Any]:
    """The FineTuneSweep CustomResourceDefinition."""
    return _definition(api.SWEEP_KIND, api.SWEEP_PLURAL, api.SWEEP_SINGULAR,
                       api.SWEEP_SHORT_NAMES, SWEEP_PRINTER_COLUMNS, sweep_openapi_schema())


def drift(ours: dict[str, Any], served: dict[str, Any]) -> str | None:
    """How the CRD the API server serves differs from `ours` (None: it does not). Helm
    installs a chart's CRDs once and never upgrades them: an operator upgraded without them
    reads fields the API server refuses, or prunes from objects written unvalidated."""
    version = next((v for v in (served.get("spec") or {}).get("versions") or []
                    if v.get("name") == api.VERSION), None)
    if version is None:
        return f"serves no version {api.VERSION}"
    mine, theirs = ours["spec"]["versions"][0]["schema"], version.get("schema") or {}
    if mine == theirs:
        return None
    missing = sorted(set(_fields(mine)) - set(_fields(theirs)))
    unknown = sorted(set(_fields(theirs)) - set(_fields(mine)))
    said = [f"{label} {_listed(fields)}" for label, fields in (
        ("lacks", missing), ("has fields this operator does not know:", unknown)) if fields]
    return "; ".join(said) or "differs in its validation rules or descriptions"


def _listed(fields: list[str], shown: int = 5) -> str:
    more = f" and {len(fields) - shown} more" if len(fields) > shown else ""
    return ", ".join(fields[:shown]) + more


def _fields(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Every property's path in a CRD schema (`spec.strategy.type`, `spec.x[].y`)."""
    node = schema.get("openAPIV3Schema", schema)
    found = []
    for name, sub in (node.get("properties") or {}).items():
        found += [f"{prefix}{name}", *_fields(sub, f"{prefix}{name}.")]
    if isinstance(node.get("items"), dict):
        found += _fields(node["items"], f"{prefix.rstrip('.')}[].")
    return found


HEADER = "# Generated by `make crds` from finetune_operator/api.py. Do not edit by hand.\n"


def render_yaml(definition: dict[str, Any] | None = None) -> str:
    return HEADER + yamlio.dump(definition or crd())


def generated_files() -> dict[Path, str]:
    """Every file `make crds` writes, with its content."""
    files = {path: render_yaml() for path in CRD_PATHS}
    files.update({path: render_yaml(sweep_crd()) for path in SWEEP_CRD_PATHS})
    files[API_REFERENCE] = apidoc.render_markdown(
        (api.KIND, api.SHORT_NAMES[0], openapi_schema()),
        (api.SWEEP_KIND, api.SWEEP_SHORT_NAMES[0], sweep_openapi_schema()))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="write the CRD files and the API reference in the repo")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the committed files are out of date")
    args = parser.parse_args(argv)
    files = generated_files()
    if args.check:
        stale = [str(p) for p, text in files.items() if not p.exists() or p.read_text() != text]
        for path in stale:
            print(f"{path} is out of date: run `make crds`", file=sys.stderr)
        return 1 if stale else 0
    if args.write:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {os.path.relpath(path)}")
        return 0
    sys.stdout.write(render_yaml() + "---\n" + yamlio.dump(sweep_crd()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
