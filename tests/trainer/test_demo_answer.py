"""The demo's promise (#19, item 11): example 01, fine-tuned as `make demo` runs it, gives
an adapter that answers a question it was trained on, where the base model does not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO
from tests.support import waits

pytestmark = pytest.mark.process

EXAMPLE = REPO / "examples/01-tiny-cpu-lora.yaml"
DATA = REPO / "examples/data/tiny-chat.jsonl"
QUESTION = "What is FSDP?"


def trained_answer(question: str) -> str:
    for line in DATA.read_text().splitlines():
        messages = json.loads(line)["messages"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        if users == [question]:
            return next(m["content"] for m in messages if m["role"] == "assistant")
    raise AssertionError(f"{question!r} is not in {DATA.name}")


def test_the_demo_adapter_answers_its_training_question_and_the_base_does_not(
        tiny_model_dir, tmp_path):
    """The model: the session's tiny Llama, what `make demo` builds under build/demo/ (the
    same builder, corpus and seed); the answers: `finetune_trainer.generate`'s, in this
    process (the command's own output is tests/trainer/test_quiet_tools.py's)."""
    from finetune_trainer.generate import answer

    job = yaml.safe_load(EXAMPLE.read_text())  # the example's settings, its paths here
    job["spec"]["model"]["uri"] = str(tiny_model_dir)
    job["spec"]["dataset"]["uri"] = str(DATA)
    job["spec"]["output"]["uri"] = str(tmp_path / "output")
    manifest = tmp_path / "01-tiny-cpu-lora.yaml"
    manifest.write_text(yaml.safe_dump(job))
    run = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "run", str(manifest)],
                         capture_output=True, text=True, timeout=waits.seconds_left())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]

    expected = trained_answer(QUESTION)
    assert answer(tmp_path / "output/final", QUESTION).strip() == expected
    assert answer(tiny_model_dir, QUESTION).strip() != expected


def test_generate_refuses_a_folder_that_is_no_export_at_once(tmp_path, capsys):
    """A typo in the folder: transformers took the path for a hub name and retried the
    network for a minute before its traceback."""
    from finetune_trainer.generate import main

    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "fnal"), "a question"])
    assert exited.value.code == 2
    assert (f"{tmp_path / 'fnal'} does not exist: name what a run exported, its final/ or "
            "merged/ folder") in capsys.readouterr().err
