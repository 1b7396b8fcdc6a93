"""The project's own generator of FineTuneJob manifests: the examples, mutated.

`manifests(seed, count)` yields reproducible manifests (YAML text), each one of the
FineTuneJobs under examples/ with one to four mutations: a location of another scheme
(or of none), another backend (with or without its section), a field of the API set to a
value of its own kind (an enum member, a small number) or of a wrong one (huge numbers,
NaN, odd strings, lists, mappings), a field dropped, an unknown key, reserved
environment variables, Kubernetes Secrets on Azure ML. Most of them stay valid YAML and
many stay valid manifests, so `validate`, `render` and `plan` all get to work on them.

Used by tests/api/test_manifest_agreement.py (a bounded count in `make test`) and by
tests/support/fuzz_manifests.py (thousands, outside the suite).
"""

from __future__ import annotations

import copy
import math
import random
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from finetune_operator import gpu_catalog as catalog
from finetune_operator.api import KIND, FineTuneJobSpec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_FILES = sorted((REPO / "examples").rglob("*.yaml"))

GUID = "00000000-0000-0000-0000-000000000000"
AZUREML = {"subscriptionId": GUID, "resourceGroup": "rg", "workspace": "ws",
           "compute": "gpu-cluster"}

URIS = {
    "model": ["hf://Qwen/Qwen2.5-0.5B", "hf://gpt2", "hf://meta-llama/Llama-3.1-8B",
              "pvc://models/llama", "pvc://models",
              "azureml://registries/azureml/models/Llama-3.1-8B/versions/1",
              "azureml://datastores/workspaceblobstore/paths/models/llama",
              f"azureml://subscriptions/{GUID}/resourcegroups/rg/workspaces/ws/datastores/"
              "d/paths/m", "/models/llama", "./model", "../build/demo/tiny-llama"],
    "dataset": ["hf://tatsu-lab/alpaca", "pvc://data/train.jsonl", "pvc://data",
                "azureml://datastores/workspaceblobstore/paths/data/train.jsonl",
                "azureml://registries/r/data/d/versions/1", "https://example.com/d.jsonl",
                "/data/train.jsonl", "./data/tiny-chat.jsonl", "../data/x.parquet"],
    "output": ["pvc://checkpoints/run", "pvc://ckpt", "/out",
               "azureml://datastores/workspaceblobstore/paths/finetune/run",
               "azureml://datastores/workspaceblobstore/paths/",
               "azureml://registries/r/models/m", "./output", "../build/out"],
}
ODD_URIS = ["", " ", "hf://", "pvc://", "azureml://", "s3://bucket/key", "file:///x",
            "http://example.com/x", "https://", "C:\\models\\x", "~/x", "/", "./", "..",
            "hf://a/b/c", "pvc://Upper/x", "pvc://claim/with space", "hf://Qwen/Qwen\n2.5",
            "/" + "a" * 3000, "/модель", "azureml://datastores/x/paths/ y", "hf://-x/y",
            "pvc://a..b/x", "/\u2028x"]
STRINGS = ["", " ", "x", "a" * 5000, "é", "\U0001f600", "x\ny", "\t", "\u2028", "\x85",
           "\x1b[31mred", "null", "~", "yes", "0x10", "1e3", "-", "#", "*a", "&a", "{}",
           "\ud800", "auto", "none", "$(rm -rf /)"]
NUMBERS = [0, 1, -1, 2, 3, 7, 8, 16, 100, 1024, 1025, 10**6, 2**31, 2**63, 10**30, -10**30,
           0.0, 0.5, -0.5, 1.5, 1e-12, 1e308, math.inf, -math.inf, math.nan]
OTHERS = [None, True, False, [], {}, [1, 2], {"a": 1}, [[[]]], {"": None}]
GPU_TYPES = [*(v.name for v in catalog.VM_SIZES[::3]), "H100", "A100", "a100", "T4",
             "V100-32GB", "A100-80GB", "nope", "", "Standard_ND96"]
BACKENDS = ["kubernetes"] * 4 + ["azureml"] * 5 + ["slurm", "", "Kubernetes"]
ENV_NAMES = ["HF_HOME", "MASTER_ADDR", "RANK", "PET_NNODES", "WORLD_SIZE", "FOO", "1BAD",
             "", "A B", "FINETUNE_CONFIG"]


@dataclass(frozen=True)
class Generated:
    text: str
    """The manifest, YAML."""
    mutations: tuple[str, ...]
    """What was done to the example, for a report."""
    example: str


def example_jobs() -> list[tuple[str, dict[str, Any]]]:
    """(file name, job) of every FineTuneJob under examples/ (other kinds are left out)."""
    return [(path.name, doc) for path in EXAMPLE_FILES
            for doc in yaml.safe_load_all(path.read_text())
            if isinstance(doc, dict) and doc.get("kind") == KIND]


# --- the API's fields, from its pydantic models --------------------------------------------

def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model_in(arg)) is not None:
            return found
    return None


def _fields(model: type[BaseModel], prefix: tuple[str, ...] = ()
            ) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, annotation) of every field under `model`, nested models included."""
    for name, info in model.model_fields.items():
        path = (*prefix, info.alias or name)
        yield path, info.annotation
        inner = _model_in(info.annotation)
        origin = typing.get_origin(info.annotation)
        if inner is not None and origin is not list and len(prefix) < 3:
            yield from _fields(inner, path)


SPEC_FIELDS = [(("spec", *p), a) for p, a in _fields(FineTuneJobSpec)]


def _literals(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return [v for arg in typing.get_args(annotation) for v in _literals(arg)]


def _kinds(annotation: Any) -> set[type]:
    if isinstance(annotation, type) and not issubclass(annotation, BaseModel):
        return {annotation}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        return {k for arg in typing.get_args(annotation) for k in _kinds(arg)}
    return set()


def value_for(rng: random.Random, annotation: Any, path: tuple[str, ...]) -> Any:
    """A value for the field: mostly of its own kind, sometimes anything."""
    if rng.random() < 0.1:
        return rng.choice([*STRINGS, *NUMBERS, *OTHERS])
    if path[-1] == "uri" and path[-2] in URIS:
        return rng.choice(URIS[path[-2]] + ODD_URIS[: rng.randint(0, len(ODD_URIS))])
    if path[-1] == "gpuType":
        return rng.choice(GPU_TYPES)
    if literals := _literals(annotation):
        return rng.choice([*literals, *literals, rng.choice(STRINGS)])
    kinds = _kinds(annotation)
    if bool in kinds:
        return rng.choice([True, False, "true", 1])
    if int in kinds:
        return rng.choice([*range(0, 9), *NUMBERS])
    if float in kinds:
        return rng.choice([0.0, 0.05, 0.1, 0.5, 1.0, *NUMBERS])
    if str in kinds:
        return rng.choice(STRINGS)
    return rng.choice(OTHERS)


# --- mutations --------------------------------------------------------------------------

def _paths(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path in the document, leaves and inner nodes."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield (*prefix, i)
            yield from _paths(value, (*prefix, i))


def _set(doc: dict, path: tuple, value: Any) -> None:
    """Set `path` to a copy of `value`, making the mappings on the way (a scalar there
    becomes one). A copy: the pools' lists and mappings must never be shared, or a later
    mutation could put a mapping inside itself."""
    value = copy.deepcopy(value)
    node: Any = doc
    for part in path[:-1]:
        if isinstance(node, list):
            node = node[part]
            continue
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        node = node[part]
    in_list = isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node)
    if isinstance(node, dict) or in_list:
        node[path[-1]] = value


def _drop(doc: dict, path: tuple) -> None:
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]


def m_backend(rng, doc):
    spec = doc["spec"]
    spec["backend"] = rng.choice(BACKENDS)
    if spec["backend"] == "azureml" and rng.random() < 0.8:
        spec["azureml"] = dict(AZUREML)
        if rng.random() < 0.5:
            spec.pop("kubernetes", None)
    return f"backend {spec['backend']!r}"


def m_location(rng, doc):
    section = rng.choice(list(URIS))
    uri = (rng.choice(ODD_URIS + URIS["model"] + URIS["dataset"]) if rng.random() < 0.3
           else rng.choice(URIS[section]))
    _set(doc, ("spec", section, "uri"), uri)
    return f"{section}.uri {uri[:40]!r}"


def m_token_secret(rng, doc):
    ref = rng.choice([{"name": "hf-token", "key": "token"}] * 4 + [{"name": ""}, "hf-token", {}])
    _set(doc, ("spec", "model", "tokenSecretRef"), ref)
    return f"tokenSecretRef {ref!r}"


def m_azureml_section(rng, doc):
    section = dict(AZUREML)
    for key, values in (("instanceType", ["Standard_ND96amsr_A100_v4", "", "x" * 300]),
                        ("environment", ["azureml:env:1", "mcr.microsoft.com/x:1", "", "a b"]),
                        ("jobTier", ["Spot", "Basic", "Standard", "Premium", "Free"]),
                        ("shmSize", ["64Gi", "1.5Gi", "500m", "0", "1e3", 64, "1Ei"]),
                        ("experimentName", ["exp", "", "a/b", "x" * 300])):
        if rng.random() < 0.3:
            section[key] = rng.choice(values)
    if rng.random() < 0.2:
        key = rng.choice(sorted(section))
        section[key] = value_for(rng, str, ("spec", "azureml", key))
    doc["spec"]["azureml"] = section
    return f"azureml {section!r}"[:120]


def m_kubernetes_pods(rng, doc):
    k8s = doc["spec"].setdefault("kubernetes", {})
    if not isinstance(k8s, dict):
        return "kubernetes (not a mapping)"
    what = rng.choice(["env", "volumes", "nodeSelector", "tolerations", "shmSize", "image",
                       "queueName", "labels"])
    if what == "env":
        k8s["env"] = [{"name": rng.choice(ENV_NAMES), "value": rng.choice(STRINGS[:6])}
                      for _ in range(rng.randint(0, 3))]
    elif what == "volumes":
        k8s["volumes"] = [{"name": rng.choice(["data", "data", "Bad_Name"]),
                           "mountPath": rng.choice(["/data", "data", "/"]),
                           **rng.choice([{"emptyDir": {}}, {"persistentVolumeClaim":
                                         {"claimName": "c"}}, {}, {"emptyDir": {},
                                                                   "secret": {"secretName": "s"}}])}
                          for _ in range(rng.randint(0, 2))]
    elif what == "tolerations":
        k8s["tolerations"] = [{"key": "k", "operator": rng.choice(["Exists", "Equal", "In"]),
                               "effect": rng.choice(["NoSchedule", "NoExecute", None])}]
    elif what == "shmSize":
        k8s["shmSize"] = rng.choice(["16Gi", "1.5Gi", "0", "-1Gi", 10**20, "1e3", ""])
    else:
        k8s[what] = rng.choice([*STRINGS[:8], {"a": "b"}, {"a": 1}, {"": ""}])
    return f"kubernetes.{what}"


def m_field(rng, doc):
    path, annotation = rng.choice(SPEC_FIELDS)
    value = value_for(rng, annotation, path)
    _set(doc, path, value)
    return f"{'.'.join(path)} = {value!r}"[:120]


def m_drop(rng, doc):
    paths = list(_paths(doc))
    path = rng.choice(paths)
    _drop(doc, path)
    return f"drop {'.'.join(map(str, path))}"


def m_wrong_type(rng, doc):
    path = rng.choice(list(_paths(doc)))
    value = rng.choice([*STRINGS, *NUMBERS, *OTHERS])
    _set(doc, path, value)
    return f"{'.'.join(map(str, path))} = {value!r}"[:120]


def m_unknown_key(rng, doc):
    mappings = [p for p in _paths(doc) if isinstance(_get(doc, p), dict)] + [()]
    where = rng.choice(mappings)
    key = rng.choice(["extra", "", " ", "modle", "Uri", "gpus", "épique", "a.b", "0", "x" * 300])
    node = _get(doc, where)
    node[key] = copy.deepcopy(rng.choice([1, "x", None, {}]))
    return f"unknown key {key[:20]!r} at {'.'.join(map(str, where)) or '(top)'}"


def _get(doc: Any, path: tuple) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def m_name(rng, doc):
    key = rng.choice(["name", "name", "namespace"])
    value = rng.choice(["demo", "a" * 47, "a" * 48, "Demo", "1abc", "a-", "a.b", "", "x" * 300,
                        5, None, "ok-name"])
    _set(doc, ("metadata", key), value)
    return f"metadata.{key} = {value!r}"[:80]


def m_steps(rng, doc):
    hp = doc["spec"].setdefault("hyperparameters", {})
    if not isinstance(hp, dict):
        return "hyperparameters (not a mapping)"
    choice = rng.choice(["epochs", "maxSteps", "both", "neither"])
    hp.pop("epochs", None)
    hp.pop("maxSteps", None)
    if choice in ("epochs", "both"):
        hp["epochs"] = rng.choice([1, 0.5, 3, 0, 10**9, -1])
    if choice in ("maxSteps", "both"):
        hp["maxSteps"] = rng.choice([1, 10, 10**9, 2**63, 0])
    return f"steps: {choice}"


def m_scale(rng, doc):
    resources = doc["spec"].setdefault("resources", {})
    if not isinstance(resources, dict):
        return "resources (not a mapping)"
    resources["nodes"] = rng.choice([1, 2, 4, 64, 1024, 1025])
    resources["gpusPerNode"] = rng.choice([0, 1, 2, 4, 8, 16, 17])
    if rng.random() < 0.5:
        resources["gpuType"] = rng.choice(GPU_TYPES)
    if rng.random() < 0.3:
        resources["processesPerNode"] = rng.choice([1, 2, 256, 257])
    return f"resources {resources!r}"[:120]


MUTATIONS = [(m_backend, 4), (m_location, 5), (m_token_secret, 1), (m_azureml_section, 2),
             (m_kubernetes_pods, 2), (m_field, 6), (m_drop, 2), (m_wrong_type, 2),
             (m_unknown_key, 1), (m_name, 1), (m_steps, 1), (m_scale, 2)]


def mutate(rng: random.Random, doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    doc = copy.deepcopy(doc)
    done = []
    functions, weights = zip(*MUTATIONS, strict=True)
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 4])):
        if not isinstance(doc.get("spec"), dict):
            break
        done.append(rng.choices(functions, weights)[0](rng, doc))
    return doc, done


def dump(rng: random.Random, doc: Any) -> str:
    """YAML as people and tools write it: block or flow style, escaped or raw unicode."""
    return yaml.safe_dump(doc, allow_unicode=rng.random() < 0.8, sort_keys=rng.random() < 0.3,
                          default_flow_style=rng.random() < 0.15, width=rng.choice([80, 10**6]))


def manifests(seed: int, count: int) -> Iterator[Generated]:
    """`count` manifests, the same ones for the same seed."""
    rng = random.Random(seed)
    jobs = example_jobs()
    for _ in range(count):
        example, base = rng.choice(jobs)
        doc, done = mutate(rng, base)
        yield Generated(dump(rng, doc), tuple(done), example)
