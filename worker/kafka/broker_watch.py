"""Is a broker reachable? A probe every few seconds, so an outage shows in /readyz and pauses intake.

aiokafka hides a broker that is away: polls return nothing, sends wait in the producer's buffer,
heartbeats fail in the background; nothing raises to the worker. So a small task asks for fresh
metadata of the producer's topics every `interval_s` (one round trip to any broker that answers;
a connection refused fails at once, a silent host after `timeout_s`). When a probe fails:

1. the worker is marked not ready (`/readyz` 503, `tokenmill_broker_reachable` 0),
2. intake pauses: every assigned partition is paused, so nothing new is taken while answers
   cannot be delivered; what is in the engine goes on, and its answers wait in the publisher,
   which retries until the broker is back.

The first probe that succeeds again undoes both and logs how long the broker was away. The
engine, the group membership and everything in flight are kept throughout: the consumer rejoins
the group by itself, and the commit loop commits what was answered meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from structlog.typing import FilteringBoundLogger

from tokenmill.aio import within


@dataclass(eq=False)
class BrokerWatch:
    probe: Callable[[], Awaitable[bool]]  # True when some broker answered
    on_change: Callable[[bool], None]  # called with the new state: True = reachable again
    log: FilteringBoundLogger
    interval_s: float = 2.0
    timeout_s: float = 5.0
    reachable: bool = field(default=True, init=False)
    outages: list[float] = field(default_factory=list, init=False)  # seconds away, one per outage
    _away_since: float | None = field(default=None, init=False)

    async def run(self) -> None:
        while True:
            self.observe(await self._probe_once())
            await asyncio.sleep(self.interval_s)

    async def _probe_once(self) -> bool:
        try:
            return bool(await within(self.probe(), self.timeout_s))
        except Exception:  # a timeout, a closed connection: no broker answered
            return False

    def observe(self, reachable: bool, now: float | None = None) -> None:
        """Take one probe's outcome; state changes are logged and handed to on_change."""
        now = time.monotonic() if now is None else now
        if reachable == self.reachable:
            return
        self.reachable = reachable
        if not reachable:
            self._away_since = now
            self.log.warning("no broker reachable; intake paused, not ready")
        else:
            away = now - (self._away_since if self._away_since is not None else now)
            self.outages.append(away)
            self._away_since = None
            self.log.info("broker reachable again; intake resumed", away_s=round(away, 1))
        self.on_change(reachable)

    def away_for(self, now: float | None = None) -> float:
        """Seconds since the current outage began; 0 while a broker is reachable."""
        if self._away_since is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self._away_since
