"""#51, #62: docs/troubleshooting.md lists exactly the operator's vocabulary
(`finetune_operator/reasons.py`): each condition's section has a row for each member of its
reason enum and none other, and so have the waiting words, the events and the sweep's
events. tests/code/test_reasons.py keeps the code from spelling a reason outside that
module, so the page, the enums and the code cannot drift apart without a test saying where.

The page is read as Markdown tables whose first cell is one backticked word, under `## `
headings named by a condition type or one of the sections below."""

from __future__ import annotations

import re
import unicodedata
from enum import StrEnum

import pytest

from finetune_operator.api import Phase
from finetune_operator.backends.kubernetes.states import _SAME_CAUSE, DISRUPTION_REASONS
from finetune_operator.reasons import (
    CONDITION_REASONS,
    ConditionType,
    EventReason,
    SweepReason,
    WaitingReason,
)
from finetune_trainer import exits
from tests.conftest import REPO

pytestmark = pytest.mark.unit

DOCS = REPO / "docs"
PAGE = DOCS / "troubleshooting.md"

PHASES = "Start from the phase"
WAITING = "Workers waiting"
EVENTS = "Events"
SWEEP = "FineTuneSweep"
EXIT_CODES = "The trainer's exit codes"

PHASE_EVENTS = set(Phase.__args__) - {"Pending"}
"""Each phase a job enters posts an event named by it (`_Builder.phase`); Pending is where a
job starts, and a job refused before launch is set back to it without one."""

EXTERNAL_EXIT_CODES = {137: "128 + SIGKILL: the kernel's out-of-memory killer (OOMKilled)"}


def listed_in() -> dict[str, set[str]]:
    """Each section of reasons → the words its rows must name, exactly."""
    sections: dict[str, set[str]] = {str(type_): _values(enum)
                                     for type_, enum in CONDITION_REASONS.items()}
    sections[WAITING] = _values(WaitingReason)
    sections[EVENTS] = _values(EventReason) | PHASE_EVENTS
    sections[SWEEP] = _values(SweepReason)
    return sections


def _values(enum: type[StrEnum]) -> set[str]:
    return {member.value for member in enum}


# --- the page -------------------------------------------------------------------------------

ROW = re.compile(r"^\|\s*`([A-Za-z]+)`\s*\|", re.MULTILINE)
"""A table row whose first cell is one backticked word: a reason (or a phase)."""
EXIT_ROW = re.compile(r"^\|\s*`(\d+)`\s*\|(.*)$", re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def sections(text: str) -> dict[str, str]:
    """`## ` heading → its text (subsections included); the heading is named by what comes
    before ` — ` or `: `, backticks dropped. Fenced code is no heading."""
    found: dict[str, str] = {}
    key, fenced = None, False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("## ") and not fenced:
            key = re.split(r" — |: ", line[3:], maxsplit=1)[0].replace("`", "").strip()
            found[key] = ""
        elif key is not None:
            found[key] += line + "\n"
    return found


def rows(section: str) -> set[str]:
    return set(ROW.findall(section))


def the_page() -> dict[str, str]:
    return sections(PAGE.read_text())


def differences(page: dict[str, str], expected: dict[str, set[str]]) -> list[str]:
    """What the page's rows and the vocabulary disagree on, section by section; a section
    of rows that names no part of the vocabulary is one too."""
    said = []
    for key, words in sorted(expected.items()):
        if key not in page:
            said.append(f"no section `## {key}` (its reasons: {sorted(words)})")
            continue
        listed = rows(page[key])
        said += [f"## {key}: no row for `{word}`" for word in sorted(words - listed)]
        said += [f"## {key}: `{word}` is not in the vocabulary (reasons.py)"
                 for word in sorted(listed - words)]
    said += [f"## {key} lists reasons, but no enum of reasons.py is called {key!r}"
             for key, text in sorted(page.items())
             if key not in expected and key not in (PHASES, EXIT_CODES) and rows(text)]
    return said


# --- the checks -----------------------------------------------------------------------------

def test_each_section_lists_exactly_its_enum():
    assert differences(the_page(), listed_in()) == []


def test_every_condition_type_has_a_section():
    assert sorted(set(ConditionType) - set(the_page())) == []


def test_the_waiting_words_said_as_another_are_named():
    """ImagePullBackOff is said as ErrImagePull: no row of its own, but a reader searching
    the page for the kubelet's word finds it."""
    text = the_page()[WAITING]
    assert [word for word in sorted(_SAME_CAUSE) if f"`{word}`" not in text] == []


def test_every_phase_has_a_row():
    assert rows(the_page()[PHASES]) == set(Phase.__args__)


def test_every_exit_code_of_the_trainer_has_a_row():
    codes = {value: name for name, value in vars(exits).items()
             if (name.startswith("EXIT_") or name == "STOPPED") and isinstance(value, int)}
    listed = dict(EXIT_ROW.findall(the_page()[EXIT_CODES]))
    assert set(map(int, listed)) == set(codes) | set(EXTERNAL_EXIT_CODES)
    for value, name in codes.items():
        assert f"`{name}`" in listed[str(value)], f"exit {value}'s row does not name {name}"


def test_the_restart_causes_name_every_disruption_the_operator_reads():
    text = the_page()["Running"]
    assert [w for w in sorted(DISRUPTION_REASONS) if f"`{w}`" not in text] == []


def slug(heading: str) -> str:
    """A heading's anchor, as Python-Markdown's toc extension (mkdocs' default) makes it."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_page_links_to_its_own_headings():
    text = PAGE.read_text()
    headings = {slug(line.lstrip("#").replace("`", "")) for line in text.splitlines()
                if re.match(r"#{1,6} ", line)}
    anchors = {t[1:] for t in LINK.findall(text) if t.startswith("#")}
    assert anchors, "the rows point to the sections they lean on"
    assert sorted(anchors - headings) == []


def test_links_stay_inside_the_docs():
    """mkdocs --strict refuses a link to a file that is not under docs/."""
    targets = [t for t in LINK.findall(PAGE.read_text()) if "://" not in t
               and not t.startswith(("#", "mailto:"))]
    assert targets, "the page links to the pages it leans on"
    broken = [t for t in targets if not (PAGE.parent / t.split("#")[0]).resolve()
              .is_relative_to(DOCS) or not (PAGE.parent / t.split("#")[0]).is_file()]
    assert broken == []


# --- the check, shown to bite ---------------------------------------------------------------

def test_a_new_member_without_a_row_and_a_row_without_a_member_are_said():
    expected = listed_in()
    expected["Stalled"] = expected["Stalled"] | {"NewReason"}
    page = the_page()
    page["Running"] += "| `NoLongerSet` | gone from the code | nothing |\n"
    page["Ghost"] = "| `Ghost` | no such condition | nothing |\n"
    assert differences(page, expected) == [
        "## Running: `NoLongerSet` is not in the vocabulary (reasons.py)",
        "## Stalled: no row for `NewReason`",
        "## Ghost lists reasons, but no enum of reasons.py is called 'Ghost'"]
