"""Kafka calls a partition assignment cannot do without, retried while the broker is away.

Reading a committed offset or initialising a partition's transactional id happens inside the
rebalance callback: giving up there would leave the partition unowned, so the call is repeated
with backoff (up to about two minutes), and only then is the worker stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka.errors import KafkaError
from structlog.typing import FilteringBoundLogger

T = TypeVar("T")


class KafkaRetry:
    def __init__(self, log: FilteringBoundLogger, give_up: Callable[[str], None], attempts: int = 30) -> None:
        self.log = log
        self.give_up = give_up  # called with the reason once the last attempt failed
        self.attempts = attempts

    async def __call__(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """Await call() until it succeeds; Kafka errors (a broker away) are retried with backoff."""
        for attempt in range(1, self.attempts + 1):
            try:
                return await call()
            except KafkaError as exc:
                if attempt == self.attempts:
                    self.give_up(f"cannot {what}: {exc!r}")
                    raise
                self.log.warning(f"cannot {what} yet; retrying", error=repr(exc), attempt=attempt)
                await asyncio.sleep(min(5.0, 0.2 * 2**attempt))
        raise AssertionError("unreachable")
