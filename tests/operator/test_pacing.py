"""Launch turns (`pacing.LaunchPacer`): a burst at once, then the rate, in the order asked,
each job's turn kept however often it asks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from finetune_operator.controller.pacing import LaunchPacer
from tests.operator.test_event_driven import FakeClock


def test_a_burst_launches_at_once_and_the_rest_get_turns_in_order():
    clock = FakeClock()
    pacer = LaunchPacer(rate=2, burst=3, clock=clock)
    assert [pacer.reserve(k) for k in "abc"] == [0, 0, 0]
    assert [pacer.reserve(k) for k in "def"] == [0.5, 1.0, 1.5]
    assert pacer.waiting == 3
    assert pacer.reserve("e") == 1.0  # asked again: the same turn, not a new one
    clock.now += 1.0
    assert pacer.reserve("d") == 0 and pacer.reserve("e") == 0  # their turns came
    assert pacer.reserve("f") == pytest.approx(0.5) and pacer.waiting == 1
    assert pacer.promised("f") == pytest.approx(0.5) and pacer.promised("a") is None


def test_a_turn_is_named_by_its_time_of_day_fixed_when_promised():
    """What a waiting job's status says: the same time at every look (a countdown made each
    look before the turn write the status again)."""
    clock, wall = FakeClock(), [datetime(2026, 11, 21, 12, 0, tzinfo=UTC)]
    pacer = LaunchPacer(rate=0.5, burst=1, clock=clock, wall=lambda: wall[0])
    assert pacer.reserve("a") == 0 and pacer.turn_at("a") is None  # launched at once
    assert pacer.reserve("b") == 2.0
    assert pacer.turn_at("b") == datetime(2026, 11, 21, 12, 0, 2, tzinfo=UTC)
    clock.now += 1.5
    wall[0] += timedelta(seconds=1.7)  # the time of day moves on its own
    assert pacer.reserve("b") == pytest.approx(0.5)
    assert pacer.turn_at("b") == datetime(2026, 11, 21, 12, 0, 2, tzinfo=UTC)
    clock.now += 0.5
    assert pacer.reserve("b") == 0 and pacer.turn_at("b") is None  # taken
    assert pacer.reserve("c") == 2.0 and pacer.turn_at("c") is not None
    pacer.release("c")
    assert pacer.turn_at("c") is None


def test_an_idle_pacer_refills_up_to_its_burst():
    clock = FakeClock()
    pacer = LaunchPacer(rate=10, burst=2, clock=clock)
    assert [pacer.reserve(k) for k in "ab"] == [0, 0]
    clock.now += 60  # a minute later: two at once again, not six hundred
    assert [pacer.reserve(k) for k in "cd"] == [0, 0]
    assert pacer.reserve("e") == pytest.approx(0.1)


def test_a_released_turn_lapses_and_the_later_turns_keep_their_times():
    clock = FakeClock()
    pacer = LaunchPacer(rate=1, burst=1, clock=clock)
    assert [pacer.reserve(k) for k in "abc"] == [0, 1, 2]
    pacer.release("b")  # deleted while it waited
    assert pacer.waiting == 1 and pacer.reserve("c") == 2
    assert pacer.reserve("b") == 3  # asking anew is a new turn, after the others


def test_rate_zero_paces_nothing():
    pacer = LaunchPacer(rate=0, burst=1, clock=FakeClock())
    assert all(pacer.reserve(n) == 0 for n in range(1000)) and pacer.waiting == 0


def test_a_pacer_refuses_settings_that_could_never_launch():
    with pytest.raises(ValueError, match="burst >= 1"):
        LaunchPacer(rate=1, burst=0)
