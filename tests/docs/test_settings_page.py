"""docs/reference/settings.md (#58, item 6): every `FINETUNE_*` variable on one page. The
operator's are derived from its settings model as `OperatorSettings.from_env` derives them;
the others are the names the code mentions. A setting added without its row, or a row left
for a name no code mentions any more, fails here."""

from __future__ import annotations

import re

from finetune_operator.settings import ENV_PREFIX, OperatorSettings
from tests.conftest import REPO

PAGE = REPO / "docs" / "reference" / "settings.md"
NAME = re.compile(ENV_PREFIX + r"[A-Z0-9_]*[A-Z0-9]")
CODE = ("operator", "trainer", "cluster", "scripts", "benchmarks", "tests",
        "charts/finetune-operator/templates", ".ci")
SUFFIXES = {".py", ".sh", ".yaml", ".tpl", ""}


def operator_settings() -> set[str]:
    return {ENV_PREFIX + field.upper() for field in OperatorSettings.model_fields}


def mentioned_by_code() -> set[str]:
    """The names written in the code, its tests and scripts (this folder's tests aside: they
    name what they check)."""
    names = set()
    for folder in CODE:
        for path in (REPO / folder).rglob("*"):
            if (path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts
                    and not path.is_relative_to(REPO / "tests" / "docs")):
                names |= set(NAME.findall(path.read_text(errors="replace")))
    return names


def documented() -> set[str]:
    """The names in the page's tables: a row per variable, its name first."""
    return set(re.findall(rf"^\| `({NAME.pattern})` \|", PAGE.read_text(), flags=re.M))


def test_every_operator_setting_has_its_row():
    assert sorted(operator_settings() - documented()) == []


def test_every_name_the_code_mentions_has_its_row():
    assert sorted(mentioned_by_code() - documented()) == []


def test_the_page_names_nothing_the_code_does_not():
    named = set(NAME.findall(PAGE.read_text()))
    assert sorted(named - operator_settings() - mentioned_by_code()) == []


def test_the_docs_link_the_page_instead_of_the_source():
    for page in (REPO / "docs").rglob("*.md"):
        assert "see `operator/finetune_operator/settings.py`" not in page.read_text(), page.name
