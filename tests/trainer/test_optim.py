"""The learning-rate schedule: warmup, then the chosen decay."""

from __future__ import annotations

import pytest

from finetune_trainer.optim import lr_factor


def test_warmup_rises_linearly_to_the_peak():
    factors = [lr_factor(s, total_steps=100, warmup_ratio=0.1, scheduler="cosine")
               for s in range(10)]
    assert factors == sorted(factors) and factors[0] > 0 and factors[-1] < 1
    assert lr_factor(10, 100, 0.1, "cosine") == pytest.approx(1.0)


@pytest.mark.parametrize(("scheduler", "middle", "end"), [
    ("cosine", 0.5, 0.0), ("linear", 0.5, 0.0), ("constant", 1.0, 1.0)])
def test_decay_shapes(scheduler, middle, end):
    assert lr_factor(50, 100, 0.0, scheduler) == pytest.approx(middle)
    assert lr_factor(100, 100, 0.0, scheduler) == pytest.approx(end, abs=1e-9)
