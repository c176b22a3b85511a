"""Timed waits that never swallow a cancellation (asyncio.wait_for does on Python 3.11 when the
awaited thing finishes in the same loop iteration as the cancel)."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.aio import wait_event, within


async def _loop_survives_a_cancel_racing_its_wake(wait) -> bool:
    """A loop like the commit task's: wait for a wake-up, clear it, again. Set the event and
    cancel the loop in one go; True when the loop is still running afterwards."""
    event = asyncio.Event()

    async def loop() -> None:
        while True:
            await wait(event)
            event.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    await asyncio.sleep(0.05)
    survived = not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return survived


async def test_a_cancel_that_races_the_wake_up_ends_the_loop():
    assert not await _loop_survives_a_cancel_racing_its_wake(lambda e: wait_event(e, 1.0))
    assert not await _loop_survives_a_cancel_racing_its_wake(lambda e: within(e.wait(), 1.0))


async def test_wait_event_says_whether_the_event_came():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 0.01) is True


async def test_within_gives_the_result_or_times_out():
    async def answer() -> int:
        return 42

    assert await within(answer(), 1.0) == 42
    with pytest.raises(TimeoutError):
        await within(asyncio.sleep(1.0), 0.01)
