"""The docs site (#51): mkdocs builds it strict (a broken link, a missing anchor or a page
left out of the nav fails), and the README stays a front page that points into it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.support import waits

MKDOCS = Path(sys.executable).parent / "mkdocs"


@pytest.mark.process
def test_the_site_builds_strict(tmp_path):
    """`make docs` as CI runs it: every warning (a link to nothing, an anchor that is not
    there, a page not in the nav) fails the build."""
    built = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=REPO, capture_output=True, text=True, timeout=waits.seconds_left())
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert (tmp_path / "troubleshooting" / "index.html").is_file()
    assert (tmp_path / "getting-started" / "aks" / "index.html").is_file()


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def entries(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from (entries(value) if isinstance(value, list) else [value])

    listed = set(entries(config["nav"]))
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert listed == pages


def test_the_readme_is_a_front_page_that_links_into_the_site():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 220  # the rest lives in docs/
    linked = set(re.findall(r"\]\((docs/[^)#]+)", text))
    for page in ("docs/getting-started/local.md", "docs/getting-started/aks.md",
                 "docs/troubleshooting.md", "docs/api-reference.md"):
        assert page in linked, page
