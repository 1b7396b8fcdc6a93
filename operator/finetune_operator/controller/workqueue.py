"""The controller's queue of jobs to look at: controller-runtime's workqueue, in asyncio.

A key (a FineTuneJob's namespace and name) waits in the queue at most once however often it
is added, is handed to one reconciler at a time, and, when added again while a reconciler
has it, is handed out once more after that reconciler is done: every change is looked at,
no job is looked at by two reconcilers at once, and a burst of changes to one job costs one
look. `add_after` schedules a look (a deadline, a poll); the earliest schedule of a key
wins. `hold` schedules a retry after a failure: until it is due, changes do not bring the
key back earlier (the API server's Retry-After is honoured, and a failing job does not spin).

Why a queue and a few reconcilers rather than a task per job: the cost of an idle job is one
dict entry, the API calls in flight are bounded by the number of reconcilers, and a shutdown
waits for the few looks in progress, not for a thousand tasks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable


class WorkQueue:
    def __init__(self) -> None:
        self._waiting: deque[Hashable] = deque()
        self._queued: set[Hashable] = set()
        """Keys in `_waiting`: each at most once."""
        self._processing: set[Hashable] = set()
        self._dirty: set[Hashable] = set()
        """Keys added while a reconciler had them: queued again once it is done."""
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._held: set[Hashable] = set()
        """Keys waiting out a retry's backoff (`hold`): their timer alone brings them back."""
        self._wakeup = asyncio.Event()
        self._idle: dict[Hashable, asyncio.Event] = {}
        self._shutting_down = False

    def __len__(self) -> int:
        """Keys waiting for a reconciler (the depth a metric reports)."""
        return len(self._waiting)

    def add(self, key: Hashable) -> None:
        """Look at `key` soon (once, however many times it is added before that)."""
        if self._shutting_down or key in self._held:
            return
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._waiting.append(key)
            self._wakeup.set()

    def add_after(self, key: Hashable, seconds: float) -> None:
        """Look at `key` in `seconds`, unless an earlier look is due or scheduled."""
        if self._shutting_down or key in self._queued or key in self._dirty \
                or key in self._held:
            return
        if seconds <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + seconds
        timer = self._timers.get(key)
        if timer is not None:
            if timer.when() <= due:
                return
            timer.cancel()
        self._timers[key] = loop.call_at(due, self._fire, key)

    def hold(self, key: Hashable, seconds: float) -> None:
        """Look at `key` again in `seconds`, and not before, whatever changes meanwhile."""
        if self._shutting_down:
            return
        self.forget(key)
        self._held.add(key)
        self._timers[key] = asyncio.get_running_loop().call_later(seconds, self._fire, key)

    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self._held.discard(key)
        self.add(key)

    async def get(self) -> Hashable | None:
        """The next key to look at (its reconciler must call `done`); None once shut down."""
        while not self._shutting_down:
            if self._waiting:
                key = self._waiting.popleft()
                self._queued.discard(key)
                self._processing.add(key)
                return key
            self._wakeup.clear()
            await self._wakeup.wait()
        return None

    def done(self, key: Hashable) -> None:
        """The reconciler of `key` has finished: it may be handed out again."""
        self._processing.discard(key)
        if (idle := self._idle.pop(key, None)) is not None:
            idle.set()
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def forget(self, key: Hashable) -> None:
        """Drop every pending and scheduled look at `key` (its job is gone)."""
        if (timer := self._timers.pop(key, None)) is not None:
            timer.cancel()
        self._held.discard(key)
        self._dirty.discard(key)
        if key in self._queued:
            self._queued.discard(key)
            self._waiting.remove(key)

    async def settled(self, key: Hashable) -> None:
        """Return once no reconciler has `key` (at once when none has it)."""
        if key in self._processing:
            await self._idle.setdefault(key, asyncio.Event()).wait()

    def shut_down(self) -> None:
        """No more keys are handed out or scheduled; reconcilers waiting for one get None."""
        self._shutting_down = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._wakeup.set()

    @property
    def busy(self) -> int:
        """Keys a reconciler has now."""
        return len(self._processing)
