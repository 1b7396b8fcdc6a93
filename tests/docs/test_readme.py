"""The README's first screens (#58, items 2 and 7): "First two commands" shows two, and its
inline manifest trains on CPUs in the precision example 01, which `make demo` runs, uses."""

from __future__ import annotations

import re

import yaml

from finetune_operator.validation import parse_job
from tests.conftest import REPO

README = (REPO / "README.md").read_text()
EXAMPLE_01 = REPO / "examples" / "01-tiny-cpu-lora.yaml"


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def test_the_first_two_commands_are_two():
    text = section("First two commands")
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    typed = [line.split("#")[0].strip() for line in block.splitlines() if line[:1].strip()]
    assert typed == ["make demo", "make test"]
    assert "make test-quick" in text.split("```")[-1]  # said apart, after the block


def test_the_inline_manifest_trains_on_cpus_as_example_01_does():
    manifest = next(yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", README,
                                                                  flags=re.S)
                    if "kind: FineTuneJob" in block)
    inline, example = parse_job(manifest), parse_job(yaml.safe_load(EXAMPLE_01.read_text()))
    assert inline.spec.resources.gpus_per_node == example.spec.resources.gpus_per_node == 0
    assert inline.spec.strategy.precision == example.spec.strategy.precision
