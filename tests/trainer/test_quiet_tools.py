"""`python -m finetune_trainer.tiny` and `python -m finetune_trainer.generate` say only what
they are for, as a plain `finetune run` does (#58, item 3): no progress bars, library
warnings or DeepSpeed's accelerator notice unless `-v`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.support import waits

pytestmark = pytest.mark.process

CORPUS = REPO / "examples/data/tiny-chat.jsonl"


def tool(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                            timeout=waits.seconds_left(), env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny model built by the tool, and an adapter of it as a run exports one (peft
    reads its base back: the path that warned)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("quiet")
    built = tool("finetune_trainer.tiny", str(root / "tiny"), "--corpus", str(CORPUS))
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "tiny"),
                             LoraConfig(r=4, target_modules="all-linear"))
    adapter.save_pretrained(root / "final")
    AutoTokenizer.from_pretrained(root / "tiny").save_pretrained(root / "final")
    return root, built


def test_building_the_tiny_model_says_one_line(exports):
    root, built = exports
    assert built.stdout == f"built a tiny Llama and its tokenizer in {root / 'tiny'}\n"
    assert built.stderr == ""


@pytest.mark.parametrize("folder", ["tiny", "final"], ids=["full-model", "adapter"])
def test_generate_says_the_answer_alone(exports, folder):
    answered = tool("finetune_trainer.generate", str(exports[0] / folder), "What is FSDP?",
                    "--max-new-tokens", "4")
    assert answered.stderr == ""
    assert len(answered.stdout.splitlines()) == 1 and answered.stdout.strip(), answered.stdout


def test_verbose_shows_what_the_libraries_say(exports, tmp_path):
    built = tool("finetune_trainer.tiny", str(tmp_path / "tiny"), "--corpus", str(CORPUS), "-v")
    assert "Writing model shards" in built.stderr, built.stderr
    answered = tool("finetune_trainer.generate", str(exports[0] / "final"), "What is FSDP?",
                    "--max-new-tokens", "4", "--verbose")
    assert "Loading weights" in answered.stderr, answered.stderr
