"""Output sizes without a broker: Results cut down to their topic's limit in the documented order,
dead letters with their value cut, publish errors classified (retried, shrunk, or refused), the
token stream dropping what its topic will not take, and the readers of Results taking a cut one."""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog
from aiokafka import TopicPartition
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotLeaderForPartitionError,
    OutOfOrderSequenceNumber,
    TopicAuthorizationFailedError,
    UnknownError,
)

from tokenmill.engine.types import FinishReason, RequestDelta, TokenLogprob, Usage
from tokenmill.engine.types import Timing as EngineTiming
from tokenmill.kafka import answers
from tokenmill.kafka.answers import AnswerContext
from tokenmill.kafka.publisher import (
    DENIED,
    INVALID,
    TOO_LARGE,
    OutRecord,
    PublishRefused,
    TokenStream,
    record_size,
    refusal_of,
    send_acked,
)
from tokenmill.kafka.security import access_denied
from tokenmill.kafka.sizing import (
    CUT_LOGPROBS,
    CUT_METADATA,
    CUT_REPLACED,
    CUT_TEXT,
    HEADER_VALUE_ORIGINAL_BYTES,
    TopicLimits,
    fit_dead_letter,
    fit_result,
)
from tokenmill.kafka.types import Fetched, InFlightJob
from tokenmill.schemas import ERROR_RESULT_TOO_LARGE, Result
from tokenmill.schemas.decode import decode_job

LOG = structlog.get_logger("test")
TP = TopicPartition("jobs", 0)


def _job(**fields) -> InFlightJob:
    body = {"job_id": "big-1", "prompt": "hi", "sampling": {"logprobs": 5}, **fields}
    raw = json.dumps(body).encode()
    return InFlightJob(Fetched(TP, 1, 7, b"key", raw), decode_job(raw), "w-000000000001", LOG)


def _final(n_tokens: int, text: str) -> RequestDelta:
    logprobs = [TokenLogprob(i % 100, f"t{i}", -0.5, [(j, f"alt{j}", -1.25) for j in range(5)])
                for i in range(n_tokens)]
    return RequestDelta("r", [], "", finished=True, finish_reason=FinishReason.LENGTH,
                        usage=Usage(2, n_tokens, 0), timing=EngineTiming(1, 2, 3, 4),
                        output_token_ids=[i % 100 for i in range(n_tokens)], output_text=text,
                        output_logprobs=logprobs)


def _result(n_tokens: int = 40, text: str = "word " * 40, **job_fields) -> Result:
    job = _job(**job_fields)
    return answers.build_result(job.job, _final(n_tokens, text), model="m", worker="w", attempt=job.attempt,
                                source=answers.source_of("jobs", 0, 7))


def _size(result: Result) -> int:
    return record_size(result.job_id.encode(), result.to_json_bytes())


# -- cutting a Result down ----------------------------------------------------------------------
def test_a_result_that_fits_goes_whole():
    result = _result()
    fitted = fit_result(result, _size(result))
    assert fitted.how is None and fitted.result is result and fitted.value == result.to_json_bytes()


def test_logprobs_are_dropped_first():
    result = _result()
    no_logprobs = result.model_copy(update={"logprobs": None})
    fitted = fit_result(result, _size(no_logprobs) + 30)  # room for "truncated": true
    assert fitted.how == CUT_LOGPROBS
    wire = json.loads(fitted.value)
    assert "logprobs" not in wire and wire["truncated"] is True and wire["text"] == result.text
    assert wire["token_ids"] == result.token_ids and wire["status"] == "ok"


def test_then_the_text_past_what_fits_is_cut():
    result = _result(text="0123456789" * 100)
    bare = result.model_copy(update={"logprobs": None, "text": "", "truncated": True})
    limit = _size(bare) + 333
    fitted = fit_result(result, limit)
    assert fitted.how == CUT_TEXT
    wire = json.loads(fitted.value)
    assert record_size(b"big-1", fitted.value) <= limit < record_size(
        b"big-1", fitted.result.model_copy(update={"text": result.text[: len(wire["text"]) + 1]}).to_json_bytes())
    assert result.text.startswith(wire["text"]) and 300 < len(wire["text"]) < 1000
    assert wire["truncated"] is True and wire["token_ids"] == result.token_ids  # ids and usage stay whole
    assert wire["usage"]["completion_tokens"] == 40


def test_a_result_whose_token_ids_alone_do_not_fit_becomes_a_result_too_large_error():
    result = _result(n_tokens=2000, text="x" * 100, metadata={"run": 3})
    fitted = fit_result(result, 3000)
    assert fitted.how == CUT_REPLACED and record_size(b"big-1", fitted.value) <= 3000
    wire = json.loads(fitted.value)
    assert wire["status"] == "error" and wire["error"]["code"] == ERROR_RESULT_TOO_LARGE
    assert "max.message.bytes 3000" in wire["error"]["message"] and "2000 token ids" in wire["error"]["message"]
    assert wire["metadata"] == {"run": 3} and wire["usage"]["completion_tokens"] == 2000
    assert wire["attempt"] == result.attempt and wire["source"] == {"topic": "jobs", "partition": 0, "offset": 7}
    Result.model_validate_json(fitted.value)  # a valid Result still
    # ... and without its metadata when even that does not fit.
    big_meta = _result(n_tokens=2000, text="x", metadata={"blob": "m" * 9000})
    fitted = fit_result(big_meta, 3000)
    wire = json.loads(fitted.value)
    assert fitted.how == CUT_REPLACED and "metadata" not in wire and wire["truncated"] is True
    assert record_size(b"big-1", fitted.value) <= 3000


def test_an_error_or_expired_result_keeps_its_status_and_loses_only_metadata():
    err = answers.error_result("j", "invalid_job", "bad", model="m", worker="w", attempt="w-1",
                               metadata={"blob": "m" * 9000})
    fitted = fit_result(err, 2000)
    wire = json.loads(fitted.value)
    assert fitted.how == CUT_METADATA and wire["error"]["code"] == "invalid_job" and wire["truncated"] is True


def test_a_finished_job_too_large_for_the_results_topic_is_answered_and_dead_lettered():
    ctx = AnswerContext("m", "w", "results", "dlq", limits=TopicLimits({"results": 1500}))
    job = _job()
    answer = answers.finished(job, _final(1000, "y" * 50), ctx)
    dead, result = answer.records
    assert answer.outcome == "error" and answer.code == ERROR_RESULT_TOO_LARGE
    assert dict(dead.headers)["tokenmill.error.code"] == b"result_too_large" and dead.value == job.fetched.value
    assert result.cut == CUT_REPLACED and json.loads(result.value)["error"]["code"] == ERROR_RESULT_TOO_LARGE
    # A cut-down ok Result is still an ok answer, without a dead letter.
    ctx.limits = TopicLimits({"results": 4000})
    answer = answers.finished(job, _final(40, "y" * 50), ctx)
    assert answer.outcome == "ok" and [r.cut for r in answer.records] == [CUT_LOGPROBS]


def test_without_a_known_limit_kafkas_default_applies():
    ctx = AnswerContext("m", "w", "results", "dlq")
    answer = answers.finished(_job(), _final(40, "y"), ctx)
    assert answer.outcome == "ok" and answer.records[0].cut is None
    assert TopicLimits().of("results") == 1_048_588


# -- dead letters -------------------------------------------------------------------------------
def test_a_dead_letter_too_large_keeps_the_first_bytes_of_its_value_and_says_how_long_it_was():
    value = bytes(range(256)) * 40  # 10240 bytes
    rec = answers.dead_letter(b"k", value, "invalid_job", "bad", dlq_topic="dlq", source_topic="jobs", partition=0,
                              offset=3, dlq_partition=0, limit=4096)
    assert rec.cut == "dead_letter_value" and record_size(rec.key, rec.value, rec.headers) <= 4096
    assert value.startswith(rec.value) and len(rec.value) > 3000
    headers = dict(rec.headers)
    assert headers[HEADER_VALUE_ORIGINAL_BYTES] == b"10240" and headers["tokenmill.error.code"] == b"invalid_job"
    whole, cut = fit_dead_letter(OutRecord("dlq", b"k", b"small", []), 4096)
    assert not cut and whole.value == b"small"


# -- the producer's sizes -----------------------------------------------------------------------
def test_the_producer_sizes_follow_the_smallest_and_largest_limits():
    limits = TopicLimits({"results": 5000, "tokens": 2_000_000, "dlq": 1_048_588})
    assert limits.producer_kwargs() == {"max_request_size": 2_000_000, "max_batch_size": 5000}
    assert TopicLimits().producer_kwargs() == {"max_request_size": 1_048_588, "max_batch_size": 256 * 1024}
    # An unread topic counts with Kafka's default.
    assert TopicLimits({"results": 100_000}, unread=("dlq",)).producer_kwargs()["max_request_size"] == 1_048_588


# -- publish errors -----------------------------------------------------------------------------
def test_publish_errors_are_classified():
    assert refusal_of(MessageSizeTooLargeError()) == TOO_LARGE
    assert refusal_of(TopicAuthorizationFailedError("results")) == DENIED
    assert refusal_of(UnknownError()) == INVALID
    # Tried again: the broker away, a leader moving, a full buffer; and a lost sequence, which the
    # worker's producer mends by moving the topic to its plain producer.
    for retriable in (KafkaConnectionError(), NotLeaderForPartitionError(), KafkaTimeoutError(),
                      OutOfOrderSequenceNumber()):
        assert refusal_of(retriable) is None


class RefusingProducer:
    """send() fails with the given errors, in order, then succeeds; records what went out."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.sent: list[bytes] = []

    async def send(self, topic, value=None, key=None, headers=None, partition=None):
        fut = asyncio.get_running_loop().create_future()
        if self.errors:
            fut.set_exception(self.errors.pop(0))
        else:
            self.sent.append(value)
            fut.set_result(None)
        return fut


async def test_a_retriable_error_is_tried_again_as_it_was():
    producer, retries = RefusingProducer(NotLeaderForPartitionError()), []
    await send_acked(producer, OutRecord("t", b"k", b"v"), on_retry=lambda exc, n: retries.append(n),
                     max_backoff_s=0.01)
    assert producer.sent == [b"v"] and retries == [1]


async def test_a_record_the_broker_finds_too_large_is_sent_again_cut_down():
    result = _result()
    rec = answers.result_record(result, "results")  # no limit known: whole
    producer = RefusingProducer(MessageSizeTooLargeError())
    await send_acked(producer, rec)
    (sent,) = producer.sent
    assert len(sent) < len(rec.value) and "logprobs" not in json.loads(sent)
    assert json.loads(sent)["truncated"] is True


async def test_a_refusal_that_cutting_cannot_fix_raises_with_its_cause():
    producer = RefusingProducer(TopicAuthorizationFailedError("results"))
    with pytest.raises(PublishRefused) as exc:
        await send_acked(producer, answers.result_record(_result(), "results"))
    assert exc.value.reason == DENIED and "ACLs" in str(exc.value)
    assert access_denied(exc.value) is not None  # the worker's exit code for a missing ACL still applies
    # A record that cannot be cut (no shrink) is refused as well, never retried forever.
    producer = RefusingProducer(MessageSizeTooLargeError(), MessageSizeTooLargeError())
    with pytest.raises(PublishRefused):
        await send_acked(producer, OutRecord("t", b"k", b"v"))


# -- the token stream ---------------------------------------------------------------------------
async def test_token_events_the_topic_refuses_are_dropped_and_the_rest_confirmed():
    producer = RefusingProducer(MessageSizeTooLargeError(), NotLeaderForPartitionError())
    dropped: list[tuple[str, str]] = []
    stream = TokenStream(producer, "tokens", max_bytes=300, on_dropped=lambda job, why, exc: dropped.append((job, why)))
    stream.start()
    sink: list = []
    assert stream.publish("j", b"x" * 1000, sink) is False  # larger than the topic takes: never sent
    assert stream.publish("j", b"refused", sink) is True  # the broker refuses it for good
    stream.publish("j", b"retried", sink)  # the first try fails, the second is acknowledged
    stream.publish("j", b"fine", sink)
    await asyncio.wait_for(stream.confirm(sink), 10)
    await stream.stop()
    assert dropped == [("j", TOO_LARGE), ("j", TOO_LARGE)] and stream.dropped == 2
    assert producer.sent == [b"fine", b"retried"]  # "retried" went again after the first failure


async def test_a_send_refused_before_it_reaches_the_producer_drops_the_event():
    class ClientSideRefusal:
        async def send(self, topic, value=None, key=None, headers=None, partition=None):
            raise MessageSizeTooLargeError("larger than max_request_size")

    dropped = []
    stream = TokenStream(ClientSideRefusal(), "tokens", on_dropped=lambda job, why, exc: dropped.append(why))
    stream.start()
    sink: list = []
    stream.publish("j", b"event", sink)
    await asyncio.wait_for(stream.confirm(sink), 5)  # no endless retry
    await stream.stop()
    assert dropped == [TOO_LARGE] and sink == []


# -- readers of Results -------------------------------------------------------------------------
def test_result_readers_take_a_truncated_result_and_a_result_too_large_error():
    from tokenmill.schemas.openai_batch import openai_batch_output_line
    from tokenmill.tools.backfill.output import output_row
    from tokenmill.tools.backfill.store import StoredRow
    from tokenmill.tools.tail import format_result

    cut = json.loads(fit_result(_result(), 900).value)
    replaced = json.loads(fit_result(_result(n_tokens=3000, text="z"), 3000).value)
    assert cut["truncated"] is True and replaced["error"]["code"] == ERROR_RESULT_TOO_LARGE
    for wire in (cut, replaced):
        Result.model_validate(wire)
        assert wire["job_id"] in format_result(wire)
        row = output_row(StoredRow(0, wire["job_id"], "k", False, 1.0, 2.0, wire))
        assert row["status"] == wire["status"]
    assert "result_too_large" in format_result(replaced)
    line = openai_batch_output_line(Result.model_validate(replaced), "/v1/completions")
    assert line["response"]["status_code"] == 500 and line["response"]["body"]["error"]["code"] == "result_too_large"
