"""Waiting out a broker that is away: when the worker starts, and for the calls an assignment
cannot do without. Both wait up to --broker-wait-timeout.

- `BrokerWait`: a worker started while no broker answers (a cluster restarting, a pod scheduled
  before Kafka) does not exit. Each client (admin, producer, consumer) is made and started again
  with backoff (0.5 s, doubling, at most 10 s between tries) until it connects, the worker is asked
  to stop, or the wait timeout has passed since the first try; then `BrokerUnreachable` carries
  one clear message and the worker exits with its own code. Only a failed connection is waited
  out: any other error of a start is raised at once.

  A client whose start failed or ran past its try is closed and thrown away, and the next try
  makes a new one: aiokafka's clients cannot be started twice (a second `start()` of a
  half-started consumer asserts), and a half-started one may hold sockets and tasks.

  Connecting is not joining. The consumer is started before it subscribes, so its start is
  only the connection; joining the group comes after (`join`), and may take as long as the
  group's rebalance may take: a dead member's session has to expire, incumbents revoke within
  the rebalance timeout. That wait is not an outage. Only past it does the broker wait timeout
  start to count.
- `KafkaRetry`: reading a committed offset or initialising a partition's transactional id
  happens inside the rebalance callback; giving up there would leave the partition unowned, so
  the call is repeated with backoff (up to 5 s between tries) until the wait timeout has passed,
  and only then is the worker stopped. A refusal (a missing ACL) stops it at the first try.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiokafka.errors import KafkaConnectionError, KafkaError
from structlog.typing import FilteringBoundLogger

from tokenmill.aio import wait_event, within
from tokenmill.kafka.security import KafkaAccessDenied, access_denied

T = TypeVar("T")
C = TypeVar("C")

DEFAULT_WAIT_S = 300.0
_CLOSE_TIMEOUT_S = 10.0


class BrokerUnreachable(Exception):
    """No broker answered within the wait timeout; the message says where and for how long."""


async def close_client(client: Any) -> None:
    """Close an aiokafka client (stop() or close()), whatever state its start left it in."""
    closing = client.stop if hasattr(client, "stop") else client.close
    try:
        await within(closing(), _CLOSE_TIMEOUT_S)
    except Exception:  # a half-started client may fail to close cleanly; it is dropped all the same
        pass


class BrokerWait:
    """Start clients once a broker answers; one deadline for all of them, from the first try."""

    def __init__(self, bootstrap: str, timeout_s: float, stop: asyncio.Event, log: FilteringBoundLogger,
                 tick: Callable[[], None] = lambda: None, first_delay_s: float = 0.5, max_delay_s: float = 10.0,
                 try_timeout_s: float = 15.0) -> None:
        self.bootstrap = bootstrap
        self.timeout_s = timeout_s
        self.stop = stop  # set: stop waiting, the worker is shutting down
        self.log = log
        self.tick = tick  # the liveness probe's heartbeat: waiting is alive, not stuck
        self.try_timeout_s = try_timeout_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self._t0: float | None = None

    def waited_s(self) -> float:
        return 0.0 if self._t0 is None else time.monotonic() - self._t0

    async def start(self, make: Callable[[], C], what: str,
                    start: Callable[[C], Awaitable[None]] | None = None) -> C | None:
        """A new client from make(), started (start(client), default client.start()): the started
        client; None when the worker was stopped first. Every try makes its own client, and one
        whose start failed or timed out is closed before the next. Raises BrokerUnreachable once
        the timeout has passed."""
        starter = start or (lambda client: client.start())

        async def attempt() -> C:
            client = make()
            try:
                await starter(client)
            except BaseException:  # a failed, timed-out or cancelled start: never started again
                await asyncio.shield(close_client(client))
                raise
            return client

        return await self.call(attempt, what)

    async def call(self, attempt: Callable[[], Awaitable[T]], what: str) -> T | None:
        """Await attempt() until it connects: its value; None when the worker was stopped first.
        attempt makes whatever client it needs afresh each time. Raises BrokerUnreachable once
        the timeout has passed."""
        if self._t0 is None:
            self._t0 = time.monotonic()
        deadline = self._t0 + self.timeout_s
        delay, tries = self.first_delay_s, 0
        while not self.stop.is_set():
            tries += 1
            self.tick()
            try:
                # A host that drops packets would hold one try for the client's request timeout.
                left = deadline - time.monotonic()
                value = await within(attempt(), max(1.0, min(self.try_timeout_s, left)))
            except (KafkaConnectionError, TimeoutError) as exc:
                error = repr(exc) if str(exc) else type(exc).__name__
            else:
                if tries > 1:
                    self.log.info("broker reachable; connected", client=what, waited_s=round(self.waited_s(), 1))
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrokerUnreachable(
                    f"no Kafka broker answered at {self.bootstrap} within {self.timeout_s:g}s "
                    f"(--broker-wait-timeout; {tries} tries of the {what}, last error: {error})")
            wait = min(delay, left)
            self.log.warning("no broker reachable yet; waiting", client=what, attempt=tries, error=error,
                             retry_in_s=round(wait, 1), waited_s=round(self.waited_s(), 1), timeout_s=self.timeout_s)
            self.tick()
            await wait_event(self.stop, wait)
            delay = min(self.max_delay_s, delay * 2)
        return None

    async def join(self, joined: Callable[[], bool], rebalance_s: float, what: str = "consumer group",
                   report_every_s: float = 15.0, poll_s: float = 0.25) -> bool:
        """Wait until joined() (the group handed this member its partitions, maybe none): True;
        False when the worker was stopped first. A join may take the group's whole rebalance
        (`rebalance_s`: the session timeout of a dead member plus the rebalance timeout) without
        counting as an outage; past that, the broker wait timeout counts, then BrokerUnreachable."""
        t0 = time.monotonic()
        deadline = t0 + rebalance_s + self.timeout_s
        next_report = t0 + report_every_s
        self.log.info("joining the consumer group", rebalance_allowance_s=round(rebalance_s, 1))
        while not joined():
            if self.stop.is_set():
                return False
            now = time.monotonic()
            if now >= deadline:
                raise BrokerUnreachable(
                    f"connected to {self.bootstrap}, but the {what} handed out no partitions within "
                    f"{now - t0:.0f}s (the rebalance allowance of {rebalance_s:g}s, then "
                    f"--broker-wait-timeout {self.timeout_s:g}s)")
            if now >= next_report:
                self.log.info("still joining the consumer group", waited_s=round(now - t0, 1),
                              rebalance_allowance_s=round(rebalance_s, 1),
                              counted_as_outage=now - t0 > rebalance_s)
                next_report = now + report_every_s
            self.tick()
            await wait_event(self.stop, poll_s)
        if time.monotonic() - t0 >= report_every_s:
            self.log.info("joined the consumer group", waited_s=round(time.monotonic() - t0, 1))
        return True


class KafkaRetry:
    def __init__(self, log: FilteringBoundLogger, give_up: Callable[[str], None],
                 timeout_s: float = DEFAULT_WAIT_S, max_delay_s: float = 5.0,
                 on_denied: Callable[[KafkaAccessDenied], None] | None = None) -> None:
        self.log = log
        self.give_up = give_up  # called with the reason once the last attempt failed
        # Called instead, at the first try, when the broker refused us (credentials, an ACL).
        self.on_denied = on_denied or (lambda denied: give_up(str(denied)))
        self.timeout_s = timeout_s
        self.max_delay_s = max_delay_s

    async def __call__(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """Await call() until it succeeds; Kafka errors (a broker away) are retried with backoff
        until the timeout has passed."""
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return await call()
            except KafkaError as exc:
                if (denied := access_denied(exc)) is not None:  # no retry makes an ACL appear
                    self.on_denied(denied)
                    raise denied from exc
                if time.monotonic() >= deadline:
                    self.give_up(f"cannot {what} within {self.timeout_s:g}s: {exc!r}")
                    raise
                self.log.warning(f"cannot {what} yet; retrying", error=repr(exc), attempt=attempt)
                await asyncio.sleep(min(self.max_delay_s, 0.2 * 2**attempt, max(0.0, deadline - time.monotonic())))
