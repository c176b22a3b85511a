"""Waiting with a time limit without losing a cancellation.

On Python 3.11, ``asyncio.wait_for`` returns normally when the awaited thing finishes in the same
loop iteration as a ``cancel()`` of the waiting task: the cancellation is swallowed. A loop that
waits that way (the commit task woken by every start, the broker probe) then runs on after the
worker cancelled it at shutdown, and the shutdown hangs. ``asyncio.timeout`` keeps the
cancellation, so every timed wait of the worker goes through these helpers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set, at most ``timeout_s`` seconds; True when it was set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """``await awaitable`` with a time limit (TimeoutError past it); a cancellation always wins."""
    async with asyncio.timeout(timeout_s):
        return await awaitable
