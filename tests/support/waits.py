"""How long a test waits for something: until it happens, or until its own time is nearly up.

A test waits for an event (a phase, a line in a log, a file, a process's exit). On a busy
machine that event comes later, so no wait here has a length of its own: each one ends when
the event comes, and only a hang runs it to the test's own bound, pytest-timeout's (the
`timeout` marker, else pyproject's), less a margin, so that the test fails naming what never
came instead of with pytest-timeout's stack dump. conftest.py tells this module when each
test's clock starts (pytest-timeout's own hook)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
FALLBACK = 1800.0
"""The bound of a test pytest-timeout does not time (pyproject's `timeout`, the same)."""
_deadline: float | None = None
"""When the running test's waits must end (time.monotonic()): its timeout less `margin`."""


def margin(timeout: float) -> float:
    """What a test keeps back of its timeout to report a wait that ran out, and tear down."""
    return min(30.0, max(3.0, timeout / 20))


def started(timeout: float | None) -> None:
    """pytest-timeout set the running test's timer: `timeout` seconds from now."""
    global _deadline
    timeout = timeout or FALLBACK
    _deadline = time.monotonic() + timeout - margin(timeout)


def ended() -> None:
    global _deadline
    _deadline = None


def seconds_left(floor: float = 5.0) -> float:
    """How long a wait may last now: to the test's deadline, at least `floor` (a teardown
    after a wait that ran out still gets its look)."""
    if _deadline is None:
        return FALLBACK - margin(FALLBACK)
    return max(floor, _deadline - time.monotonic())


def wait_until(check: Callable[[], T], what: str, poll: float = 0.1) -> T:
    """`check()`'s first true answer, waiting as long as the test may (blocking)."""
    bound = seconds_left()
    deadline = time.monotonic() + bound
    while not (answer := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {bound:.0f} s (the test's time): {what}")
        time.sleep(poll)
    return answer
