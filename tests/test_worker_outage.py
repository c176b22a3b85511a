"""Long broker outages: a worker waits for a broker that is not there yet (up to
--broker-wait-timeout), and outlives one that goes away mid-run (not ready, intake paused,
nothing lost). The waiting and watching pieces alone first, then against a real broker of the
module's own that is stopped and started, with worker processes."""

from __future__ import annotations

import asyncio
import datetime
import json
import signal
import time
from types import SimpleNamespace

import pytest
import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

from tests.worker_helpers import (
    job,
    make_topics,
    produce,
    read_topic,
    results_by_job,
    start_worker_process,
    stop_process,
    worker_command,
)
from tokenmill.kafka.backpressure import BackpressureGate, BackpressurePolicy
from tokenmill.kafka.broker_watch import BrokerWatch
from tokenmill.kafka.fetch import Fetcher
from tokenmill.kafka.offsets import OffsetTracker
from tokenmill.kafka.retry import BrokerUnreachable, BrokerWait
from tokenmill.metrics import HealthState, WorkerMetrics

LOG = structlog.get_logger("test")
TP = TopicPartition("jobs", 0)


# -- the pieces -----------------------------------------------------------------------------------
class FlakyStart:
    def __init__(self, failures: int, error: BaseException | None = None) -> None:
        self.failures, self.calls = failures, 0
        self.error = error or KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]")

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "connected"


async def test_broker_wait_tries_again_with_backoff_until_a_broker_answers():
    ticks = []
    wait = BrokerWait("127.0.0.1:1", 10.0, asyncio.Event(), LOG, tick=lambda: ticks.append(1), first_delay_s=0.01)
    start = FlakyStart(failures=3)
    assert await wait.call(start, "admin client") == "connected"
    assert start.calls == 4 and len(ticks) >= 4  # the liveness probe is fed while waiting
    assert await wait.call(FlakyStart(failures=0), "consumer") == "connected"


async def test_broker_wait_gives_up_after_its_timeout_with_one_clear_message():
    wait = BrokerWait("127.0.0.1:1", 0.3, asyncio.Event(), LOG, first_delay_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(BrokerUnreachable) as caught:
        await wait.call(FlakyStart(failures=1000), "producer")
    assert time.monotonic() - t0 < 1.5
    message = str(caught.value)
    assert "no Kafka broker answered at 127.0.0.1:1 within 0.3s" in message and "--broker-wait-timeout" in message


async def test_broker_wait_ends_when_the_worker_is_stopped_and_passes_other_errors_on():
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, stop.set)
    assert await BrokerWait("h:1", 60.0, stop, LOG, first_delay_s=5.0).call(FlakyStart(1000), "producer") is None
    with pytest.raises(ValueError):  # not a connection problem: no waiting
        await BrokerWait("h:1", 60.0, asyncio.Event(), LOG).call(FlakyStart(1, ValueError("bad")), "producer")


class OneShotClient:
    """Like an aiokafka client: start() may be called once; the first client's start hangs (a
    join or a host that drops packets) or fails, later ones connect."""

    made: list[OneShotClient] = []

    def __init__(self, hang: bool, fail: bool = False) -> None:
        self.hang, self.fail = hang, fail
        self.starts = self.stops = 0
        OneShotClient.made.append(self)

    async def start(self) -> None:
        assert self.starts == 0, "Did you call `start` twice?"
        self.starts += 1
        if self.fail:
            raise KafkaConnectionError("refused")
        if self.hang:
            await asyncio.sleep(60)

    async def stop(self) -> None:
        self.stops += 1


@pytest.mark.parametrize("first", ["times out", "fails"])
async def test_a_start_that_timed_out_or_failed_is_closed_and_the_next_try_makes_a_new_client(first):
    OneShotClient.made = []
    wait = BrokerWait("h:1", 30.0, asyncio.Event(), LOG, first_delay_s=0.01, try_timeout_s=0.2)

    def make() -> OneShotClient:
        fresh = not OneShotClient.made
        return OneShotClient(hang=fresh and first == "times out", fail=fresh and first == "fails")

    client = await wait.start(make, "consumer")
    made = OneShotClient.made
    assert len(made) == 2 and client is made[1]
    assert [c.starts for c in made] == [1, 1]  # no client started twice
    assert made[0].stops == 1 and made[1].stops == 0  # the failed one closed, the live one kept


async def test_joining_a_slow_group_waits_the_rebalance_allowance_then_counts_as_an_outage():
    stop = asyncio.Event()
    joined = {"now": False}
    asyncio.get_running_loop().call_later(0.3, lambda: joined.update(now=True))
    ticks = []
    wait = BrokerWait("h:1", 0.0, stop, LOG, tick=lambda: ticks.append(1))
    # A join longer than a connection try is not an outage while within the allowance.
    assert await wait.join(lambda: joined["now"], rebalance_s=5.0, poll_s=0.02) is True
    assert ticks  # alive while joining
    t0 = time.monotonic()
    with pytest.raises(BrokerUnreachable, match="handed out no partitions"):
        await BrokerWait("h:1", 0.1, stop, LOG).join(lambda: False, rebalance_s=0.2, poll_s=0.02)
    assert 0.25 <= time.monotonic() - t0 < 2.0  # the allowance, then the broker wait timeout
    asyncio.get_running_loop().call_later(0.1, stop.set)
    assert await BrokerWait("h:1", 60.0, stop, LOG).join(lambda: False, rebalance_s=60.0, poll_s=0.02) is False


def test_readiness_says_the_worker_is_joining_while_it_joins():
    health = HealthState()
    health.model_loaded = True
    assert health.ready() == (False, "consumer group not joined")
    health.joining_since = time.monotonic() - 20
    ready, why = health.ready()
    assert not ready and why.startswith("joining the consumer group (2")


def test_broker_watch_reports_an_outage_once_and_how_long_it_lasted():
    changes = []
    watch = BrokerWatch(probe=None, on_change=changes.append, log=LOG)  # type: ignore[arg-type]
    watch.observe(True, now=1.0)
    watch.observe(False, now=10.0)
    watch.observe(False, now=12.0)
    assert watch.away_for(now=15.0) == 5.0
    watch.observe(True, now=25.0)
    assert changes == [False, True] and watch.outages == [15.0] and watch.away_for() == 0.0


async def test_broker_watch_counts_a_probe_that_hangs_or_fails_as_unreachable():
    async def hangs():
        await asyncio.sleep(10)

    async def fails():
        raise KafkaConnectionError("refused")

    for probe in (hangs, fails):
        watch = BrokerWatch(probe, on_change=lambda up: None, log=LOG, timeout_s=0.05)
        assert await watch._probe_once() is False


def test_readiness_is_false_while_no_broker_is_reachable():
    health = HealthState()
    health.model_loaded = health.group_joined = True
    assert health.ready() == (True, "ok")
    health.broker_reachable = False
    assert health.ready() == (False, "no broker reachable") and health.healthy()[0]  # alive all the same


class FakeConsumer:
    def __init__(self) -> None:
        self.paused_set: set[TopicPartition] = set()

    def assignment(self):
        return {TP}

    def paused(self):
        return set(self.paused_set)

    def pause(self, *tps):
        self.paused_set |= set(tps)

    def resume(self, *tps):
        self.paused_set -= set(tps)


def test_an_outage_pauses_intake_and_the_gauges_show_what_is_uncommitted():
    tracker, consumer, metrics = OffsetTracker(100), FakeConsumer(), WorkerMetrics()
    fetcher = Fetcher(consumer, tracker, BackpressureGate(BackpressurePolicy()), take=lambda f: None,
                      stopping=lambda: False, max_records=10, metrics=metrics, health=HealthState(), log=LOG)
    tracker.assign([TP])
    tracker.expect_from(TP, 40)
    for offset in (40, 41, 42):
        assert fetcher._track(TP, SimpleNamespace(offset=offset, key=None, value=b"{}"))
    epoch = tracker.epoch(TP)
    tracker.complete(TP, epoch, 40)
    fetcher.set_broker_away(True)
    assert consumer.paused() == {TP} and metrics.partitions_paused._value.get() == 1
    assert fetcher.uncommitted() == 3 and metrics.uncommitted._value.get() == 3  # nothing committed yet
    tracker.get(TP).mark_committed(41)
    fetcher.set_broker_away(False)
    assert consumer.paused() == set() and metrics.partitions_assigned._value.get() == 1
    assert fetcher.uncommitted() == 2 and fetcher.uncommitted([TopicPartition("jobs", 9)]) == 0


# -- against a real broker ------------------------------------------------------------------------
def _log_lines(path, event: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if f'"event": "{event}"' in line:
            out.append(json.loads(line))
    return out


def _ready(port: int) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@pytest.mark.kafka
def test_a_worker_gives_up_on_a_missing_broker_after_the_wait_timeout(tiny_llama_dir, tmp_path):
    from tokenmill.kafka.local_broker import free_port

    port = free_port()  # nothing listens there
    topics = SimpleNamespace(flags=lambda: [])
    log = tmp_path / "w.log"
    proc = start_worker_process(
        worker_command(f"127.0.0.1:{port}", topics, tiny_llama_dir, "--broker-wait-timeout", "6",
                       "--log-level", "INFO"), log)
    try:
        code = proc.wait(120)
    finally:
        stop_process(proc, signal.SIGKILL)
    ended = datetime.datetime.now(datetime.UTC)
    text = log.read_text(errors="replace")
    assert code == 5, text[-3000:]
    assert f"no Kafka broker answered at 127.0.0.1:{port} within 6s (--broker-wait-timeout" in text
    waits = _log_lines(log, "no broker reachable yet; waiting")
    assert len(waits) >= 3  # backoff: 0.5, 1, 2, 4 s ...
    first = datetime.datetime.fromisoformat(waits[0]["timestamp"])
    # The decision is timed from the worker's own log line; the process's exit after it (closing the
    # engine, the interpreter's teardown) is timed loosely, as a loaded machine can slow it.
    gave_up = datetime.datetime.fromisoformat(_log_lines(log, "worker stopping on error")[0]["timestamp"])
    assert (gave_up - first).total_seconds() < 6 + 2, "gave up well after the wait timeout"
    assert (ended - gave_up).total_seconds() < 30, "exited long after giving up"


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory):
    """A broker of this module only: its tests stop and start it."""
    from tokenmill.tools.chaos.broker import Broker

    broker = asyncio.run(Broker.start_local(tmp_path_factory.mktemp("outage-kafka")))
    try:
        yield broker
    finally:
        asyncio.run(broker.close())


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_worker_started_while_the_broker_is_down_waits_for_it_and_runs_jobs(own_broker, tiny_llama_dir,
                                                                                     tmp_path):
    from tokenmill.kafka.local_broker import free_port

    bootstrap = own_broker.bootstrap
    topics = await make_topics(bootstrap, "late-broker", partitions=2)
    await own_broker.stop()
    port, log = free_port(), tmp_path / "w.log"
    proc = start_worker_process(worker_command(bootstrap, topics, tiny_llama_dir, "--metrics-port", str(port),
                                               "--log-level", "INFO"), log)
    try:
        await asyncio.sleep(20)
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert await asyncio.to_thread(_ready, port) == 503  # alive, not ready
        await own_broker.start()
        jobs = [job(i, max_tokens=4) for i in range(40)]
        await produce(bootstrap, topics.jobs, jobs)
        records = await read_topic(bootstrap, topics.results, lambda r: len({x.key for x in r}) >= 40, timeout=120)
        assert proc.poll() is None
        assert stop_process(proc) == 0, log.read_text(errors="replace")[-3000:]
        proc = None
    finally:
        if proc is not None:
            stop_process(proc, signal.SIGKILL)
        if not (await asyncio.to_thread(own_broker.local.status)).running:
            await own_broker.start()
    results = results_by_job(records)
    assert sorted(results) == sorted(j["job_id"] for j in jobs)
    assert all(r["status"] == "ok" for v in results.values() for r in v)
    waits = _log_lines(log, "no broker reachable yet; waiting")
    connected = _log_lines(log, "broker reachable; connected")
    assert waits and connected and connected[0]["waited_s"] >= 15


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_two_minute_outage_mid_run_loses_nothing_and_the_worker_waits_it_out(own_broker, tmp_path):
    """`tokenmill chaos outage` with a 120 s outage: readiness false while the broker is away and
    true after, the worker process never exits, every job gets its Result."""
    from tokenmill.tools.chaos.scenarios import ChaosConfig, run_scenario

    config = ChaosConfig("outage", jobs=400, workers=1, max_tokens=48, partitions=2, outage_s=120.0,
                         drain_timeout_s=120.0, work_dir=tmp_path)
    report = await run_scenario(config, broker=own_broker)
    print("\n" + report.format())
    d = report.details
    assert report.lost == 0 and report.not_ok == 0, report.lost_ids
    assert report.unexpected_exits == [] and report.exit_codes == {"w1": 0}
    assert d["answered_at_stop"] < report.jobs * 0.9, "the outage should begin with jobs still to run"
    assert d["uncommitted_at_stop"] > 0, "the outage should begin with jobs in the worker"
    assert d["readiness_samples_during_outage"] >= 60 and d["ready_samples_during_outage"] == 0
    assert d["ready_again_s"] is not None and report.drain_s is not None and report.commit_lag == 0
    log = tmp_path / "w1.log"
    paused = _log_lines(log, "no broker reachable; intake paused, not ready")
    resumed = _log_lines(log, "broker reachable again; intake resumed")
    assert len(paused) >= 1 and len(resumed) >= 1 and resumed[-1]["away_s"] >= 100
    assert len(_log_lines(log, "model loaded")) == 1  # one engine, kept throughout
    # Failed metadata refreshes are paced (metadata_pacing.py): a few a second per client, not the
    # thousands a second of a client that retries at once (a core spinning through the outage).
    failed_refreshes = log.read_text(errors="replace").count("Unable to update metadata from")
    assert failed_refreshes < 1000, failed_refreshes
    print(f"outage recovery: broker back -> first new Result {report.first_result_s:.1f} s, "
          f"-> every job answered and commit lag 0 {report.drain_s:.1f} s, ready again {d['ready_again_s']:.1f} s")
