"""docs/metrics.md, the metrics reference (#51): every series the trainer and the operator
register is documented there, and the page names none they no longer have."""

from __future__ import annotations

import itertools
import re

from finetune_operator.metrics import OperatorMetrics
from finetune_trainer.metrics import TrainerMetrics
from tests.conftest import REPO

PAGE = REPO / "docs" / "metrics.md"


def registered() -> set[str]:
    """The series names a scrape can show: each family, counters with their `_total`,
    histograms by their base name."""
    names = set()
    for registry in (TrainerMetrics("demo", "default", 0).registry,
                     OperatorMetrics({"kubernetes"}).registry):
        for family in registry.collect():
            names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def documented() -> set[str]:
    """`finetune_...` names in the page: `{a,b}` spelled out, a label set (`{op}`) left off."""
    names = set()
    for written in re.findall(r"`(finetune_[\w{},]+)(?![\w./])", PAGE.read_text()):
        written = re.sub(r"(\{[\w,]+\})+$", "", written)  # labels, not alternatives
        parts = [p.split(",") for p in re.split(r"[{}]", written)]
        names |= {"".join(choice) for choice in itertools.product(*parts)}
    return names


def test_every_registered_series_is_documented():
    assert sorted(registered() - documented()) == []


def gpu_series() -> set[str]:
    """The NVML series (registered only where a GPU is), as finetune_trainer/gpu.py names
    them (a counter family gets `_total` on a scrape)."""
    source = (REPO / "trainer" / "finetune_trainer" / "gpu.py").read_text()
    gauges = set(re.findall(r'gauge\("(finetune_gpu_\w+)"', source))
    gauges |= set(re.findall(r'GaugeMetricFamily\("(finetune_gpu_\w+)"', source))
    counters = re.findall(r'CounterMetricFamily\("(finetune_gpu_\w+)"', source)
    return gauges | {f"{name}_total" for name in counters}


def test_the_page_documents_no_series_that_is_gone():
    assert sorted(documented() - registered() - gpu_series()) == []
    assert sorted(gpu_series() - documented()) == []
