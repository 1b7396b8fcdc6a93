"""Facts kept in one place (#58, items 3 and 4): the control plane's measured build time in
docs/design/development.md, which every other page and the Makefile's comments link to
instead of giving a figure of their own (four pages had said 8, 10 or 9 minutes, or 542 s);
and the metrics, dashboards and alerts, how they are checked included, in docs/metrics.md,
leaving docs/design/testing.md about the tests."""

from __future__ import annotations

import re

from tests.conftest import REPO

BUILD_TIMES = REPO / "docs" / "design" / "development.md"
FIGURE = re.compile(r"\b\d+(?:\.\d+)? ?(?:s|min|minutes)\b")
CONTROL_PLANE = re.compile(r"control[ -]?plane|Go modules|kube-apiserver|cluster-bin", re.I)
BUILT = re.compile(r"\b(?:build|builds|built|cold)\b", re.I)


def sentences(text: str) -> list[str]:
    """The prose's sentences (code blocks left out: their figures time commands)."""
    paragraphs = re.split(r"\n\s*\n", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    return [sentence for paragraph in paragraphs
            for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`])", " ".join(paragraph.split()))]


def makefile_comments() -> str:
    lines = (REPO / "Makefile").read_text().splitlines()
    return "\n".join(line.lstrip("# ") if line.startswith("#") else "" for line in lines)


def build_figures(text: str) -> list[str]:
    """Sentences that give the control plane's build a time."""
    return [s for s in sentences(text)
            if CONTROL_PLANE.search(s) and BUILT.search(s) and FIGURE.search(s)]


def test_the_control_plane_build_time_is_given_in_one_place():
    elsewhere = {"README.md": (REPO / "README.md").read_text(),
                 "Makefile": makefile_comments(),
                 "charts/finetune-operator/README.md":
                     (REPO / "charts/finetune-operator/README.md").read_text()}
    elsewhere |= {str(page.relative_to(REPO)): page.read_text()
                  for page in (REPO / "docs").rglob("*.md") if page != BUILD_TIMES}
    assert {name: found for name, text in elsewhere.items()
            if (found := build_figures(text))} == {}
    measured = BUILD_TIMES.read_text()
    assert "## Build times" in measured
    assert build_figures(measured.split("## Build times")[1])
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", measured.split("## Build times")[1])


def test_testing_is_about_tests_and_metrics_about_metrics():
    testing = (REPO / "docs" / "design" / "testing.md").read_text()
    metrics = (REPO / "docs" / "metrics.md").read_text()
    assert not re.search(r"`finetune_\w+", testing)  # no series: they are in metrics.md
    assert "Grafana" not in testing and "--set metrics." not in testing
    assert "## In Prometheus and Grafana" in metrics and "### How they are checked" in metrics
    assert "../metrics.md#how-they-are-checked" in testing
