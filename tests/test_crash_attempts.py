"""Crash attempts without a model: the metadata encoding, the per-partition counts, the start gate
(write-ahead, suspects alone, graceful ends), intake's dead letter, the budget on a refusal; and,
against the real broker, that the counts travel with a group commit and inside a transaction."""

from __future__ import annotations

import json
import random

import pytest
import structlog
from aiokafka import TopicPartition
from aiokafka.errors import OffsetMetadataTooLargeError
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker_helpers import FakeEngineThread
from tokenmill.engine.types import FinishReason, RequestDelta, Usage
from tokenmill.kafka.answers import AnswerContext
from tokenmill.kafka.attempts import (
    METADATA_BUDGET,
    AttemptCounts,
    AttemptsFormatError,
    decode_counts,
    encode_counts,
    read_committed,
)
from tokenmill.kafka.delivery import AtLeastOnce, OffsetDone
from tokenmill.kafka.guard import BadInputGuard
from tokenmill.kafka.inflight import InFlight
from tokenmill.kafka.intake import Intake
from tokenmill.kafka.offsets import OffsetTracker
from tokenmill.kafka.starts import StartGate
from tokenmill.kafka.tenants import TenantLimiter
from tokenmill.kafka.types import Fetched, InFlightJob
from tokenmill.metrics import WorkerMetrics
from tokenmill.schemas.decode import decode_job

TP = TopicPartition("jobs", 0)
LOG = structlog.get_logger("test")


# -- encoding -------------------------------------------------------------------------------------
def test_nothing_in_flight_is_empty_metadata_and_empty_metadata_is_no_counts():
    assert encode_counts(10, {}).metadata == ""
    assert encode_counts(10, {3: 1, 9: 2}).metadata == ""  # below the commit point: answered
    assert decode_counts(10, "") == {} and decode_counts(10, None) == {}


def test_a_block_of_jobs_in_flight_is_one_short_run_relative_to_the_commit_point():
    counts = {o: 1 for o in range(1000, 1200)} | {1200: 2, 1205: 3}
    text = encode_counts(1000, counts).metadata
    assert text == "tm1:0+200,0x2,4x3"
    assert decode_counts(1000, text) == counts


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**12), st.dictionaries(st.integers(0, 5000), st.integers(1, 9), max_size=300))
def test_counts_survive_the_round_trip(point, rel):
    counts = {point + o: c for o, c in rel.items()}
    encoded = encode_counts(point, counts)
    assert encoded.dropped == 0 and len(encoded.metadata) <= METADATA_BUDGET
    assert decode_counts(point, encoded.metadata) == counts


def test_long_scattered_counts_are_compressed_and_still_read_back():
    rng = random.Random(7)
    counts = {o: rng.choice((1, 1, 1, 2)) for o in rng.sample(range(100, 20_000), 1500)}
    encoded = encode_counts(100, counts)
    assert encoded.metadata.startswith("tm1z:") and encoded.dropped == 0
    assert len(encoded.metadata) <= METADATA_BUDGET
    assert decode_counts(100, encoded.metadata) == counts


def test_over_the_budget_the_lowest_counts_and_highest_offsets_are_left_out_first():
    ones = sorted(random.Random(5).sample(range(10, 100_000), 400))  # scattered: compression cannot help
    counts = {o: 1 for o in ones} | {1: 3, 3: 2}
    encoded = encode_counts(0, counts, budget=300)
    assert len(encoded.metadata) <= 300 and encoded.dropped > 0
    kept = decode_counts(0, encoded.metadata)
    assert kept[1] == 3 and kept[3] == 2  # the suspects stay
    kept_ones = sorted(o for o, c in kept.items() if c == 1)
    assert kept_ones and kept_ones == ones[: len(kept_ones)]  # the lowest offsets of count 1 stay
    assert len(kept) + encoded.dropped == len(counts)
    assert encode_counts(0, counts, budget=3).metadata == ""  # no room at all: no counts, commit still goes


@pytest.mark.parametrize("text", ["hello", "tm1:x", "tm1:1+0", "tm1:-3", "tm1z:!!!", "tm1:2,,3"])
def test_metadata_that_is_not_ours_is_refused_with_a_clear_error(text):
    with pytest.raises(AttemptsFormatError):
        decode_counts(0, text)


# -- per-partition counts ---------------------------------------------------------------------
def test_a_clean_or_graceful_end_gives_the_previous_count_back_and_an_answer_forgets_it():
    a = AttemptCounts()
    a.load({5: 1})
    assert not a.changed
    a.begin(5)
    a.begin(6)
    assert (a.count(5), a.count(6)) == (2, 1) and a.changed
    a.end(5)
    a.end(6)
    a.end(6)  # a second end changes nothing
    assert (a.count(5), a.count(6)) == (1, 0)
    a.forget(5)
    assert len(a) == 0
    encoded = a.encode(0)
    a.mark_committed(a.version)
    assert encoded.metadata == "" and not a.changed


# -- the start gate ---------------------------------------------------------------------------
class Harness:
    """InFlight -> StartGate -> a fake engine thread, on a tracker owning TP; `commit()` plays the
    commit loop (every partition's counts committed, then after_commit)."""

    def __init__(self, priors: dict[int, int] | None = None, max_attempts: int = 3) -> None:
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker(100)
        self.epoch = self.tracker.assign([TP])[TP]
        self.tracker.expect_from(TP, 0)
        self.tracker.get(TP).attempts.load(priors or {})
        self.thread = FakeEngineThread()
        self.wakes = 0
        self.gate = StartGate(self.thread, self.tracker, max_attempts, wake_commit=self._wake, log=LOG)
        self.inflight = InFlight(TenantLimiter(0), self.gate, on_refused=lambda job, why: None)
        self.gate.lookup = self.inflight.get
        self.jobs: dict[int, InFlightJob] = {}

    def _wake(self) -> None:
        self.wakes += 1

    def add(self, *offsets: int) -> None:
        for off in offsets:
            self.tracker.track(TP, self.epoch, off)
            raw = json.dumps({"job_id": f"j{off}", "prompt": "hi"}).encode()
            job = InFlightJob(Fetched(TP, self.epoch, off, None, raw), decode_job(raw), f"r{off}", LOG)
            self.jobs[off] = job
            self.inflight.admit(job)

    def commit(self) -> str:
        part = self.tracker.get(TP)
        snap = part.commit_snapshot()
        if snap is not None:
            part.mark_committed(snap.offset, snap.version)
        self.gate.after_commit()
        return snap.metadata if snap else "(nothing)"

    def finish(self, *offsets: int) -> None:
        deltas = [RequestDelta(f"r{o}", [], "", finished=True, finish_reason=FinishReason.STOP, usage=Usage())
                  for o in offsets]
        self.gate.take(deltas)
        for o in offsets:
            self.inflight.finish(self.jobs[o])

    def running(self) -> list[int]:
        return [int(r[1:]) for r in self.thread.submitted if r not in self.thread.aborted]

    def count(self, offset: int) -> int:
        return self.tracker.get(TP).attempts.count(offset)


def test_a_job_reaches_the_engine_only_after_a_commit_carried_its_attempt():
    h = Harness()
    h.add(0, 1, 2)
    assert h.thread.submitted == [] and h.wakes >= 1  # counted, waiting for the commit
    assert h.commit() == "tm1:0+3"
    assert h.running() == [0, 1, 2]
    h.finish(1)
    assert h.count(1) == 0 and h.commit() == "tm1:0,1"  # offset 1 ended cleanly: no longer counted


def test_a_suspect_waits_for_an_empty_engine_runs_alone_and_holds_back_later_jobs():
    h = Harness(priors={1: 2})  # offset 1 was in flight in two crashes: its third run is alone
    h.add(0, 1, 2)
    h.commit()
    assert h.running() == [0]  # 1 waits for 0 to leave the engine; 2 waits behind 1
    h.finish(0)
    assert h.commit() == "tm1:1x3" and h.running() == [0, 1]
    assert h.gate.solo_runs == 1
    h.finish(1)
    h.commit()
    assert h.running() == [0, 1, 2]


def test_one_earlier_crash_does_not_make_a_job_run_alone_with_the_default_limit():
    h = Harness(priors={0: 1, 1: 1})
    h.add(0, 1, 2)
    assert h.commit() == "tm1:0+2x2,0"
    assert h.running() == [0, 1, 2]


def test_with_a_limit_of_2_one_earlier_crash_is_enough_to_run_alone():
    h = Harness(priors={1: 1}, max_attempts=2)
    h.add(0, 1)
    h.commit()
    assert h.running() == [0]


def test_a_graceful_abort_gives_the_attempt_back_and_an_engine_failure_does_not():
    h = Harness(priors={2: 1})
    h.add(0, 1, 2)
    h.commit()
    h.inflight.abandon(h.jobs[0])  # revoked or drained: not a crash
    assert h.count(0) == 0 and h.thread.aborted == ["r0"]
    h.thread.alive = False  # the engine thread died with 1 and 2 in it
    h.inflight.abandon_where(lambda job: True)
    assert (h.count(1), h.count(2)) == (1, 2)
    assert h.commit() == "tm1:1,0x2"


def test_with_the_limit_0_the_gate_passes_jobs_straight_through():
    h = Harness(max_attempts=0)
    h.add(0, 1)
    assert h.running() == [0, 1] and h.wakes == 0 and h.count(0) == 0


# -- intake ---------------------------------------------------------------------------------------
def _intake(attempts: int, max_attempts: int = 3):
    admitted, answered, guard = [], [], BadInputGuard(0.5, 2)
    intake = Intake(AnswerContext("m", "w", "results", "dlq"), guard, admit=admitted.append,
                    answer=answered.append, on_guard_tripped=lambda why: None, log=LOG,
                    crash_attempts=lambda fetched: attempts, max_crash_attempts=max_attempts)
    raw = json.dumps({"job_id": "killer", "prompt": "hi", "metadata": {"k": 1}}).encode()
    intake.take(Fetched(TP, 1, 7, b"key", raw))
    return admitted, answered, guard


def test_a_job_at_its_crash_limit_is_dead_lettered_with_an_error_result_instead_of_run():
    admitted, (answer,), guard = _intake(attempts=3)
    assert admitted == [] and (answer.outcome, answer.code) == ("dead_letter", "crashed_worker")
    dead, result = answer.records
    assert (dead.topic, dead.key, dict(dead.headers)["tokenmill.error.code"]) == ("dlq", b"key", b"crashed_worker")
    wire = json.loads(result.value)
    assert (wire["job_id"], wire["status"], wire["error"]["code"]) == ("killer", "error", "crashed_worker")
    assert "3 times" in wire["error"]["message"] and wire["metadata"] == {"k": 1}
    assert guard.bad_ratio == 0.0  # valid input: not counted against the producer


@pytest.mark.parametrize("attempts, max_attempts", [(2, 3), (5, 0)])
def test_a_job_below_the_limit_or_with_the_limit_off_runs(attempts, max_attempts):
    admitted, answered, _ = _intake(attempts, max_attempts)
    assert len(admitted) == 1 and answered == []


# -- the metadata budget ------------------------------------------------------------------------
class RefusingConsumer:
    """Refuses metadata longer than `limit`, as a broker with a small offset.metadata.max.bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.commits: list[dict] = []

    async def commit(self, offsets) -> None:
        if any(isinstance(v, tuple) and len(v[1]) > self.limit for v in offsets.values()):
            raise OffsetMetadataTooLargeError()
        self.commits.append(dict(offsets))


async def test_a_broker_refusing_the_metadata_halves_the_budget_until_commits_go_through():
    tracker: OffsetTracker[TopicPartition] = OffsetTracker(200_000)
    epoch = tracker.assign([TP])[TP]
    part = tracker.get(TP)
    rng, off = random.Random(3), 0
    for _ in range(2000):  # scattered, so that compression does not make it small
        tracker.track(TP, epoch, off)
        for _ in range(rng.randint(1, 3)):
            part.attempts.begin(off)
        off += rng.randint(1, 60)
    consumer = RefusingConsumer(limit=100)
    step = AtLeastOnce(None, consumer, tracker, OffsetDone(tracker, WorkerMetrics()), LOG, on_retry=lambda e, n: None)
    for _ in range(12):
        await step.commit([TP])
        if consumer.commits:
            break
    (committed,) = consumer.commits
    assert step.budget.bytes <= 100 and part.last_committed == 0
    offset, metadata = committed[TP] if isinstance(committed[TP], tuple) else (committed[TP], "")
    assert offset == 0 and len(metadata) <= 100
    assert not part.attempts.changed and part.attempts.crowded


# -- against the real broker ------------------------------------------------------------------
@pytest.mark.kafka
async def test_the_counts_travel_with_a_group_commit_and_are_read_back_by_the_next_owner(kafka_bootstrap, new_topic):
    from aiokafka import AIOKafkaConsumer

    topic = new_topic(partitions=1)
    tp = TopicPartition(topic, 0)
    group = f"attempts-{topic}"
    counts = {o: 1 for o in range(40, 90)} | {95: 3}
    metadata = encode_counts(40, counts).metadata
    first = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    await first.start()
    try:
        first.assign([tp])
        await first.commit({tp: (40, metadata)})
        assert await read_committed(first, tp) == (40, metadata)
    finally:
        await first.stop()
    second = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    await second.start()
    try:
        offset, read = await read_committed(second, tp)
        assert offset == 40 and decode_counts(offset, read) == counts
        other = TopicPartition(topic + "-none", 0)
        assert await read_committed(second, other) == (None, "")
    finally:
        await second.stop()


@pytest.mark.kafka
async def test_the_counts_travel_inside_an_exactly_once_transaction(kafka_bootstrap, new_topic):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from tokenmill.kafka.transactions import PartitionTransactions

    topic = new_topic(partitions=1)
    tp = TopicPartition(topic, 0)
    group = f"attempts-eos-{topic}"

    def factory(txn_id: str) -> AIOKafkaProducer:
        return AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=txn_id, acks="all",
                                enable_idempotence=True)

    txn = PartitionTransactions(tp, group, factory, LOG)
    await txn.start()
    try:
        await txn.flush(12, "tm1:0+3,2x2")
        await txn.flush(12, "tm1:0+3,2x2")  # nothing moved: no second transaction
        assert txn.transactions == 1
        await txn.flush(13, "")
        assert (txn.last_committed, txn.last_metadata, txn.transactions) == (13, "", 2)
        await txn.flush(13, "tm1:4")
    finally:
        await txn.stop()
    reader = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    await reader.start()
    try:
        assert await read_committed(reader, tp) == (13, "tm1:4")
    finally:
        await reader.stop()
