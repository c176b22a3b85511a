"""The worker's delivery steps one at a time, each against fakes of its neighbours (no broker, no
model): answer building, intake, the in-flight jobs and the tenant cap, engine output, fetching
and pausing, both delivery modes, the commit loop's lag, and a rebalance."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError, ProducerFenced

from tests.worker_helpers import FakeEngineThread
from tokenmill.engine.types import ErrorKind, FinishReason, RequestDelta, Timing, Usage
from tokenmill.kafka import answers
from tokenmill.kafka.answers import AnswerContext
from tokenmill.kafka.backpressure import BackpressureGate, BackpressurePolicy
from tokenmill.kafka.commit_loop import CommitLoop
from tokenmill.kafka.delivery import AtLeastOnce, ExactlyOnce, OffsetDone
from tokenmill.kafka.engine_output import EngineOutput
from tokenmill.kafka.fetch import Fetcher
from tokenmill.kafka.guard import BadInputGuard
from tokenmill.kafka.inflight import InFlight
from tokenmill.kafka.intake import Intake
from tokenmill.kafka.offsets import OffsetTracker
from tokenmill.kafka.rebalance import Rebalance
from tokenmill.kafka.retry import KafkaRetry
from tokenmill.kafka.tenants import TenantLimiter
from tokenmill.kafka.types import Answer, Fetched, InFlightJob
from tokenmill.metrics import HealthState, WorkerMetrics
from tokenmill.schemas.decode import decode_job

TP = TopicPartition("jobs", 1)
LOG = structlog.get_logger("test")


def _ctx(dlq_partitions: int = 0) -> AnswerContext:
    return AnswerContext(model="m", worker="w", results_topic="results", dlq_topic="dlq",
                         dlq_partitions=dlq_partitions)


def _fetched(offset: int = 5, value: bytes | None = b"{}", epoch: int = 1, tp: TopicPartition = TP) -> Fetched:
    return Fetched(tp, epoch, offset, b"key", value)


def _job(offset: int = 5, epoch: int = 1, tp: TopicPartition = TP, **fields) -> InFlightJob:
    body = {"job_id": f"j{offset}", "prompt": "hi", **fields}
    raw = json.dumps(body).encode()
    return InFlightJob(_fetched(offset, raw, epoch, tp), decode_job(raw), f"w-{offset}", LOG)


def _final(request_id: str = "r", **over) -> RequestDelta:
    fields = dict(finished=True, finish_reason=FinishReason.STOP, usage=Usage(2, 2, 0), timing=Timing(1, 2, 3, 4),
                  output_token_ids=[5, 6], output_text="ab")
    fields.update(over)
    return RequestDelta(request_id, [6], "b", **fields)


def _tracked(tracker: OffsetTracker, tp: TopicPartition, *offsets: int) -> int:
    epoch = tracker.assign([tp])[tp]
    for off in offsets:
        tracker.track(tp, epoch, off)
    return epoch


def _wire(record) -> dict:
    return json.loads(record.value)


# -- answer building (pure) ---------------------------------------------------------------------
def test_bad_input_is_a_dead_letter_plus_an_error_result_when_the_job_id_is_known():
    ans = answers.rejected(_fetched(value=b"raw"), "invalid_job", "bad", job_id="j1", attempt="w-1", metadata=None,
                           ctx=_ctx(dlq_partitions=4), log=LOG)
    dead, result = ans.records
    assert (dead.topic, dead.key, dead.value, dead.partition) == ("dlq", b"key", b"raw", 1)
    assert result.topic == "results" and _wire(result)["error"] == {"code": "invalid_job", "message": "bad"}
    assert _wire(result)["source"] == {"topic": "jobs", "partition": 1, "offset": 5}
    assert (ans.outcome, ans.code) == ("dead_letter", "invalid_job")
    unknown = answers.rejected(_fetched(), "invalid_job", "bad", job_id=None, attempt="w-1", metadata=None,
                               ctx=_ctx(), log=LOG)
    assert [r.topic for r in unknown.records] == ["dlq"] and unknown.records[0].partition is None


def test_a_dead_letter_keeps_its_partition_only_where_the_dead_letter_topic_has_it():
    assert answers.dlq_partition(2, 4) == 2
    assert answers.dlq_partition(4, 4) is None
    assert answers.dlq_partition(0, 0) is None  # unknown yet: the producer's partitioner chooses


def test_an_engine_error_is_dead_lettered_before_its_error_result():
    job = _job()
    delta = _final(finish_reason=FinishReason.ERROR, error_kind=ErrorKind.PROMPT_TOO_LONG, error="too long",
                   output_token_ids=None, output_text=None)
    ans = answers.finished(job, delta, _ctx())
    assert [r.topic for r in ans.records] == ["dlq", "results"]
    assert dict(ans.records[0].headers)["tokenmill.error.code"] == b"prompt_too_long"
    assert (ans.outcome, ans.code) == ("error", "prompt_too_long")


def test_an_outcome_the_contract_cannot_express_becomes_an_internal_error_not_a_lost_answer():
    ans = answers.finished(_job(), _final(output_text=None), _ctx())  # ok, but no text: build_result refuses
    assert (ans.outcome, ans.code) == ("error", "internal")
    assert _wire(ans.records[-1])["status"] == "error"


def test_a_finished_job_is_answered_with_its_result():
    ans = answers.finished(_job(metadata={"a": 1}), _final(), _ctx())
    (record,) = ans.records
    wire = _wire(record)
    assert (wire["status"], wire["text"], wire["attempt"], wire["metadata"]) == ("ok", "ab", "w-5", {"a": 1})
    assert (ans.outcome, ans.code, ans.fetched.offset) == ("ok", None, 5)


# -- intake ---------------------------------------------------------------------------------------
def _intake(guard=None):
    got = SimpleNamespace(admitted=[], answered=[], tripped=[])
    intake = Intake(_ctx(), guard or BadInputGuard(0.9, 200), admit=got.admitted.append,
                    answer=got.answered.append, on_guard_tripped=got.tripped.append, log=LOG)
    return intake, got


def test_intake_admits_a_valid_job_with_a_fresh_attempt():
    intake, got = _intake()
    intake.take(_fetched(value=b'{"job_id": "a", "prompt": "hi", "model": "m"}'))
    (job,) = got.admitted
    assert job.job.job_id == "a" and job.attempt.startswith("w-") and job.fetched.offset == 5
    assert got.answered == []


@pytest.mark.parametrize("value, code, with_result", [
    (b"{not json", "invalid_job", False),
    (None, "invalid_job", False),
    (b'{"job_id": "a", "prompt": "hi", "model": "other"}', "model_mismatch", True),
])
def test_intake_answers_bad_input_at_once(value, code, with_result):
    intake, got = _intake()
    intake.take(_fetched(value=value))
    (ans,) = got.answered
    assert (ans.outcome, ans.code) == ("dead_letter", code)
    assert len(ans.records) == (2 if with_result else 1) and got.admitted == []


def test_intake_answers_a_passed_deadline_with_expired():
    intake, got = _intake()
    past = int(time.time() * 1000) - 1000
    intake.take(_fetched(value=json.dumps({"job_id": "a", "prompt": "hi", "deadline_ms": past}).encode()))
    (ans,) = got.answered
    assert ans.outcome == "expired" and _wire(ans.records[0])["status"] == "expired"


def test_intake_trips_the_guard_when_most_inputs_are_bad():
    intake, got = _intake(BadInputGuard(max_ratio=0.5, window=4))
    for _ in range(3):
        intake.take(_fetched(value=b"nope"))
    assert got.tripped == []
    intake.take(_fetched(value=b"nope"))
    assert len(got.tripped) == 1 and "4 of the last 4 inputs were invalid" in got.tripped[0]


# -- in-flight jobs and the tenant cap ---------------------------------------------------------
def _inflight(cap: int):
    thread, refused = FakeEngineThread(), []
    inflight = InFlight(TenantLimiter(cap), thread, on_refused=lambda job, why: refused.append((job, why)))
    return inflight, thread, refused


def test_a_tenant_over_its_cap_waits_in_fetch_order_and_takes_freed_slots():
    inflight, thread, _ = _inflight(cap=1)
    a, b, c = (_job(i, tenant="t") for i in range(3))
    for job in (a, b, c):
        inflight.admit(job)
    assert thread.submitted == [a.attempt] and len(inflight) == 3
    inflight.finish(a)
    assert thread.submitted == [a.attempt, b.attempt]
    inflight.abandon(c)  # held: nothing to abort; its turn passes on
    inflight.finish(b)
    assert thread.submitted == [a.attempt, b.attempt] and thread.aborted == [] and len(inflight) == 0


def test_abandoning_a_partition_aborts_its_running_jobs_and_drops_its_held_ones():
    inflight, thread, _ = _inflight(cap=1)
    other = TopicPartition("jobs", 2)
    mine, held, theirs = _job(0, tenant="t"), _job(1, tenant="t"), _job(2, tp=other)
    for job in (mine, held, theirs):
        inflight.admit(job)
    assert inflight.abandon_where(lambda job: job.fetched.tp == TP) == 2
    assert thread.aborted == [mine.attempt] and inflight.tenants.held == 0
    assert inflight.get(theirs.request_id) is theirs


def test_a_job_the_engine_refuses_is_handed_back_and_frees_its_slot():
    inflight, thread, refused = _inflight(cap=1)
    bad, nxt = _job(0, tenant="t"), _job(1, tenant="t")
    bad.job.sampling = bad.job.sampling.model_copy(update={"top_p": 0.0})  # past the schema, refused by the engine
    inflight.admit(bad)
    inflight.admit(nxt)
    assert [job for job, _ in refused] == [bad] and "top_p" in refused[0][1]
    assert thread.submitted == [nxt.attempt] and inflight.get(bad.request_id) is None


# -- engine output ----------------------------------------------------------------------------
class FakeTokens:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.confirmed: list[list] = []

    def publish(self, job_id: str, payload: bytes, sink: list) -> bool:
        self.events.append(json.loads(payload))
        return True

    async def confirm(self, sink: list, still_wanted=lambda: True) -> None:
        self.confirmed.append(sink)


async def test_a_streaming_job_gets_gap_free_token_events_then_its_answer():
    inflight, _, _ = _inflight(cap=0)
    job = _job(stream=True)
    tracker = OffsetTracker(10)
    _tracked(tracker, TP, 5)
    tokens, delivered, recorded, tasks = FakeTokens(), [], [], []

    async def deliver(answer: Answer) -> None:
        delivered.append(answer)

    output = EngineOutput(inflight, tokens, tracker, _ctx(), WorkerMetrics(), record_input=recorded.append,
                          deliver=deliver, spawn=lambda coro, name: tasks.append(asyncio.ensure_future(coro)))
    inflight.admit(job)
    output.take([RequestDelta(job.request_id, [5], "a"), RequestDelta("gone", [1], "x")])
    output.take([_final(job.request_id)])
    await asyncio.gather(*tasks)
    assert [(e["index"], e["finished"]) for e in tokens.events] == [(0, False), (1, True)]
    assert tokens.confirmed == [job.token_sink] and len(inflight) == 0
    assert [a.outcome for a in delivered] == ["ok"] and recorded == []


async def test_an_engine_error_that_makes_the_input_bad_is_counted_by_the_guard_again():
    inflight, _, _ = _inflight(cap=0)
    job = _job()
    recorded, tasks = [], []

    async def deliver(answer: Answer) -> None:
        pass

    output = EngineOutput(inflight, FakeTokens(), OffsetTracker(10), _ctx(), WorkerMetrics(),
                          record_input=recorded.append, deliver=deliver,
                          spawn=lambda coro, name: tasks.append(asyncio.ensure_future(coro)))
    inflight.admit(job)
    output.take([_final(job.request_id, finish_reason=FinishReason.ERROR, error_kind=ErrorKind.INVALID_REQUEST,
                        error="token id out of range", output_token_ids=None, output_text=None)])
    await asyncio.gather(*tasks)
    assert recorded == ["invalid_job"]


# -- fetching and pausing ---------------------------------------------------------------------
class FakeConsumer:
    def __init__(self, assigned=(TP,)) -> None:
        self.assigned = set(assigned)
        self.paused_set: set[TopicPartition] = set()
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.commits: list[dict] = []
        self.fail_commit = False
        self.highwaters: dict[TopicPartition, int] = {}
        self.committed_offsets: dict[TopicPartition, int | None] = {}

    def assignment(self):
        return set(self.assigned)

    def paused(self):
        return set(self.paused_set)

    def pause(self, *tps):
        self.paused_set |= set(tps)

    def resume(self, *tps):
        self.paused_set -= set(tps)

    def seek(self, tp, offset):
        self.seeks.append((tp, offset))

    def highwater(self, tp):
        return self.highwaters.get(tp)

    async def commit(self, offsets):
        if self.fail_commit:
            raise KafkaConnectionError("broker away")
        self.commits.append(dict(offsets))

    async def committed(self, tp):
        return self.committed_offsets.get(tp)

    async def beginning_offsets(self, tps):
        return {tp: 0 for tp in tps}


def _fetcher(max_span: int = 4, gate=None):
    tracker, consumer, taken = OffsetTracker(max_span), FakeConsumer(), []
    fetcher = Fetcher(consumer, tracker, gate or BackpressureGate(BackpressurePolicy()), take=taken.append,
                      stopping=lambda: False, max_records=100, metrics=WorkerMetrics(), health=HealthState(), log=LOG)
    return fetcher, tracker, consumer, taken


def _rec(offset: int):
    return SimpleNamespace(offset=offset, key=None, value=b"{}")


def test_fetch_tracks_records_until_the_span_is_full():
    fetcher, tracker, _, taken = _fetcher(max_span=2)
    tracker.assign([TP])
    tracker.expect_from(TP, 10)
    assert fetcher._track(TP, _rec(9))  # below this epoch's start: skipped
    assert fetcher._track(TP, _rec(10)) and fetcher._track(TP, _rec(11))
    assert not fetcher._track(TP, _rec(12))  # the span cap: to be fetched again
    assert [f.offset for f in taken] == [10, 11] and tracker.in_flight(TP) == 2
    assert fetcher.first_fetch_at is not None


def test_fetch_takes_nothing_from_a_partition_being_revoked_or_not_owned():
    fetcher, tracker, _, taken = _fetcher()
    assert fetcher._track(TP, _rec(0))  # not owned
    tracker.assign([TP])
    tracker.get(TP).revoking = True
    assert fetcher._track(TP, _rec(0))
    assert taken == [] and tracker.in_flight() == 0


def test_a_span_paused_partition_resumes_once_its_span_has_halved():
    fetcher, tracker, consumer, _ = _fetcher(max_span=4)
    epoch = _tracked(tracker, TP, 0, 1, 2, 3)
    consumer.pause(TP)
    fetcher.span_paused.add(TP)
    tracker.complete(TP, epoch, 0)  # span 3 of 4
    fetcher.update_pausing()
    assert consumer.paused() == {TP}
    tracker.complete(TP, epoch, 1)  # span 2: half
    fetcher.update_pausing()
    assert consumer.paused() == set() and fetcher.span_paused == set()


def test_backpressure_pauses_every_partition_with_hysteresis():
    gate = BackpressureGate(BackpressurePolicy(waiting_high=10, waiting_low=5))
    fetcher, _, consumer, _ = _fetcher(gate=gate)
    assert fetcher.engine_load(waiting=10, kv_usage=0.0)  # the gate moved
    fetcher.update_pausing()
    assert consumer.paused() == {TP}
    assert not fetcher.engine_load(waiting=7, kv_usage=0.0)
    assert fetcher.engine_load(waiting=5, kv_usage=0.0)
    fetcher.update_pausing()
    assert consumer.paused() == set()


# -- delivery -----------------------------------------------------------------------------------
class FakeProducer:
    def __init__(self, failures: int = 0) -> None:
        self.sent: list[tuple[str, bytes | None]] = []
        self.failures = failures
        self.transactions: list[list] = []
        self.fenced = False
        self.started = self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def send(self, topic, value=None, key=None, headers=None, partition=None):
        if self.failures:
            self.failures -= 1
            raise KafkaConnectionError("broker away")
        self.sent.append((topic, value))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def begin_transaction(self) -> None:
        self.sent = []

    async def send_offsets_to_transaction(self, offsets, group_id) -> None:
        self.offsets = offsets

    async def commit_transaction(self) -> None:
        if self.fenced:
            raise ProducerFenced()
        self.transactions.append([*self.sent, ("offsets", self.offsets)])

    async def abort_transaction(self) -> None:
        pass


def _answer(offset: int, epoch: int, *values: bytes) -> Answer:
    records = [answers.OutRecord("results", b"k", v) for v in values]
    return Answer(_fetched(offset, epoch=epoch), records, "ok", None, LOG)


async def test_the_last_step_completes_the_offset_counts_it_and_ignores_a_stale_epoch():
    tracker, metrics = OffsetTracker(10), WorkerMetrics()
    done = OffsetDone(tracker, metrics)
    old = _tracked(tracker, TP, 5)
    new = _tracked(tracker, TP, 5)  # revoked and assigned again
    done.submit(_answer(5, old))
    assert tracker.in_flight(TP) == 1 and done.answered == 0
    done.submit(_answer(5, new))
    assert tracker.in_flight(TP) == 0 and done.answered == 1 and metrics.jobs_ok._value.get() == 1
    assert await done.settle([TP], timeout_s=0.1) == 0


async def test_settle_waits_for_answers_and_gives_up_at_its_deadline():
    tracker = OffsetTracker(10)
    done = OffsetDone(tracker, WorkerMetrics())
    epoch = _tracked(tracker, TP, 1, 2)
    asyncio.get_running_loop().call_later(0.05, done.submit, _answer(1, epoch))
    t0 = time.monotonic()
    assert await done.settle(None, timeout_s=0.3) == 1
    assert 0.25 < time.monotonic() - t0 < 2
    assert await done.settle(None, timeout_s=5, give_up=lambda: True) == 1


async def test_at_least_once_completes_the_offset_only_after_every_record_was_acknowledged():
    tracker, producer, consumer = OffsetTracker(10), FakeProducer(failures=1), FakeConsumer()
    done = OffsetDone(tracker, WorkerMetrics())
    step = AtLeastOnce(producer, consumer, tracker, done, LOG, on_retry=lambda exc, n: None)
    epoch = _tracked(tracker, TP, 4, 5)
    await step.submit(_answer(4, epoch, b"dead letter", b"result"))  # the first send fails once, retried
    assert producer.sent == [("results", b"dead letter"), ("results", b"result")]
    assert tracker.get(TP).commit_point() == 5
    await step.commit([TP])
    assert consumer.commits == [{TP: 5}] and tracker.get(TP).last_committed == 5
    await step.commit([TP])  # nothing moved: nothing sent
    assert len(consumer.commits) == 1


async def test_at_least_once_drops_an_answer_whose_partition_is_gone():
    tracker = OffsetTracker(10)
    step = AtLeastOnce(FakeProducer(), FakeConsumer(), tracker, OffsetDone(tracker, WorkerMetrics()), LOG,
                       on_retry=lambda exc, n: None)
    epoch = _tracked(tracker, TP, 4)
    tracker.revoke([TP])
    await step.submit(_answer(4, epoch, b"result"))
    assert step.producer.sent == []


async def test_a_failed_offset_commit_is_tried_again_later():
    tracker, consumer = OffsetTracker(10), FakeConsumer()
    step = AtLeastOnce(FakeProducer(), consumer, tracker, OffsetDone(tracker, WorkerMetrics()), LOG,
                       on_retry=lambda exc, n: None)
    _tracked(tracker, TP, 3)
    consumer.fail_commit = True
    await step.commit([TP])
    assert tracker.get(TP).last_committed is None
    consumer.fail_commit = False
    await step.commit([TP])
    assert consumer.commits == [{TP: 3}]


async def _exactly_once(tracker, fenced):
    """An ExactlyOnce step that owns TP, with offsets 0 and 1 in flight."""
    producers: list[FakeProducer] = []

    def factory(txn_id: str) -> FakeProducer:
        producers.append(FakeProducer())
        return producers[-1]

    retry = KafkaRetry(LOG, give_up=lambda why: None)
    step = ExactlyOnce("g", factory, tracker, OffsetDone(tracker, WorkerMetrics()), LOG, retry, on_fenced=fenced.append)
    await step.partition_assigned(TP)
    return step, producers, _tracked(tracker, TP, 0, 1)


async def test_exactly_once_stages_answers_and_commits_them_with_the_offset_in_one_transaction():
    tracker, fenced = OffsetTracker(10), []
    step, producers, epoch = await _exactly_once(tracker, fenced)
    await step.submit(_answer(1, epoch, b"r1"))
    await step.submit(_answer(0, epoch, b"r0"))
    assert tracker.in_flight(TP) == 0 and producers[0].sent == []  # staged, not sent
    await step.commit([TP])
    assert producers[0].transactions == [[("results", b"r0"), ("results", b"r1"), ("offsets", {TP: 2})]]
    assert tracker.get(TP).last_committed == 2


async def test_exactly_once_hands_a_fenced_partition_over_and_stages_nothing_more_for_it():
    tracker, fenced = OffsetTracker(10), []
    step, producers, epoch = await _exactly_once(tracker, fenced)
    await step.submit(_answer(0, epoch, b"r0"))
    producers[0].fenced = True  # another worker initialised the partition's transactional id
    await step.commit([TP])
    assert fenced == [TP] and producers[0].transactions == [] and producers[0].stopped
    await step.submit(_answer(1, epoch, b"late"))
    assert tracker.in_flight(TP) == 1  # not staged, not complete: the new owner answers it
    await step.close()


# -- commit loop --------------------------------------------------------------------------------
def test_commit_lag_counts_records_past_the_committed_offset_and_is_removed_on_revoke():
    tracker, consumer, metrics = OffsetTracker(10), FakeConsumer(), WorkerMetrics()
    _tracked(tracker, TP, 3, 4)
    consumer.highwaters[TP] = 10
    loop = CommitLoop(1.0, tracker, None, consumer, metrics, LOG, describe_fetch=dict)
    loop.update_lag()
    assert metrics.commit_lag.labels("jobs", "1")._value.get() == 7  # commit point 3, nothing committed yet
    tracker.get(TP).mark_committed(4)
    loop.update_lag()
    assert metrics.commit_lag.labels("jobs", "1")._value.get() == 6
    loop.forget([TP])
    assert 'partition="1"' not in "".join(str(s) for m in metrics.registry.collect() for s in m.samples
                                          if s.name == "tokenmill_commit_lag")


def test_the_oldest_unfinished_job_age_follows_the_lowest_unanswered_offset_per_partition():
    tracker, consumer, metrics = OffsetTracker(10), FakeConsumer(), WorkerMetrics()
    tracker.assign([TP])
    tracker.expect_from(TP, 3)
    epoch = tracker.epoch(TP)
    for offset, stamp in ((3, 10_000), (4, 40_000), (5, 50_000)):
        tracker.track(TP, epoch, offset, timestamp_ms=stamp)
    loop = CommitLoop(1.0, tracker, None, consumer, metrics, LOG, describe_fetch=dict)

    def age() -> float:
        return metrics.oldest_job_age.labels("jobs", "1")._value.get()

    loop.update_lag(now_ms=70_000)
    assert age() == 60.0  # offset 3, written at 10 s
    tracker.complete(TP, epoch, 4)
    loop.update_lag(now_ms=71_000)
    assert age() == 61.0  # 4 finished first: 3 is still the oldest
    tracker.complete(TP, epoch, 3)
    loop.update_lag(now_ms=72_000)
    assert age() == 22.0  # now 5, written at 50 s
    tracker.complete(TP, epoch, 5)
    loop.update_lag(now_ms=73_000)
    assert age() == 0.0  # nothing taken is unanswered
    loop.forget([TP])
    assert not [s for m in metrics.registry.collect() for s in m.samples
                if s.name == "tokenmill_oldest_unfinished_job_age_seconds"]


# -- rebalance ----------------------------------------------------------------------------------
class GroupConsumer(FakeConsumer):
    """A FakeConsumer in a group: a generation, and commits the broker keeps."""

    def __init__(self, assigned=(TP,)) -> None:
        super().__init__(assigned)
        self._coordinator = SimpleNamespace(generation=1)

    async def commit(self, offsets):
        await super().commit(offsets)
        self.committed_offsets.update({tp: v if isinstance(v, int) else v[0] for tp, v in offsets.items()})


def _rebalance(revoke_grace_s: float = 0.0):
    from tokenmill.config import WorkerSettings
    from tokenmill.engine.config import EngineConfig

    settings = WorkerSettings(bootstrap_servers="h:1", engine=EngineConfig(model="m"), jobs_topic="jobs",
                              revoke_grace_s=revoke_grace_s)
    tracker, consumer, health, forgotten = OffsetTracker(10), GroupConsumer(), HealthState(), []
    consumer.committed_offsets[TP] = 7
    done = OffsetDone(tracker, WorkerMetrics())
    delivery = AtLeastOnce(FakeProducer(), consumer, tracker, done, LOG, on_retry=lambda exc, n: None)
    inflight, thread, _ = _inflight(cap=0)
    rebalance = Rebalance(settings, consumer, tracker, delivery, done, inflight,
                          retry=KafkaRetry(LOG, give_up=lambda why: None), stopping=lambda: False,
                          forget=forgotten.append, health=health, log=LOG)
    return SimpleNamespace(rebalance=rebalance, tracker=tracker, consumer=consumer, health=health, done=done,
                           forgotten=forgotten, inflight=inflight, thread=thread)


async def _running(r, other: TopicPartition):
    """TP and other assigned; TP has offsets 7 (answered) and 8 (a job in the engine)."""
    await r.rebalance.on_partitions_assigned({TP, other, TopicPartition("elsewhere", 0)})
    assert sorted(r.consumer.seeks) == [(TP, 7), (other, 0)] and r.health.group_joined
    assert not r.tracker.get(TP).accepts(6) and r.tracker.get(TP).accepts(7)
    epoch = r.tracker.epoch(TP)
    r.tracker.track(TP, epoch, 7)
    r.tracker.track(TP, epoch, 8)
    job = _job(8, epoch=epoch)
    r.inflight.admit(job)
    r.done.submit(_answer(7, epoch))
    return job, epoch


async def _next_generation(r, revoked: set[TopicPartition], assigned: set[TopicPartition], step: int = 1) -> None:
    await r.rebalance.on_partitions_revoked(revoked)
    r.consumer._coordinator.generation += step
    r.consumer.seeks.clear()
    await r.rebalance.on_partitions_assigned(assigned)


async def test_a_revoke_commits_the_watermark_and_keeps_the_work_until_the_assignment_says_it_moved():
    r, other = _rebalance(), TopicPartition("jobs", 2)
    job, epoch = await _running(r, other)
    await r.rebalance.on_partitions_revoked({TP, other})
    assert r.consumer.commits == [{TP: 8}]  # the answered offset is committed, the unanswered one is not
    assert r.thread.aborted == [] and r.tracker.get(TP).revoking and r.tracker.committable() == []
    r.consumer._coordinator.generation += 1
    await r.rebalance.on_partitions_assigned({other})  # TP went to another member
    assert r.thread.aborted == [job.attempt] and r.tracker.get(TP) is None and r.forgotten == [{TP}]
    assert r.inflight.aborted == {job.attempt: (TP.partition, "rebalance")}
    assert r.consumer.commits == [{TP: 8}]  # nothing more committed for a partition that is not ours
    assert r.tracker.get(other) is not None and r.tracker.committable() == [other]


async def test_a_partition_that_comes_back_keeps_its_epoch_and_work_and_fetches_on_where_it_stopped():
    r, other = _rebalance(), TopicPartition("jobs", 2)
    job, epoch = await _running(r, other)
    await _next_generation(r, {TP, other}, {TP, other})
    assert r.thread.aborted == [] and r.inflight.get(job.attempt) is job and r.forgotten == []
    assert r.tracker.epoch(TP) == epoch and not r.tracker.get(TP).revoking
    assert sorted(r.consumer.seeks) == [(TP, 9), (other, 0)]  # past what was fetched: nothing twice
    r.done.submit(_answer(8, epoch))  # the kept job's answer completes its offset
    assert r.tracker.in_flight(TP) == 0 and r.tracker.get(TP).commit_point() == 9


async def test_a_partition_that_comes_back_changed_is_taken_anew():
    r, other = _rebalance(), TopicPartition("jobs", 2)
    job, epoch = await _running(r, other)
    await r.rebalance.on_partitions_revoked({TP, other})
    r.consumer.committed_offsets[TP] = 20  # another member had it meanwhile and committed
    r.consumer._coordinator.generation += 1
    r.consumer.seeks.clear()
    await r.rebalance.on_partitions_assigned({TP})
    assert r.thread.aborted == [job.attempt] and r.tracker.epoch(TP) != epoch
    assert r.consumer.seeks == [(TP, 20)] and r.forgotten == [{other}, {TP}]


async def test_a_partition_back_after_a_missed_generation_keeps_its_work_when_nothing_was_committed():
    r, other = _rebalance(), TopicPartition("jobs", 2)
    returned = []

    async def partition_returned(tp, reclaim):
        returned.append((tp, reclaim))

    r.rebalance.delivery.partition_returned = partition_returned
    job, epoch = await _running(r, other)
    await _next_generation(r, {TP, other}, {TP, other}, step=2)  # a join round went by without an assignment
    assert r.thread.aborted == [] and r.tracker.epoch(TP) == epoch
    assert sorted(returned) == [(TP, True), (other, True)]  # exactly-once takes the transactional ids back


async def test_a_revoke_grace_lets_in_flight_jobs_finish_before_the_commit():
    r, other = _rebalance(revoke_grace_s=1.0), TopicPartition("jobs", 2)
    job, epoch = await _running(r, other)
    asyncio.get_running_loop().call_later(0.05, r.done.submit, _answer(8, epoch))  # within the grace
    await r.rebalance.on_partitions_revoked({TP})
    assert r.consumer.commits == [{TP: 9}]


async def test_a_token_event_left_out_for_its_size_takes_no_index():
    # The stream stays gap-free: the event after a left-out one gets the index it would have had.
    class SmallTopic(FakeTokens):
        def publish(self, job_id: str, payload: bytes, sink: list) -> bool:
            return b"HUGE" not in payload and super().publish(job_id, payload, sink)

    inflight, _, _ = _inflight(cap=0)
    job = _job(stream=True)
    tracker = OffsetTracker(10)
    _tracked(tracker, TP, 5)
    tokens, tasks = SmallTopic(), []

    async def deliver(answer: Answer) -> None:
        pass

    output = EngineOutput(inflight, tokens, tracker, _ctx(), WorkerMetrics(), record_input=lambda code: None,
                          deliver=deliver, spawn=lambda coro, name: tasks.append(asyncio.ensure_future(coro)))
    inflight.admit(job)
    output.take([RequestDelta(job.request_id, [5], "a")])
    output.take([RequestDelta(job.request_id, [6], "HUGE")])
    output.take([_final(job.request_id)])
    await asyncio.gather(*tasks)
    assert [(e["index"], e["finished"]) for e in tokens.events] == [(0, False), (1, True)]
