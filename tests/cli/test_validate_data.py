"""`finetune validate --data`: the model and data read as the workers read them before they
train, without a run: a data set's CI finds the wrong record, not the first hour of a job."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, minimal_job
from tests.support import waits

pytestmark = pytest.mark.process


def validate_data(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune_operator.cli", "validate", "--data",
                           *args], cwd=folder, capture_output=True, text=True,
                          timeout=waits.seconds_left())


def job(name: str, data: str, **spec) -> dict:
    manifest = minimal_job(model={"uri": "../model"}, dataset={"uri": data, "format": "chat",
                                                              "evalFraction": 0.1},
                           output={"uri": f"./out-{name}"},
                           resources={"gpusPerNode": 0, "processesPerNode": 2}, **spec)
    manifest["metadata"]["name"] = name
    return manifest


def test_a_folder_of_jobs_is_read_and_the_wrong_record_named(tiny_model_dir, tmp_path):
    """Two jobs, relative paths from their folder: the good one's records counted, the
    other's broken line named by file and line and the job not called valid (exit 2);
    nothing written (no output folder); a claim cannot be read here, and says so."""
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    shutil.copy(REPO / "examples/data/tiny-chat.jsonl", tmp_path / "chat.jsonl")
    lines = (REPO / "examples/data/tiny-chat.jsonl").read_text().splitlines()
    (tmp_path / "broken.jsonl").write_text("\n".join([*lines[:3], lines[3][:-7], *lines[4:]]))
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "good.yaml").write_text(yaml.safe_dump(job("good", "../chat.jsonl")))
    (jobs / "broken.yaml").write_text(yaml.safe_dump(job("broken", "../broken.jsonl")))
    claim = job("claimed", "pvc://data/train.jsonl")
    (jobs / "claimed.yaml").write_text(yaml.safe_dump(claim))

    text = validate_data(tmp_path, "jobs")
    assert text.returncode == 2, text.stdout + text.stderr
    broken = f"jobs/broken.yaml: {tmp_path / 'broken.jsonl'}:4: is not valid JSON"
    assert [line for line in text.stderr.splitlines() if line.startswith(broken)], text.stderr
    assert "jobs/broken.yaml: valid" not in text.stdout
    assert ("jobs/good.yaml: data: 57 training records (1 sequence), 7 eval records "
            "(1 sequence); model and data look usable") in text.stdout.splitlines(), text.stdout
    assert ("jobs/claimed.yaml: warning: spec.dataset.uri: pvc:// locations exist only on "
            "the cluster — --data reads what this machine can open") in text.stderr
    assert "jobs/claimed.yaml: valid" in text.stdout
    assert not list(tmp_path.glob("out-*"))

    as_json = json.loads(validate_data(tmp_path, "-o", "json", "jobs/good.yaml",
                                       "jobs/broken.yaml").stdout)
    assert as_json["valid"] is False
    assert [(j["name"], j["data"]) for j in as_json["jobs"]] == [
        ("good", ["57 training records (1 sequence), 7 eval records (1 sequence); model and "
                  "data look usable"])]
    (problem,) = [p for p in as_json["problems"] if p["severity"] == "error"]
    assert (problem["source"], problem["field"], problem["severity"]) == (
        "jobs/broken.yaml", f"{tmp_path / 'broken.jsonl'}:4", "error")
    assert problem["message"].startswith("is not valid JSON"), problem


def test_a_sweep_says_its_template_data_was_not_read():
    """A sweep's trials read its template's model and data on the cluster: --data says it
    did not read them (a line, not silence), and the sweep stays valid."""
    text = validate_data(REPO, "examples/07-sweep-lora-lr.yaml")
    assert text.returncode == 0, text.stderr
    assert text.stderr.splitlines() == [
        "examples/07-sweep-lora-lr.yaml: warning: --data: not read: --data reads "
        "FineTuneJobs, and a sweep's trials read spec.template's model and data on the "
        "cluster — their workers check them when each trial starts; to read them here, "
        "validate --data a FineTuneJob whose spec is the template"]
    assert "examples/07-sweep-lora-lr.yaml: valid FineTuneSweep" in text.stdout
