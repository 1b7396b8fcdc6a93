"""docs/getting-started/local.md (#58, item 1): the task its title promises, your data to an
adapter that answers, in at most ten numbered steps that run as written. What `finetune run`
does around the training lives in docs/reference/local-runs.md, not here."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support import waits

PAGE = REPO / "docs" / "getting-started" / "local.md"
TASK = ("finetune_trainer.tiny", "finetune validate", "finetune plan", "finetune run",
        "finetune status", "finetune_trainer.generate")
"""The commands of the task, in the order a newcomer types them."""
INSTALL = ("make venv", "source ")
"""Step 1's lines that the test's own venv stands for."""


def steps() -> list[tuple[int, str, str]]:
    """(number, title, body) of each `## N. title` section."""
    parts = re.split(r"^## (\d+)\. (.+)$", PAGE.read_text(), flags=re.M)[1:]
    return [(int(parts[i]), parts[i + 1], parts[i + 2]) for i in range(0, len(parts), 3)]


def blocks(body: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", body, flags=re.M | re.S)


def commands(body: str) -> list[str]:
    return [line for block in blocks(body, "bash") for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_page_is_at_most_ten_numbered_steps():
    numbers = [number for number, _, _ in steps()]
    assert 1 <= len(numbers) <= 10 and numbers == list(range(1, len(numbers) + 1)), numbers
    sections = re.findall(r"^## (.+)$", PAGE.read_text(), flags=re.M)
    assert len(sections) == len(numbers), "every section is a step"


def test_the_steps_go_from_data_to_an_answer_in_order():
    typed = [line for _, _, body in steps() for line in commands(body)]
    where = [next((i for i, line in enumerate(typed) if command in line), None)
             for command in TASK]
    assert None not in where, dict(zip(TASK, where, strict=True))
    assert where == sorted(where), dict(zip(TASK, where, strict=True))
    manifest_step = next(n for n, _, body in steps()
                         if any("kind: FineTuneJob" in b for b in blocks(body, "yaml")))
    validate_step = next(n for n, _, body in steps() if "finetune validate" in body)
    assert manifest_step < validate_step


def script() -> str:
    """The steps as one shell session: step 1 without the install, each manifest saved under
    the name its step gives, every command of the others."""
    lines = ["set -euo pipefail", f"cd {shlex.quote(str(REPO))}"]
    for _, _, body in steps():
        manifests = [b for b in blocks(body, "yaml") if "kind: FineTuneJob" in b]
        if manifests:
            name = re.search(r"as `([\w.-]+\.ya?ml)`", body).group(1)
            lines.append(f"cat > {name} <<'MANIFEST'\n{manifests[0]}MANIFEST")
        lines += [line for line in commands(body) if not line.startswith(INSTALL)]
    return "\n".join(lines) + "\n"


def trained_answer(question: str, data: Path) -> str:
    for line in data.read_text().splitlines():
        turns = json.loads(line)["messages"]
        for asked, answer in itertools.pairwise(turns):
            if asked["role"] == "user" and asked["content"] == question:
                return answer["content"]
    raise AssertionError(f"{question!r} is not a question of {data}")


@pytest.mark.process
def test_the_steps_run_as_written(tmp_path):
    """In a fresh home folder, with this venv standing for step 1's install: the tiny model
    is built, the manifest validates, plans, trains and reads Succeeded, and the adapter
    answers the page's question with the data's answer."""
    session = script()
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", session], env=env, capture_output=True, text=True,
                            timeout=waits.seconds_left())
    assert result.returncode == 0, session + result.stdout[-3000:] + result.stderr[-3000:]
    assert "Succeeded" in result.stdout
    shown = next(line for line in PAGE.read_text().splitlines() if line.startswith("training "))
    assert shown.split(":")[0] in result.stdout, shown  # the page's line, as the run says it
    asked = next(line for line in session.splitlines()
                 if "finetune_trainer.generate" in line and "/final" in line)
    question = shlex.split(asked.split("#")[0])[-1]
    copied = re.search(r"\bcp (\S+\.jsonl) ", PAGE.read_text()).group(1)
    assert trained_answer(question, REPO / copied) in result.stdout
