"""A manifest reads as kubectl reads it: the real kubectl (`kubectl label --local -o json`,
no cluster needed) is the oracle for every scalar and key below, and for the files of a
folder and the items of a list. PyYAML alone reads YAML
1.1, where `learningRate: 1e-4` is the string '1e-4' (refused by `finetune validate`,
taken by `kubectl apply`) and `1:30` is the number 90."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from finetune_operator.manifests import json_key, load_yaml
from tests.conftest import REPO, minimal_job

pytestmark = pytest.mark.process

VALUES = [
    "1e-4", "2E-5", "1e4", "1e+4", "1.0e4", "1.5e-3", "-1e-3", "+1e-3", ".5", "+.5", "-.5",
    ".5e3", "0.", "1.", "1_000", "1_000.5", "0x1F", "-0x1F", "0x_1F", "0X1f", "012", "09",
    "0o17", "0b101", "-0b101", "00", "0", "-0", "+0", "+7", "99999999999999999999", "1e-400",
    "1e400", "1e1_0", "0.1_5", "12e", "1e", "1.2.3", "._5", "1_", "_1", "0o8", "08.5", "1__0",
    "y", "Y", "n", "N", "yes", "Yes", "YES", "no", "True", "TRUE", "tRUE", "on", "off", "Off",
    "null", "Null", "NULL", "~", "2026-01-02", "2026-01-02T10:00:00Z", "1:30", "1:30:00", "=",
    "v1", "1.0.0-rc1",
]
"""Numbers as go-yaml v2 reads them and YAML 1.1 does not (or reads otherwise), booleans of
one letter, dates and sexagesimals that stay text, and text that looks like a number."""

KEYS = [
    "1e3", "1.5", "y", "n", "on", "0x10", "2026-01-02", "1e-7", "1:30",
    "100000000000000000000", "1e21", "0.1", "1234567.0", "3.14159265358979", "-2.5e-5", "0o17",
    "012", "09", "100.25", "-0", "1e39", "0.00012", ".5e3", "+7", "true", "1e-45", "0.3",
]
"""Keys that YAML reads as other than text, named as sigs.k8s.io/yaml names them for JSON
(`n` and `-0` among them: one key to a Python dict, two to kubectl)."""


def read_both(kubectl_cli, path, lines: list[str]) -> tuple[dict, dict]:
    """`spec` as kubectl reads it (`label --local`: no cluster) and as our loader does."""
    path.write_text("apiVersion: v1\nkind: Probe\nmetadata: {name: x}\nspec:\n"
                    + "\n".join(lines) + "\n")
    done = subprocess.run([str(kubectl_cli), "label", "--local", "-f", str(path), "read=yes",
                           "-o", "json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (ours,) = load_yaml(path.read_text())
    return json.loads(done.stdout)["spec"], ours["spec"]


def test_scalars_read_as_kubectl_reads_them(kubectl_cli, tmp_path):
    theirs, ours = read_both(kubectl_cli, tmp_path / "scalars.yaml",
                             [f"  k{i:02d}: {value}" for i, value in enumerate(VALUES)])
    # JSON is how kubectl hands a manifest on: 1e4 and 10000 are one number there
    differ = {VALUES[int(key[1:])]: (theirs[key], ours[key]) for key in theirs
              if json.dumps(theirs[key]) != json.dumps(ours[key]) and theirs[key] != ours[key]}
    assert differ == {}, differ
    said = dict(zip(VALUES, ours.values(), strict=True))
    assert said["1e-4"] == 1e-4 and said["1:30"] == "1:30"  # the point of it


def test_keys_are_named_as_kubectl_names_them(kubectl_cli, tmp_path):
    theirs, ours = read_both(kubectl_cli, tmp_path / "keys.yaml",
                             [f"  {key}: v{i:02d}" for i, key in enumerate(KEYS)])
    assert ours == theirs
    assert json_key(float("inf")) == ".inf" and json_key(-1e-7) == "-1e-07"


def test_a_key_kubectl_cannot_name_is_refused_with_its_line():
    for text, words in (("a: 1\n~: 2\n", "found a key that is null"),
                        ("a: 1\n? [1, 2]\n: 3\n", "found a key that is a list or a mapping")):
        with pytest.raises(Exception, match=words) as raised:
            load_yaml(text)
        assert "line 2" in str(raised.value)


def test_a_folder_and_a_list_hold_the_jobs_kubectl_apply_takes(kubectl_cli, tmp_path):
    """`kubectl apply -f FOLDER` takes the folder's .json, .yaml and .yml files (not its
    subfolders', nor `.YAML`), and a `kind: List` (what `kubectl get -o yaml` writes) as
    its items; `finetune validate` had said "cannot read: Is a directory" and skipped the
    List. A list item's problem is named by its index."""
    folder = tmp_path / "jobs"
    (folder / "sub").mkdir(parents=True)

    def job(name: str, steps: int = 10) -> dict:
        return {**minimal_job(hyperparameters={"maxSteps": steps}), "metadata": {"name": name}}

    (folder / "a.yaml").write_text(yaml.safe_dump(job("first")))
    listed = {"apiVersion": "v1", "kind": "List", "items": [job("second"), job("third")]}
    (folder / "b.yml").write_text(yaml.safe_dump(listed))
    (folder / "c.json").write_text(json.dumps(job("fourth")))
    (folder / "d.YAML").write_text(yaml.safe_dump(job("not-taken")))
    (folder / "notes.txt").write_text("not a manifest")
    (folder / "sub" / "e.yaml").write_text(yaml.safe_dump(job("nested")))
    done = subprocess.run([str(kubectl_cli), "label", "--local", "-f", str(folder), "read=yes",
                           "-o", "name"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    theirs = [line.rsplit("/", 1)[1] for line in done.stdout.split()]
    validated = validate("-o", "json", str(folder))
    assert validated.returncode == 0, validated.stderr
    assert [j["name"] for j in json.loads(validated.stdout)["jobs"]] == theirs == [
        "first", "second", "third", "fourth"]

    listed["items"][1] = job("third", steps=-1)
    (folder / "b.yml").write_text(yaml.safe_dump(listed))
    refused = validate(str(folder))
    assert refused.returncode == 2
    assert (f"{folder}/b.yml#items[1]: spec.hyperparameters.maxSteps: is -1, must be at "
            "least 1") in refused.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty}: holds no manifest" in validate(str(empty)).stderr


def validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune_operator.cli", "validate", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
