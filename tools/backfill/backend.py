"""Where a backfill's jobs run: the interface both backends (kafka_backend, local_backend) keep.

The run calls `start` once, `submit` for each chunk of validated Jobs, `wait_done` once every row
is planned, and `close` always. A backend folds each result it gets into the store with `record`
(deduplicated there by job id), which also tells the run's progress what is new.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.schemas import Job
    from tokenmill.tools.backfill.store import ResultStore


class Backend(ABC):
    model_name: str = ""  # the model named in the error Results of rows that cannot become jobs

    def __init__(self) -> None:
        self.store: ResultStore | None = None
        self.on_results: Callable[[list[dict[str, Any]]], None] = lambda added: None

    @abstractmethod
    async def start(self, store: ResultStore) -> str | None:
        """Get ready to run jobs whose results go to ``store``. Returns the model's identity for
        the generation-config fingerprint, or None when JobSpec.model (a served name) is it."""

    @abstractmethod
    async def submit(self, jobs: list[Job]) -> None:
        """Send these jobs on their way; their results come later, through ``record``."""

    @abstractmethod
    async def wait_done(self, timeout_s: float | None) -> None:
        """Return once no submitted job is without a result, or after ``timeout_s`` seconds
        (the rows still pending stay so; the run reports them)."""

    @abstractmethod
    async def close(self) -> None:
        """Release what ``start`` took; called once, whether the run succeeded or not."""

    def record(self, results: list[dict[str, Any]], offsets: dict[tuple[str, int], int] | None = None) -> None:
        """Store results (and, in the same transaction, the source positions they came from)."""
        assert self.store is not None, "start() first"
        self.on_results(self.store.add_results(results, offsets))
