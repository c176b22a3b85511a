"""Fair admission to the engine: a bound on jobs in the engine, handed over round-robin by tenant.

The engine runs what it holds by priority, then arrival, so whatever is handed to it at once runs
in fetch order: ten jobs of a small tenant fetched behind thousands of a big one would wait for
all of them. So the worker keeps only `max_in_engine` jobs in the engine (running or waiting
there; about 2 x max_num_seqs keeps every batch full) and holds the rest here, one queue per
tenant (jobs without a tenant form one more queue). Whenever a job leaves the engine, the freed
place goes to the next held job, chosen in this order:

1. the lowest `priority` value among the heads of the tenants' queues (priority stays global);
2. among the tenants whose head has that priority, the next in turn: round-robin, a tenant
   served goes to the back of the turn;
3. within a tenant, priority then fetch order.

A tenant at its own cap (`max_inflight_per_tenant`, 0 = none; jobs without a tenant have no
cap) is passed over until one of its jobs leaves. So with T tenants waiting at one priority, a
tenant's i-th held job is handed over within T * i handovers, and then has at most
`max_in_engine` jobs ahead of it in the engine.

What can be reordered is only what has been fetched: held jobs stay outstanding in the offset
tracker, so a partition's fetch window (`max_inflight_per_partition`) and the backpressure gate
(held jobs count as waiting) bound how far ahead of a small tenant's job a big backlog can be
fetched, and so how much of it fair admission can overtake. `max_in_engine` 0 means no bound:
every job goes to the engine when fetched (only the tenant caps hold jobs back).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

_NO_TENANT = ""


class TenantLimiter(Generic[T]):
    def __init__(self, max_inflight_per_tenant: int, max_in_engine: int = 0,
                 priority_of: Callable[[T], int] = lambda item: 0) -> None:
        if max_inflight_per_tenant < 0:
            raise ValueError("max in-flight per tenant must be >= 0 (0 = no cap)")
        if max_in_engine < 0:
            raise ValueError("max jobs in the engine must be >= 0 (0 = no bound)")
        self.cap = max_inflight_per_tenant
        self.max_in_engine = max_in_engine
        self._priority_of = priority_of
        self._running: dict[str, int] = defaultdict(int)
        self._in_engine = 0
        # Per tenant: a heap of (priority, fetch sequence, item); the sequence keeps fetch order.
        self._held: dict[str, list[tuple[int, int, T]]] = {}
        # Tenants with held items that may start, by the priority of their head, in turn order
        # (a dict keeps insertion order: the first key is next); tenants at their cap are parked.
        self._turns: dict[int, dict[str, None]] = {}
        self._parked: set[str] = set()
        self._seq = itertools.count()
        self._held_count = 0

    def admit(self, tenant: str | None, item: T) -> bool:
        """True if item may start now (a place is taken); False if it was held."""
        key = tenant or _NO_TENANT
        if self._engine_full() or self._at_cap(key) or key in self._held:
            self._hold(key, item)
            return False
        self._take(key)
        return True

    def release(self, tenant: str | None) -> T | None:
        """A job of the tenant left the engine; returns the held item that takes its place, if any."""
        key = tenant or _NO_TENANT
        running = self._running.get(key, 0)
        if running > 0:
            self._in_engine -= 1
            if running == 1:
                del self._running[key]  # no per-tenant state outlives the tenant's last job
            else:
                self._running[key] = running - 1
        if key in self._parked and not self._at_cap(key):
            self._parked.discard(key)
            self._enter_turn(key)
        return self._next()

    def drop_held(self, predicate: Callable[[T], bool]) -> list[T]:
        """Remove and return held items for which predicate(item) is true (e.g. revoked partition)."""
        dropped: list[T] = []
        kept: dict[str, list[tuple[int, int, T]]] = {}
        for key, queue in self._held.items():
            keep = []
            for entry in queue:
                (dropped.append(entry[2]) if predicate(entry[2]) else keep.append(entry))
            if keep:
                heapq.heapify(keep)
                kept[key] = keep
        if dropped:  # rebuild the turn from what is left, in the order it had
            order = [key for turn in self._turns.values() for key in turn] + sorted(self._parked)
            self._held, self._turns, self._parked = kept, {}, set()
            self._held_count -= len(dropped)
            for key in order:
                if key in kept:
                    self._enter_turn(key)
        return dropped

    def running(self, tenant: str | None) -> int:
        return self._running.get(tenant or _NO_TENANT, 0)

    @property
    def in_engine(self) -> int:
        """Items started (handed to the engine) and not yet released."""
        return self._in_engine

    @property
    def held(self) -> int:
        return self._held_count

    def held_of(self, tenant: str | None) -> int:
        return len(self._held.get(tenant or _NO_TENANT, ()))

    # -- internals ------------------------------------------------------------------------------
    def _engine_full(self) -> bool:
        return bool(self.max_in_engine) and self._in_engine >= self.max_in_engine

    def _at_cap(self, key: str) -> bool:
        return bool(self.cap) and key != _NO_TENANT and self._running.get(key, 0) >= self.cap

    def _take(self, key: str) -> None:
        self._running[key] += 1
        self._in_engine += 1

    def _enter_turn(self, key: str) -> None:
        """A tenant with held items joins the back of its head's priority class (or is parked)."""
        if self._at_cap(key):
            self._parked.add(key)
        else:
            self._turns.setdefault(self._held[key][0][0], {})[key] = None

    def _leave_turn(self, key: str) -> None:
        if key in self._parked:
            self._parked.discard(key)
            return
        priority = self._held[key][0][0]
        turn = self._turns[priority]
        del turn[key]
        if not turn:
            del self._turns[priority]

    def _hold(self, key: str, item: T) -> None:
        entry = (self._priority_of(item), next(self._seq), item)
        queue = self._held.get(key)
        if queue is None:
            self._held[key] = [entry]
            self._enter_turn(key)
        elif entry < queue[0]:  # a new head of better priority: the tenant moves to its class
            self._leave_turn(key)
            heapq.heappush(queue, entry)
            self._enter_turn(key)
        else:
            heapq.heappush(queue, entry)
        self._held_count += 1

    def _next(self) -> T | None:
        """The held item that starts now: best priority, then the tenant next in turn."""
        if self._engine_full() or not self._turns:
            return None
        priority = min(self._turns)
        turn = self._turns[priority]
        key = next(iter(turn))
        self._leave_turn(key)
        queue = self._held[key]
        item = heapq.heappop(queue)[2]
        self._held_count -= 1
        self._take(key)
        if queue:
            self._enter_turn(key)  # served: to the back of the turn
        else:
            del self._held[key]
        return item
