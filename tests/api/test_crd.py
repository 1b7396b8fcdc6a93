"""The CRD is generated from the API models, committed, structural and valid Kubernetes."""

from __future__ import annotations

import kubernetes_validate
import pytest

from finetune_operator import crd
from tests.conftest import REPO, load_yaml
from tests.support.crd_schema import openapi

KUBERNETES_VERSIONS = ["1.30", "1.37"]  # oldest we support, newest the validator knows


def test_committed_crds_and_reference_match_generation():
    for path, text in crd.generated_files().items():
        assert path.read_text() == text, f"{path} is stale: run `make crds`"


def test_check_mode_reports_stale_files(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "crd.yaml"
    stale.write_text("old")
    monkeypatch.setattr(crd, "CRD_PATHS", (stale,))
    monkeypatch.setattr(crd, "SWEEP_CRD_PATHS", (tmp_path / "sweep-crd.yaml",))
    monkeypatch.setattr(crd, "API_REFERENCE", tmp_path / "api.md")
    assert crd.main(["--check"]) == 1
    assert "run `make crds`" in capsys.readouterr().err
    assert crd.main(["--write"]) == 0
    assert crd.main(["--check"]) == 0
    reference = (tmp_path / "api.md").read_text()
    assert "## FineTuneJob\n" in reference and "## FineTuneSweep\n" in reference



@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_crd_is_a_valid_kubernetes_object(version, committed_crd):
    kubernetes_validate.validate(committed_crd, version, strict=True)


def _walk(node, path="$"):
    yield path, node
    for key in ("properties",):
        for name, child in node.get(key, {}).items():
            yield from _walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _walk(node[key], f"{path}.{key}")


def test_schema_is_structural(committed_crd):
    root = committed_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert "$ref" not in node and "$defs" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            continue
        assert "anyOf" not in node and "oneOf" not in node, path
        assert "type" in node, f"{path} has no type"


def test_every_field_is_documented(committed_crd):
    """`kubectl explain ftj.spec.<anything>` has something to say."""
    props = committed_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    for root in ("spec", "status"):
        assert [path for path, node in _walk(props[root], root) if "description" not in node] == []


def test_crd_names_and_columns(committed_crd):
    spec = committed_crd["spec"]
    assert spec["group"] == "finetune.dev"
    assert spec["names"]["plural"] == "finetunejobs"
    assert spec["names"]["shortNames"] == ["ftj"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for wanted in ("Phase", "Backend", "Nodes", "GPUs", "Step", "Loss", "Age"):
        assert wanted in columns
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "conditions"]
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_defaults_and_enums_reach_the_crd(committed_crd):
    props = committed_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"]["properties"]
    assert props["backend"]["default"] == "kubernetes"
    assert props["method"]["properties"]["type"]["enum"] == ["lora", "qlora", "full"]
    assert props["method"]["default"] == {"type": "lora"}  # written out in full, see below
    assert props["strategy"]["default"]["offload"] == "none"
    assert "default" not in props["hyperparameters"]  # required: epochs or maxSteps has no default
    assert "hyperparameters" in committed_crd["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]["properties"]["spec"]["required"]
    assert props["strategy"]["properties"]["precision"]["default"] == "bf16"
    assert props["resources"]["properties"]["nodes"]["minimum"] == 1


@pytest.mark.parametrize("name", ["finetunejobs.finetune.dev.yaml",
                                  "finetunesweeps.finetune.dev.yaml"])
def test_chart_ships_the_same_crds(name):
    assert (REPO / "charts/finetune-operator/crds" / name).read_text() == (
        REPO / "crds" / name).read_text()
    assert load_yaml(REPO / "charts/finetune-operator/Chart.yaml")["name"] == "finetune-operator"


def _with_defaults(node):
    """(schema node, its default) for every default in the schema."""
    if "default" in node:
        yield node, node["default"]
    for child in node.get("properties", {}).values():
        yield from _with_defaults(child)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _with_defaults(node[key])


def test_every_default_passes_the_rules_of_its_object(committed_crd):
    """What the API server checks when the CRD is applied, before any nested default applies:
    a rule reading a field the default lacks fails there ("no such key"), and the whole CRD
    is refused (tests/install/test_install.py applies it to a real one)."""
    import celpy

    env = celpy.Environment()
    checked = 0
    for node, default in _with_defaults(openapi(committed_crd)):
        for rule in node.get("x-kubernetes-validations", []):
            program = env.program(env.compile(rule["rule"]))
            result = program.evaluate({"self": celpy.json_to_cel(default)})
            assert result is True or result == celpy.celtypes.BoolType(True), (
                f"{rule['rule']!r} on the default {default}: {result!r}")
            checked += 1
    assert checked >= 4  # method, strategy (3), resources ...


def test_drift_says_which_fields_a_served_crd_lacks_or_adds():
    """What the operator says at start of a CRD that Helm left as it was (never upgraded)."""
    import copy

    ours = crd.crd()
    assert crd.drift(ours, copy.deepcopy(ours)) is None
    served = copy.deepcopy(ours)
    spec = served["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    del spec["properties"]["strategy"]["properties"]["fusedLoss"]
    spec["properties"]["legacy"] = {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}}}}
    assert crd.drift(ours, served) == (
        "lacks spec.strategy.fusedLoss; has fields this operator does not know: "
        "spec.legacy, spec.legacy[].name")
    del spec["properties"]["legacy"], spec["properties"]["strategy"]
    said = crd.drift(ours, served)  # a whole section: its first five paths, and a count
    assert said.startswith("lacks spec.strategy, spec.strategy.") and said.count(", ") == 4
    assert said.endswith(" more")
    reworded = copy.deepcopy(ours)
    reworded["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] = "older"
    assert crd.drift(ours, reworded) == "differs in its validation rules or descriptions"
    other = copy.deepcopy(ours)
    other["spec"]["versions"][0]["name"] = "v1beta1"
    assert crd.drift(ours, other) == "serves no version v1alpha1"
