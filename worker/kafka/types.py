"""The values that travel one input record's path through the worker, from fetch to commit.

fetch.py tracks a record and makes it a `Fetched`; intake.py turns that into an `InFlightJob` (it
runs) or an `Answer` at once (bad input, deadline passed); engine_output.py turns a finished
`InFlightJob` into its `Answer` (answers.py builds the records); delivery.py publishes (or
stages) the Answer and completes its offset. Plain data: the behaviour lives in those files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from aiokafka import TopicPartition
from structlog.typing import FilteringBoundLogger

from tokenmill.kafka.publisher import OutRecord, TokenSink
from tokenmill.schemas.job import Job

# How an input was answered: a Result with status ok / expired / error (an engine error, which is
# dead-lettered as well), or a dead letter for input that never became a running job.
Outcome = Literal["ok", "expired", "error", "dead_letter"]


@dataclass(frozen=True)
class Fetched:
    """One input record, tracked as outstanding in its partition's watermark."""

    tp: TopicPartition
    epoch: int  # the assignment epoch it was fetched under (a completion of an older one is void)
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int | None = None  # the record's timestamp (CreateTime or LogAppendTime)
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(eq=False)
class InFlightJob:
    """A decoded job from intake to answer: held by the tenant cap, or running in the engine."""

    fetched: Fetched
    job: Job
    attempt: str  # this execution's id, unique per run of the job; also the engine request id
    log: FilteringBoundLogger  # bound to job_id, partition, offset and attempt
    next_index: int = 0  # index of the next TokenEvent of this attempt
    token_sink: TokenSink = field(default_factory=list)  # TokenEvents handed to the producer
    submitted: bool = False  # handed to the engine (False while the tenant cap holds it)

    @property
    def request_id(self) -> str:
        return self.attempt


@dataclass(frozen=True)
class Answer:
    """Everything one input offset is answered with, and how it went (for metrics and the log)."""

    fetched: Fetched
    records: list[OutRecord]  # published in this order; the Result last
    outcome: Outcome
    code: str | None  # the contract's error code, for error and dead_letter
    log: FilteringBoundLogger
    computed_tokens: int = 0  # what the engine computed for it (prefilled prompt + output tokens), if it ran
