"""`make venv` as the Makefile's comment and docs/design/development.md describe it (#58,
item 5): torch from PyPI (its CUDA build) unless TORCH_INDEX_URL names another index, and
the same torch kept by DeepSpeed's and the extras' installs, the CPU build's `+cpu` too."""

from __future__ import annotations

import re
import subprocess

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.conftest import REPO
from tests.support import waits

TORCH = re.search(r"^TORCH_VERSION \?= (\S+)$", (REPO / "Makefile").read_text(),
                  flags=re.M).group(1)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.mark.process
@pytest.mark.parametrize("index", ["", CPU_INDEX])
def test_torch_comes_from_the_index_asked_and_the_later_installs_keep_it(tmp_path, index):
    printed = subprocess.run(["make", "-n", "venv", f"VENV={tmp_path / 'venv'}",
                              f"TORCH_INDEX_URL={index}"], cwd=REPO, capture_output=True,
                             text=True, timeout=waits.seconds_left(), check=True).stdout
    installs = [line for line in printed.splitlines()
                if any(word.startswith("torch==") for word in line.split())]
    torch, *later = installs
    assert f"torch=={TORCH}" in torch.split()
    assert ("--index-url" in torch.split()) == bool(index)
    assert index in torch
    assert len(later) == 2  # deepspeed, then the project and its extras
    for line in later:
        assert f"torch=={TORCH}" in line.split() and "--index-url" not in line


def test_the_pin_accepts_the_cpu_build():
    """pip compares `torch==2.13.0` without the installed version's local label: the CPU
    index's `2.13.0+cpu` satisfies the later installs, which then leave it in place."""
    assert Version(f"{TORCH}+cpu") in SpecifierSet(f"=={TORCH}")
