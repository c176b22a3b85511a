"""Per-tenant cap on jobs running in the engine at once.

Jobs over the cap are held (in fetch order) and start as the tenant's earlier jobs finish. Held
jobs stay outstanding in the offset tracker, so a tenant that floods a partition eventually fills
that partition's in-flight span and pauses it, rather than growing memory without bound.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Generic, TypeVar

T = TypeVar("T")

_NO_TENANT = ""


class TenantLimiter(Generic[T]):
    def __init__(self, max_inflight_per_tenant: int) -> None:
        if max_inflight_per_tenant < 0:
            raise ValueError("max in-flight per tenant must be >= 0 (0 = no cap)")
        self.cap = max_inflight_per_tenant
        self._running: dict[str, int] = defaultdict(int)
        self._held: dict[str, deque[T]] = defaultdict(deque)

    def admit(self, tenant: str | None, item: T) -> bool:
        """True if item may start now (a slot is taken); False if it was held."""
        key = tenant or _NO_TENANT
        if self.cap and key != _NO_TENANT and (self._running[key] >= self.cap or self._held[key]):
            self._held[key].append(item)
            return False
        self._running[key] += 1
        return True

    def release(self, tenant: str | None) -> T | None:
        """Free one slot of the tenant; returns a held item that now takes that slot, if any."""
        key = tenant or _NO_TENANT
        if self._running[key] > 0:
            self._running[key] -= 1
        held = self._held.get(key)
        if held:
            item = held.popleft()
            self._running[key] += 1
            return item
        return None

    def drop_held(self, predicate) -> list[T]:
        """Remove and return held items for which predicate(item) is true (e.g. revoked partition)."""
        dropped: list[T] = []
        for key, items in self._held.items():
            keep: deque[T] = deque()
            for item in items:
                (dropped if predicate(item) else keep).append(item)
            self._held[key] = keep
        return dropped

    def running(self, tenant: str | None) -> int:
        return self._running[tenant or _NO_TENANT]

    @property
    def held(self) -> int:
        return sum(len(q) for q in self._held.values())
