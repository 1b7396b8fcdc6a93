"""Objectives as components (finetune_trainer/objectives): the registry, what the operator
reads of it, and a new objective added as docs/design/adding-an-objective.md says — its own
package and one entry point — reaching the CRD's enum, `finetune validate`'s rules and the
planner without a line changed elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from finetune_trainer import objectives
from finetune_trainer.config import MethodConfig, ObjectiveConfig
from tests.support import plugins


def test_sft_dpo_and_grpo_are_registered_with_what_the_operator_reads():
    known = objectives.registry()
    assert list(known) == ["dpo", "grpo", "sft"]
    sft, dpo = known["sft"], known["dpo"]
    assert (sft.formats, sft.rows_per_sample, sft.settings) == (
        ("chat", "instruction", "text"), 1, None)
    assert (dpo.formats, dpo.rows_per_sample) == (("preference",), 2)
    def job(method: str, **dpo) -> SimpleNamespace:  # what a spec and a config both have
        return SimpleNamespace(method=MethodConfig(type=method),
                               objective=ObjectiveConfig(type="dpo", dpo=dpo or None))

    assert dpo.runs_reference_each_batch(job("lora")) and dpo.runs_reference_each_batch(
        job("qlora"))
    assert not dpo.runs_reference_each_batch(job("full"))
    assert not dpo.runs_reference_each_batch(job("lora", precomputeRefLogProbs=True))
    assert objectives.trains_on("preference") == ["dpo"]
    grpo = known["grpo"]
    assert (grpo.formats, grpo.rows_per_sample) == (("prompt",), 1)
    assert objectives.trains_on("prompt") == ["grpo"]


def test_an_unknown_objective_is_refused_naming_the_field_and_the_known_ones():
    with pytest.raises(ValueError, match=r"spec.objective.type 'ppo' is no objective of this "
                       r"trainer: use one of dpo, grpo, sft"):
        objectives.spec_of("ppo")


def test_the_objective_section_is_built_from_the_registry():
    schema = ObjectiveConfig.model_json_schema(by_alias=True)
    assert schema["properties"]["type"]["enum"] == ["dpo", "grpo", "sft"]
    assert set(schema["properties"]) == {"type", "dpo", "grpo"}  # sft has no settings
    assert ObjectiveConfig().settings() is None
    chosen = ObjectiveConfig.model_validate({"type": "dpo", "dpo": {"beta": 0.3}})
    assert chosen.settings().beta == 0.3
    assert ObjectiveConfig.model_validate({"type": "dpo"}).settings().beta == 0.1  # defaults


PLUGIN = '''
"""An objective of a user's own: trains on text, a sample a row, one setting."""
from finetune_trainer.api_model import ApiModel
from finetune_trainer.objectives import ObjectiveSpec, SettingsRule


class EchoConfig(ApiModel):
    """Echo's settings."""

    weight: float = 1.0
    """How much it counts."""


SPEC = ObjectiveSpec(
    name="echo", formats=("text",), rows_per_sample=3, about="a test's own objective.",
    runtime="echo_objective.trainer:EchoObjective", settings=EchoConfig,
    rules=(SettingsRule("echo.weight", "!has(self.echo) || self.echo.weight > 0.0",
                        lambda o: o.echo is None or o.echo.weight > 0, "must be positive",
                        "set weight above 0"),))
'''

CHECK = '''
import json
from finetune_operator import crd
from finetune_operator.planner.plan import setup_for
from finetune_operator.validation import check_document
from tests.conftest import minimal_job

spec = crd.openapi_schema()["properties"]["spec"]
objective = spec["properties"]["objective"]
doc = minimal_job()
doc["spec"]["objective"] = {"type": "echo", "echo": {"weight": -1}}
doc["spec"]["dataset"]["format"] = "chat"
job, problems = check_document(doc)
doc["spec"]["objective"]["echo"]["weight"] = 2
doc["spec"]["dataset"]["format"] = "text"
job, none = check_document(doc)
print(json.dumps({
    "enum": objective["properties"]["type"]["enum"],
    "sections": sorted(objective["properties"]),
    "cel": [r["rule"] for r in spec["x-kubernetes-validations"] + objective.get(
        "x-kubernetes-validations", []) if "echo" in r["rule"]],
    "problems": sorted(f"{p.path}: {p.message}" for p in problems),
    "accepted": [str(p) for p in none if p.severity == "error"],
    "seq_len": setup_for(job, "ddp").seq_len,
    "max_seq_length": job.spec.dataset.max_seq_length}))
'''


@pytest.mark.process
def test_a_new_objective_is_its_package_and_one_entry_point(tmp_path):
    """Installed as a user installs one (a distribution declaring the entry point), it is
    in the CRD's enum with its settings section and rules, `finetune validate` applies its
    formats and rules, and the planner sizes its rows: nothing else was edited."""
    plugins.install(tmp_path, "echo_objective", PLUGIN, objectives.ENTRY_POINT_GROUP,
                    "echo = echo_objective:SPEC")
    from tests.conftest import REPO

    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"},
                            timeout=300)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["enum"] == ["dpo", "echo", "grpo", "sft"]
    assert seen["sections"] == ["dpo", "echo", "grpo", "type"]
    assert seen["cel"] == [
        "self.objective.type != 'echo' || self.dataset.format in ['auto', 'text']",
        "!has(self.echo) || self.type == 'echo'",
        "!has(self.echo) || self.echo.weight > 0.0"]
    assert any(p.startswith("spec.dataset.format: is chat, and objective echo trains on text "
                            "data") for p in seen["problems"]), seen["problems"]
    assert "spec.objective.echo.weight: must be positive" in seen["problems"]
    assert seen["accepted"] == []
    assert seen["seq_len"] == 3 * seen["max_seq_length"]
