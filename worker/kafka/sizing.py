"""Record sizes against the output topics' limits: no answer may be larger than its topic takes.

The broker refuses a record batch larger than its topic's `max.message.bytes` (Kafka's default
1048588, 1 MiB plus the log overhead). A refused Result must not be retried forever, or the
partition's commit point stays behind it; and aiokafka's idempotent producer does not take back
the sequence numbers of a batch the broker refused, so after one refusal every later batch of
that topic partition is refused as out of order (publisher.py then moves the topic to a plain
producer). So sizes are kept within the limits *before* anything is sent:

- At start the worker reads `max.message.bytes` of the results, tokens and dead-letter topics
  (admin.py), falling back to Kafka's default for a topic whose config cannot be read.
- The producer follows them (`TopicLimits.producer_kwargs`): its request size is the largest
  limit, so its own per-record check never refuses what its topic takes, and its batch size is at
  most the smallest limit, so a batch of several records never passes any topic's limit (a
  record bigger than a batch goes in a batch of its own, whose size is the record's).
- Every record is measured as the one-record batch it may become (`record_size`, an upper
  bound) before it is sent:
  - a Result that does not fit is cut down (`fit_result`), in this order: its `logprobs` are
    dropped; then its `text` is cut to the longest prefix that fits (`token_ids` and `usage`
    stay whole); each sets `truncated: true`. An ok Result that still does not fit (its token
    ids alone pass the limit) is replaced by an error Result with code `result_too_large`, and
    its input is dead-lettered, so it can be run again where the limit is larger. Last, a Result
    whose `metadata` alone passes the limit goes without it (`truncated: true`).
  - a dead letter that does not fit keeps its key and headers and the first bytes of its value
    that fit; the header `tokenmill.value.original_bytes` then gives the value's full length
    (`fit_dead_letter`).
  - a TokenEvent that does not fit is dropped (the stream shows a gap; the Result is whole).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.kafka.publisher import KAFKA_DEFAULT_MAX_MESSAGE_BYTES, OutRecord, record_size
from tokenmill.schemas import ErrorInfo, Result
from tokenmill.schemas.constants import (
    ERROR_RESULT_TOO_LARGE,
    HEADER_VALUE_ORIGINAL_BYTES,
    STATUS_ERROR,
    STATUS_OK,
)

DEFAULT_MAX_BATCH_BYTES = 256 * 1024  # the producer's batch size where every limit allows it

# How a Result was cut down (the `how` label of tokenmill_records_cut_total).
CUT_LOGPROBS = "logprobs"
CUT_TEXT = "text"
CUT_METADATA = "metadata"
CUT_REPLACED = ERROR_RESULT_TOO_LARGE
CUT_DEAD_LETTER_VALUE = "dead_letter_value"


@dataclass
class TopicLimits:
    """max.message.bytes of each output topic; a topic not listed has Kafka's default."""

    by_topic: dict[str, int] = field(default_factory=dict)
    unread: tuple[str, ...] = ()  # topics whose limit could not be read (the default applies)

    def of(self, topic: str) -> int:
        return self.by_topic.get(topic, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)

    def producer_kwargs(self) -> dict[str, int]:
        """The producer's size settings: the largest limit per record, the smallest per batch."""
        limits = list(self.by_topic.values()) or [KAFKA_DEFAULT_MAX_MESSAGE_BYTES]
        if self.unread:
            limits.append(KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
        return {"max_request_size": max(limits), "max_batch_size": min(DEFAULT_MAX_BATCH_BYTES, min(limits))}


@dataclass(frozen=True)
class Fitted:
    """A Result as it goes out: its wire form, and how it was cut (None: it went whole)."""

    result: Result
    value: bytes
    how: str | None


def _fitted(result: Result, how: str | None, limit: int) -> Fitted | None:
    """The Fitted result when its record fits the limit, else None."""
    value = result.to_json_bytes()
    return Fitted(result, value, how) if record_size(result.job_id.encode(), value) <= limit else None


def _longest_fitting_prefix(text: str, fits: Callable[[str], Fitted | None]) -> Fitted:
    """fits() of the longest prefix of text that fits (fits("") must)."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(text[:mid]) is not None:
            lo = mid
        else:
            hi = mid - 1
    best = fits(text[:lo])
    assert best is not None
    return best


def fit_result(result: Result, limit: int) -> Fitted:
    """The Result itself when it fits the limit, else the cut-down one (the module docstring's
    order). The last step's Result is returned even if it still does not fit (a limit smaller
    than a bare Result: the send says so)."""
    whole = _fitted(result, None, limit)
    if whole is not None:
        return whole
    cut, how = result, None
    if cut.logprobs is not None:
        cut, how = cut.model_copy(update={"logprobs": None, "truncated": True}), CUT_LOGPROBS
        if (fitted := _fitted(cut, how, limit)) is not None:
            return fitted
    if cut.text:
        base = cut

        def with_text(text: str) -> Fitted | None:
            return _fitted(base.model_copy(update={"text": text, "truncated": True}), CUT_TEXT, limit)

        if with_text("") is not None:
            return _longest_fitting_prefix(base.text, with_text)
    if cut.status == STATUS_OK:
        size = record_size(result.job_id.encode(), result.to_json_bytes())
        cut = Result(
            job_id=result.job_id, status=STATUS_ERROR, model=result.model, worker=result.worker,
            attempt=result.attempt, usage=result.usage, timing=result.timing, source=result.source,
            metadata=result.metadata,
            error=ErrorInfo(code=ERROR_RESULT_TOO_LARGE, message=(
                f"the Result is {size} bytes ({len(result.token_ids)} token ids), more than the results topic "
                f"takes even without logprobs and text (max.message.bytes {limit})")),
        )
        how = CUT_REPLACED
        if (fitted := _fitted(cut, how, limit)) is not None:
            return fitted
    if cut.metadata is not None:
        cut = cut.model_copy(update={"metadata": None, "truncated": True})
        how = how if how == CUT_REPLACED else CUT_METADATA
    return Fitted(cut, cut.to_json_bytes(), how)


def fit_dead_letter(rec: OutRecord, limit: int) -> tuple[OutRecord, bool]:
    """The dead letter itself when it fits, else (with its value cut to the first bytes that fit
    and the original length in a header, True)."""
    if rec.size() <= limit or not rec.value:
        return rec, False
    headers = list(rec.headers or ()) + [(HEADER_VALUE_ORIGINAL_BYTES, str(len(rec.value)).encode())]
    room = limit - record_size(rec.key, b"", headers)
    value = rec.value[: max(0, room)]
    while value and record_size(rec.key, value, headers) > limit:  # the value's length varint grew
        value = value[: len(value) - (record_size(rec.key, value, headers) - limit)]
    return OutRecord(rec.topic, rec.key, value, headers, rec.partition, rec.shrink), True
