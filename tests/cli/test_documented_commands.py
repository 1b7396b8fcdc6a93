"""Every `finetune` command the README, the docs site's pages and the examples' headers show,
run as typed where it can run here (#19, item 7; #51: the getting-started pages too): a
documented command that stops working fails this test.
Also the documented outputs that are copied from the code: `finetune plan`'s sample and
`kubectl get ftj`'s columns. `finetune operator` runs in the scenario tests; commands with
placeholders (FILE, T, N) are the synopsis, not examples."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from finetune_trainer import layout
from tests.conftest import EXAMPLES, REPO
from tests.support import waits

README = REPO / "README.md"
PAGES = sorted((REPO / "docs").rglob("*.md"))
"""The docs site's pages (mkdocs.yml): getting started, guides, references, design."""
PLAN_SAMPLE = REPO / "docs" / "guides" / "planning.md"
GENERIC_MANIFEST = "examples/02-aks-fsdp-full-8b.yaml"
"""What the README's `job.yaml` stands for: a cluster manifest (an Azure ML one for
`--backend azureml`, which needs an azureml: section)."""
NOT_RUN_HERE = {
    "operator": "runs in the scenario tests",
    "export": "pushes to a registry: tests/trainer/test_export.py runs it against a real one",
}
RUNNABLE = "examples/01-tiny-cpu-lora.yaml"
"""The one manifest `finetune run` takes here (its model: what `make demo` builds)."""
ON_THE_DEMO_MODEL = {f"examples/{p.name}" for p in EXAMPLES
                     if layout.DEMO_MODEL in p.read_text()}
"""The examples that train the tiny model `make demo` builds (01, 08)."""
PLACEHOLDERS = re.compile(r"\b(FILE|NAME|T|N)\b|\[")


def fenced_lines(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if inside:
            lines.append(line)
    return lines


def documented() -> list[tuple[str, str]]:
    """(where, command) for every `finetune ...` line shown to users."""
    # the CLI reference is `--help` itself: its synopsis lines are not commands to type
    found = [(str(doc.relative_to(REPO)), line) for doc in [README, *PAGES]
             if doc.name != "cli-reference.md" for line in fenced_lines(doc.read_text())]
    for example in EXAMPLES:
        found += [(example.name, line.lstrip("# ")) for line in example.read_text().splitlines()
                  if line.startswith("#   ")]
    commands, seen = [], set()
    for where, line in found:
        command = line.split("  #")[0].split(" > ")[0].strip()
        typed = " ".join(command.split())  # the same command aligned differently runs once
        if command.startswith("finetune ") and not PLACEHOLDERS.search(command) and (
                typed not in seen):
            seen.add(typed)
            commands.append((where, command))
    return commands


COMMANDS = documented()


def test_the_docs_show_commands_to_run():
    shown = {c.split()[1] for _, c in COMMANDS}
    assert {"validate", "render", "plan", "run"} <= shown


@pytest.mark.process
@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_a_documented_command_works(where, command):
    words = shlex.split(command)
    if words[1] in NOT_RUN_HERE:
        pytest.skip(f"`finetune {words[1]}` {NOT_RUN_HERE[words[1]]}")
    if words[1] == "run" and RUNNABLE not in words:
        pytest.skip("a run of a manifest the docs do not ship")
    # validate and run refuse these examples' model path until `make demo` built it
    built = (REPO / layout.DEMO_MODEL / "config.json").exists()
    if set(words) & ON_THE_DEMO_MODEL and not built:
        subprocess.run([sys.executable, "-m", "finetune_trainer.tiny", layout.DEMO_MODEL,
                        "--corpus", "examples/data/tiny-chat.jsonl"],
                       cwd=REPO, check=True, capture_output=True, timeout=waits.seconds_left())
    if "job.yaml" in words:
        azure = "--backend" in words and words[words.index("--backend") + 1] == "azureml"
        # status and logs of a manifest read its `finetune run` output: a local one's
        words[words.index("job.yaml")] = (
            "examples/04-azureml-zero3.yaml" if azure else RUNNABLE
            if words[1] in ("status", "logs") else GENERIC_MANIFEST)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "finetune_operator.cli", *words[1:]],
                            cwd=REPO, capture_output=True, text=True, env=env,
                            timeout=waits.seconds_left())
    worked = (0, 1) if words[1] == "plan" else (0,)  # plan: 1 = "does not fit", an answer
    assert result.returncode in worked, f"{where}: {command}\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr
    assert "experimental field" not in result.stderr  # the Azure ML SDK's noise (#19, item 9)


@pytest.mark.process
def test_the_plan_sample_is_what_finetune_plan_prints():
    text = PLAN_SAMPLE.read_text()
    start = text.index("ml-team/llama-8b-full: full, fsdp")
    sample = text[start:text.index("```", start)].splitlines()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    printed = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "plan",
                              GENERIC_MANIFEST], cwd=REPO, capture_output=True, text=True,
                             env=env, timeout=waits.seconds_left()).stdout.splitlines()
    for line in sample:
        shown = re.sub(r"(, )?\.\.\.\)?$", "", line)  # the sample cuts long lines with ...
        assert any(p.startswith(shown) for p in printed), (line, printed)


def test_the_documented_columns_are_the_crds():
    crd = yaml.safe_load((REPO / "crds/finetunejobs.finetune.dev.yaml").read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    line = next(line for doc in [README, *PAGES] for line in doc.read_text().splitlines()
                if line.startswith("kubectl get ftj ") and "(-o wide: +" in line)
    default, wide = line.split("#", 1)[1].removesuffix(")").split("(-o wide: +")
    assert default.split() == [c["name"].upper() for c in columns if not c.get("priority")]
    assert wide.split() == [c["name"].upper() for c in columns if c.get("priority")]


def test_docs_link_only_to_files_in_the_repository():
    for doc in [README, *PAGES]:
        prose = re.sub(r"`[^`\n]*`", "", doc.read_text())  # code spans (a field's pattern)
        for target in re.findall(r"\]\(([^)#]+)", prose):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            assert (doc.parent / target).resolve().is_relative_to(REPO), (doc.name, target)
            assert (doc.parent / target).exists(), (doc.name, target)
        assert "../shared/" not in doc.read_text(), doc.name
