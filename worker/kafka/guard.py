"""Stop the worker when most recent inputs are bad, instead of dead-lettering a whole topic.

A wrong --served-model-name, a producer bug or a schema change on the producing side makes every
input invalid. Dead-lettering them all "works" but empties the topic into the DLQ; stopping with a
clear error lets an operator fix the deployment while the jobs wait in Kafka.
"""

from __future__ import annotations

from collections import Counter, deque


class BadInputGuardTripped(RuntimeError):
    """Raised (once) when the share of bad inputs over the window reaches the limit."""


class BadInputGuard:
    def __init__(self, max_ratio: float, window: int) -> None:
        if not 0 < max_ratio <= 1:
            raise ValueError("bad-input guard ratio must be in (0, 1]")
        if window < 1:
            raise ValueError("bad-input guard window must be >= 1")
        self.max_ratio = max_ratio
        self.window = window
        self._recent: deque[str | None] = deque(maxlen=window)  # None = good, else error code
        self._bad = 0

    def record(self, error_code: str | None) -> None:
        """Record one input (error_code None if it was good); raises when the guard trips."""
        if len(self._recent) == self.window and self._recent[0] is not None:
            self._bad -= 1
        self._recent.append(error_code)
        if error_code is not None:
            self._bad += 1
        if len(self._recent) == self.window and self._bad / self.window >= self.max_ratio:
            codes = Counter(c for c in self._recent if c is not None)
            summary = ", ".join(f"{code}: {n}" for code, n in codes.most_common())
            raise BadInputGuardTripped(
                f"{self._bad} of the last {self.window} inputs were invalid ({summary}); "
                f"stopping (limit {self.max_ratio:.0%}). Check the producer and --served-model-name; "
                "raise --bad-input-ratio to dead-letter them instead."
            )

    @property
    def bad_ratio(self) -> float:
        return self._bad / len(self._recent) if self._recent else 0.0
