"""When to stop and restart fetching, with hysteresis so partitions do not flap.

The engine thread reports how much work is waiting and how full the KV cache is. Above a
high-water mark the consumer pauses its partitions; it resumes only once both measures are back
under their low-water marks. The waiting high-water mark should stay well above the batch size:
the scheduler can only group requests that share a prefix if they have already been fetched.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BackpressurePolicy:
    waiting_high: int = 512  # queued (not yet running) requests above which fetching pauses
    waiting_low: int = 256  # ... and below which it resumes
    kv_high: float = 0.95  # KV cache usage above which fetching pauses
    kv_low: float = 0.80

    def __post_init__(self) -> None:
        if not 0 <= self.waiting_low < self.waiting_high:
            raise ValueError("backpressure: need 0 <= waiting_low < waiting_high")
        if not 0 <= self.kv_low < self.kv_high <= 1.0:
            raise ValueError("backpressure: need 0 <= kv_low < kv_high <= 1")


class BackpressureGate:
    """Decides, from the latest load figures, whether fetching should be paused."""

    def __init__(self, policy: BackpressurePolicy) -> None:
        self.policy = policy
        self.paused = False

    def update(self, waiting: int, kv_usage: float) -> bool:
        """Feed the current load; returns True while fetching should be paused."""
        p = self.policy
        if self.paused:
            if waiting <= p.waiting_low and kv_usage <= p.kv_low:
                self.paused = False
        elif waiting >= p.waiting_high or kv_usage >= p.kv_high:
            self.paused = True
        return self.paused
