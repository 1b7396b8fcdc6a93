"""The controller's work queue (#23): each job looked at once per burst of changes, never by
two reconcilers at once, a change during a look looked at after it, retries that wait."""

from __future__ import annotations

import asyncio

import pytest

from finetune_operator.controller.workqueue import WorkQueue
from tests.support import waits

pytestmark = pytest.mark.asyncio


async def drain(queue: WorkQueue) -> list:
    """Every key waiting now, each marked done."""
    keys = []
    while len(queue):
        key = await queue.get()
        keys.append(key)
        queue.done(key)
    return keys


async def test_a_key_added_many_times_is_handed_out_once_in_order():
    queue = WorkQueue()
    for key in ("a", "b", "a", "c", "b", "a"):
        queue.add(key)
    assert len(queue) == 3
    assert await drain(queue) == ["a", "b", "c"]


async def test_a_key_added_while_processed_is_handed_out_again_after_done_not_before():
    queue = WorkQueue()
    queue.add("a")
    key = await queue.get()
    queue.add("a")  # a change during the look
    assert len(queue) == 0  # no second reconciler gets it meanwhile
    other = asyncio.create_task(queue.get())
    await asyncio.sleep(0.01)
    assert not other.done()
    queue.done(key)
    assert await asyncio.wait_for(other, waits.seconds_left()) == "a"
    queue.done("a")
    assert len(queue) == 0


async def test_the_earliest_schedule_wins_and_a_change_comes_first():
    queue = WorkQueue()
    queue.add_after("a", 0.05)
    queue.add_after("a", 10)  # later: ignored
    await asyncio.sleep(0.1)
    assert await drain(queue) == ["a"]
    queue.add_after("b", 10)
    queue.add("b")  # a change: now, and the timer is gone
    assert await drain(queue) == ["b"]
    await asyncio.sleep(0.01)
    assert len(queue) == 0


async def test_a_held_key_comes_back_when_its_backoff_ends_and_not_before():
    queue, loop = WorkQueue(), asyncio.get_running_loop()
    held_at = loop.time()
    queue.hold("a", 0.2)
    queue.add("a")  # changes during the backoff wait for it
    queue.add_after("a", 0.01)
    assert len(queue) == 0
    # on the loop's clock, which a busy machine can only make later
    assert await asyncio.wait_for(queue.get(), waits.seconds_left()) == "a"
    assert loop.time() - held_at >= 0.2
    queue.done("a")
    assert len(queue) == 0  # once


async def test_forget_drops_pending_and_scheduled_looks():
    queue = WorkQueue()
    queue.add("a")
    queue.add_after("b", 0.01)
    queue.forget("a")
    queue.forget("b")
    await asyncio.sleep(0.05)
    assert len(queue) == 0


async def test_settled_waits_for_the_look_in_progress():
    queue = WorkQueue()
    queue.add("a")
    key = await queue.get()
    settled = asyncio.create_task(queue.settled("a"))
    await asyncio.sleep(0.01)
    assert not settled.done()
    queue.done(key)
    await asyncio.wait_for(settled, waits.seconds_left())
    await asyncio.wait_for(queue.settled("a"), waits.seconds_left())  # none in progress: at once


async def test_shut_down_wakes_waiting_reconcilers_with_none():
    queue = WorkQueue()
    waiting = [asyncio.create_task(queue.get()) for _ in range(3)]
    await asyncio.sleep(0.01)
    queue.shut_down()
    woken = await asyncio.wait_for(asyncio.gather(*waiting), waits.seconds_left())
    assert woken == [None, None, None]
    queue.add("a")
    assert len(queue) == 0
