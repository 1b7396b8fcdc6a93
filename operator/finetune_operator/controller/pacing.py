"""How fast the operator launches: a token bucket of launches, handed out as reservations.

Every launch creates a job's workers (for the kubernetes backend a ConfigMap, a Service and
an Indexed Job, then the Job controller's pods and the scheduler's bindings), so a burst of
a thousand new jobs launched as fast as they arrive is several thousand writes on the API
server at once, and on a shared cluster everyone's `kubectl` slows down with it. Launches
are paced instead, as client-go paces a controller's requests (QPS and burst): up to `burst`
at once, then `rate` a second. A job that must wait is acknowledged at once (phase Pending,
naming the time its turn comes) and looked at again when it comes; turns are given in the order
jobs ask, as golang.org/x/time/rate's reservations are.

A reservation is not a coroutine that waits: the reconciler moves on to the next job, and
the job's key comes back from the work queue when its turn is due.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from datetime import UTC, datetime, timedelta

LAUNCH_RATE = 10.0
"""Launches a second once a burst's first LAUNCH_BURST are out (`finetune operator
--launch-rate`): a gang takes far longer than a tenth of a second to be scheduled anyway."""
LAUNCH_BURST = 20


class LaunchPacer:
    def __init__(self, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        """`rate` launches a second after the first `burst`; rate 0: no pacing at all.
        `clock` times the turns; `wall` names them (`turn_at`)."""
        if rate < 0 or burst < 1:
            raise ValueError("the launch rate must be >= 0 and the burst >= 1")
        self.rate, self.burst, self.clock, self.wall = rate, burst, clock, wall
        self._tokens = float(burst)
        """Launches that may start now; below zero, the turns already promised."""
        self._updated = clock()
        self._turns: dict[Hashable, float] = {}
        """Key → when (clock) its promised launch may start."""
        self._named: dict[Hashable, datetime] = {}
        """Key → its turn as a time of day, fixed when promised: every look at a waiting job
        says the same time, so its status is written once, not counted down at each look."""

    def reserve(self, key: Hashable) -> float:
        """Seconds until `key` may launch: 0 means now, and its turn is spent; more means
        its turn is promised for then (asked again, the same turn is answered)."""
        now = self.clock()
        if (due := self._turns.get(key)) is not None:
            if due > now:
                return due - now
            self.release(key)
            return 0.0
        if self.rate == 0:
            return 0.0
        self._tokens = min(float(self.burst),
                           self._tokens + (now - self._updated) * self.rate)
        self._updated = now
        self._tokens -= 1
        if self._tokens >= 0:
            return 0.0
        wait = -self._tokens / self.rate
        self._turns[key] = now + wait
        self._named[key] = self.wall() + timedelta(seconds=wait)
        return wait

    def promised(self, key: Hashable) -> float | None:
        """Seconds until `key`'s promised turn (None: it was promised none)."""
        due = self._turns.get(key)
        return None if due is None else max(0.0, due - self.clock())

    def turn_at(self, key: Hashable) -> datetime | None:
        """When `key`'s promised turn comes, as a time of day (UTC), the same however often
        it is asked (None: it was promised none)."""
        return self._named.get(key)

    def release(self, key: Hashable) -> None:
        """`key` no longer launches (deleted, suspended, launched by another path): its
        promised turn lapses. The turns after it keep their times."""
        self._turns.pop(key, None)
        self._named.pop(key, None)

    @property
    def waiting(self) -> int:
        """Jobs promised a turn that they have not taken yet."""
        return len(self._turns)
