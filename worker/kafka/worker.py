"""The Kafka worker: consume jobs, run them in the engine thread, publish answers, commit watermarks.

This file is the wiring: it starts the clients and the engine thread, connects the steps below
(each is given the next one), runs the poll and commit tasks, handles SIGTERM/SIGINT and drains.

Life of one input record, with the file of each step:

1. fetch.py: the poll task (always polling, so aiokafka's max_poll_interval never trips) fetches
   it; the offset tracker (offsets.py) records it as outstanding under its partition's
   assignment epoch, unless the partition's in-flight span is full (then it is fetched again).
2. intake.py: it is decoded. Bad input (not JSON, schema violation, wrong model) is answered at
   once with a dead letter and, when a job_id can be read, an error Result; a deadline already
   passed with an `expired` Result. The bad-input guard (guard.py) counts every input. A job
   that was in the engine each time a worker died, --max-crash-attempts times, is answered
   with `crashed_worker` (attempts.py: the counts travel in the offset commit's metadata).
3. inflight.py: the job waits for a place in the engine, handed over round-robin across tenants
   and under each tenant's cap (tenants.py: fair admission), then starts.py counts
   its crash attempt, has the commit loop commit that count, and only then hands it to the
   engine thread (worker/runtime/engine_thread.py), which hands back deltas once per step; a
   suspect (in flight in earlier crashes) runs alone there.
4. engine_output.py: a streaming job gets one TokenEvent per step (publisher.py's ordered
   stream). When the job finishes, its TokenEvents are confirmed first, then
5. answers.py builds its answer (pure: the Result, with a dead letter for an engine error; cut
   down to the topics' size limits, read at start: sizing.py), and
6. delivery.py delivers it. At-least-once: once the broker acknowledged every record, the offset
   is complete. Exactly-once: the answer is staged into its partition's transaction
   (transactions.py) and the offset is complete at once.
7. commit_loop.py commits each partition's watermark (lowest outstanding offset) on an interval,
   as the delivery mode does it: a group offset commit, or the transaction with the staged
   answers. rebalance.py commits on revoke, the drain here at shutdown.

rebalance.py: a revoked partition's watermark is committed and its work kept until the new
assignment is known (the sticky assignor keeps most partitions where they were); a partition that
comes back goes on where it was, one that went elsewhere is aborted and left for its new owner;
anything of it that completes later carries a stale epoch and is dropped.

The broker away: at start, the clients are started once a broker answers, waiting up to
--broker-wait-timeout (retry.py's BrokerWait; then exit code 5 with the reason); each try is a
new client. The model loads on a thread meanwhile, so a worker started before its broker (a pod
scaled from zero) is ready as soon as the later of the two is; a load that fails stops the wait. The consumer connects first and joins the group after, with the patience a
rebalance needs (the session timeout plus the rebalance timeout) before that counts as an
outage; /readyz says "joining" meanwhile. While running,
broker_watch.py's probe marks the worker not ready and pauses intake during an outage, however
long; the engine and everything in flight are kept, answers wait in the publisher's retries.

The broker refusing us is not an outage: refused SASL credentials or an untrusted certificate
(checked before the model loads), or a missing ACL (the four topics are checked once the producer
is up; a group, topic or transactional id refused later, by the consumer, a fetch, a publish or
a transaction)
stop the worker at once with one message and exit code 76 (authentication) or 77 (authorization),
without retrying (security.py).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Coroutine
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from structlog.typing import FilteringBoundLogger

from tokenmill.config import WorkerSettings
from tokenmill.engine.types import EngineStats, RequestDelta
from tokenmill.kafka import clients
from tokenmill.kafka.answers import AnswerContext
from tokenmill.kafka.backpressure import BackpressureGate
from tokenmill.kafka.broker_watch import BrokerWatch
from tokenmill.kafka.commit_loop import CommitLoop
from tokenmill.kafka.delivery import AtLeastOnce, Delivery, ExactlyOnce, OffsetDone
from tokenmill.kafka.engine_output import EngineOutput
from tokenmill.kafka.fetch import Fetcher
from tokenmill.kafka.guard import BadInputGuard
from tokenmill.kafka.inflight import InFlight
from tokenmill.kafka.intake import Intake
from tokenmill.kafka.offsets import OffsetTracker
from tokenmill.kafka.publisher import PublishAbandoned, TokenStream, refusal_of
from tokenmill.kafka.rebalance import Rebalance
from tokenmill.kafka.registry import open_registry
from tokenmill.kafka.retry import BrokerUnreachable, BrokerWait, KafkaRetry
from tokenmill.kafka.security import (
    KafkaAccessDenied,
    access_denied,
    check_credentials,
    check_topic_access,
    start_checked,
)
from tokenmill.kafka.sizing import TopicLimits
from tokenmill.kafka.starts import StartGate
from tokenmill.kafka.tenants import TenantLimiter
from tokenmill.kafka.types import Answer, InFlightJob
from tokenmill.logging import get_logger
from tokenmill.metrics import HealthState, MetricsServer, WorkerMetrics
from tokenmill.runtime.engine_thread import EngineThread

if TYPE_CHECKING:
    from tokenmill.engine import Engine

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_BAD_INPUT = 3
EXIT_BROKER_UNREACHABLE = 5


class KafkaWorker:
    # Made by _assemble() once the model is loaded and the producer started: the steps of a
    # record's life, and the clients they share.
    producer: AIOKafkaProducer
    consumer: AIOKafkaConsumer
    tokens: TokenStream
    ctx: AnswerContext
    delivery: Delivery
    inflight: InFlight
    intake: Intake
    output: EngineOutput
    fetcher: Fetcher
    commits: CommitLoop
    rebalance: Rebalance
    starts: StartGate
    broker_watch: BrokerWatch

    def __init__(self, settings: WorkerSettings, engine: Engine | None = None,
                 log: FilteringBoundLogger | None = None) -> None:
        settings.validate()
        self.s = settings
        self.log: FilteringBoundLogger = (log or get_logger("tokenmill.worker")).bind(worker=settings.worker_name)
        self.engine = engine
        self.metrics = WorkerMetrics()
        self.health = HealthState()
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker(settings.max_inflight_per_partition)
        self.gate = BackpressureGate(settings.backpressure)
        self.guard = BadInputGuard(settings.bad_input_ratio, settings.bad_input_window)
        # Fair admission: a bounded number of jobs in the engine, the rest handed over by tenant in turn.
        self.tenants: TenantLimiter[InFlightJob] = TenantLimiter(
            settings.max_inflight_per_tenant, settings.engine_jobs_bound(), priority_of=_job_priority)
        self.limits = TopicLimits()  # the output topics' max.message.bytes, read at start
        self.done = OffsetDone(self.tracker, self.metrics)
        self.exit_code = EXIT_OK
        self.fatal_error: str | None = None  # why the worker stopped, when it was not asked to
        self.refused: KafkaAccessDenied | None = None  # the broker refused our credentials or an ACL is missing
        self.metrics_port: int | None = None
        self.served_model_name: str | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.engine_thread: EngineThread | None = None  # started once the steps are assembled

    @property
    def answered(self) -> int:
        """Inputs whose answer is durable (or staged, exactly-once), this process."""
        return self.done.answered

    @property
    def first_fetch_at(self) -> tuple[float, float] | None:
        """(perf_counter, process_time) when the first record was taken."""
        fetcher: Fetcher | None = getattr(self, "fetcher", None)
        return fetcher.first_fetch_at if fetcher else None

    @property
    def last_answer_at(self) -> tuple[float, float] | None:
        return self.done.last_answer_at

    # ---------------------------------------------------------------------------------------
    # start-up and shutdown
    def request_stop(self, reason: str = "signal") -> None:
        if not self._stop.is_set():
            self.log.info("stop requested; draining", reason=reason, in_flight=self.tracker.in_flight())
            self._stop.set()

    def _fail(self, message: str, code: int = EXIT_FATAL) -> None:
        if self.fatal_error is None:
            self.fatal_error = message
            self.exit_code = code
            self.log.error("worker stopping on error", error=message)
        self._stop.set()

    async def run(self, install_signal_handlers: bool = True) -> int:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if install_signal_handlers else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        server = None
        if self.s.metrics_port is not None:
            server = MetricsServer(self.metrics, self.health, self.s.metrics_host, self.s.metrics_port).start()
            self.metrics_port = server.port
            self.log.info("metrics endpoint up", port=server.port)
        self.log.info("worker starting", bootstrap=self.s.bootstrap_servers, group=self.s.group_id,
                      jobs_topic=self.s.jobs_topic, exactly_once=self.s.exactly_once,
                      security=self.s.security.describe())
        loading: asyncio.Task | None = None
        try:
            # Refused credentials or an untrusted certificate show in one round trip: before the
            # model loads, not after.
            await check_credentials(self.s.bootstrap_servers, self.s.security.aiokafka_kwargs())
            # The model loads (on a thread) while the clients connect: a worker started beside its
            # broker, or before it, waits for the two at once, not one after the other.
            loading = asyncio.ensure_future(self._load_model())
            loading.add_done_callback(self._on_loaded)
            await self._run_kafka(loop, loading)
            await loading  # a load that failed while the clients waited: its error, as below
        except Exception as exc:
            if (denied := access_denied(exc)) is not None:
                self._denied(denied)
            else:
                self.log.exception("worker failed")
                self.fatal_error = self.fatal_error or repr(exc)
                self.exit_code = EXIT_FATAL
        finally:
            if self.engine_thread is not None:
                await asyncio.to_thread(self.engine_thread.stop)
            if server is not None:
                server.stop()
            for sig in signals:
                loop.remove_signal_handler(sig)
        self.log.info("worker stopped", exit_code=self.exit_code, error=self.fatal_error)
        return self.exit_code

    async def _load_model(self) -> Engine:
        if self.engine is None:
            from tokenmill.engine.heap import freeze_startup_heap

            t0 = time.monotonic()
            self.engine = await asyncio.to_thread(self._new_engine)
            # This process serves this engine until it exits: its start-up objects leave the
            # collector's full passes (engine/heap.py). An engine handed in is its owner's to manage.
            frozen = freeze_startup_heap()
            self.log.info("model loaded", seconds=round(time.monotonic() - t0, 2), frozen_objects=frozen)
        self.served_model_name = self.engine.served_model_name
        self.health.model_loaded = True
        return self.engine

    def _new_engine(self) -> Engine:
        """The engine, on the loading thread: an s3:// model is downloaded there too, so the event
        loop keeps connecting meanwhile."""
        from tokenmill.engine import create_engine
        from tokenmill.storage.checkpoint import resolve_model_path

        # Every engine setting goes through unchanged; the model becomes a local directory.
        return create_engine(replace(self.s.engine, model=str(resolve_model_path(self.s.engine.model))))

    def _on_loaded(self, loading: asyncio.Task) -> None:
        """A failed load stops the start at once (no waiting on for a broker); run() raises its error."""
        if not loading.cancelled() and loading.exception() is not None:
            self._stop.set()

    async def _run_kafka(self, loop: asyncio.AbstractEventLoop, loading: asyncio.Task) -> None:
        s = self.s
        wait = BrokerWait(s.bootstrap_servers, s.broker_wait_timeout_s, self._stop, self.log, tick=self.health.tick)
        client_kwargs = s.security.aiokafka_kwargs()
        started = partial(start_checked, bootstrap_servers=s.bootstrap_servers, client_kwargs=client_kwargs)
        try:
            # The producer's request and batch sizes follow the output topics' limits (sizing.py).
            if await wait.call(self._read_limits, "admin client") is None:
                return
            producer = await wait.start(
                partial(clients.new_producer, s, self.limits, on_switch=self._on_plain_producer), "producer", started)
            if producer is None:
                return  # asked to stop while waiting for the broker
            self.producer = producer
            # Every topic this principal may not describe, named at once with the ACL it needs.
            await check_topic_access(self.producer.client, {s.jobs_topic: "READ", s.results_topic: "WRITE",
                                                            s.tokens_topic: "WRITE", s.dlq_topic: "WRITE"})
            self.tokens = TokenStream(self.producer, s.tokens_topic, on_retry=self._on_publish_retry,
                                      max_bytes=self.limits.of(s.tokens_topic), on_dropped=self._on_token_dropped)
            self.tokens.start()
            # Started before it subscribes, so that its start is the connection only: the join
            # comes after, with the patience a rebalance needs (retry.py).
            consumer = await wait.start(partial(clients.new_consumer, s), "consumer", started)
            if consumer is None:
                return
            self.consumer = consumer
            if not loading.done():
                self.log.info("connected; waiting for the model to load")
            engine = await asyncio.shield(loading)  # shielded: a cancelled start leaves the thread to finish
            if self._stop.is_set():
                return  # asked to stop while the model loaded: nothing was taken yet
            # With --schema-registry, the output schemas are registered before anything is taken.
            framing, reader = await open_registry(s.registry, jobs_topic=s.jobs_topic, results_topic=s.results_topic,
                                                  tokens_topic=s.tokens_topic, dlq_topic=s.dlq_topic)
            self._assemble(loop, engine)
            self.ctx.framing, self.intake.reader, self.fetcher.reader = framing, reader, reader
            self.consumer.subscribe([s.jobs_topic], listener=self.rebalance)
            # The poll task starts at once: its first fetch waits inside aiokafka for the first
            # assignment, and it is where a refusal of the group (a missing ACL) surfaces. The join
            # below only waits, keeps the liveness probe fed and says how long it has been joining.
            tasks = [self._spawn(self.fetcher.run(), "poll"), self._spawn(self.commits.run(), "commit"),
                     self._spawn(self._look_up_dlq_partitions(), "dlq-partitions"),
                     self._spawn(self.broker_watch.run(), "broker-watch")]
            try:
                self.health.joining_since = time.monotonic()
                if await wait.join(lambda: self.health.group_joined, s.rebalance_allowance_s()):
                    self.health.joining_since = None
                    await self._stop.wait()
                await self._drain()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except BrokerUnreachable as exc:
            self._fail(str(exc), EXIT_BROKER_UNREACHABLE)
        finally:
            await self._close_kafka()

    def _assemble(self, loop: asyncio.AbstractEventLoop, engine: Engine) -> None:
        """The steps of a record's life, each given the next one; the delivery mode is chosen here.
        Ends by starting the engine thread, whose reports feed the steps."""
        s, log, tracker, metrics = self.s, self.log, self.tracker, self.metrics
        self.ctx = AnswerContext(engine.served_model_name, s.worker_name, s.results_topic, s.dlq_topic,
                                 limits=self.limits)
        retry = KafkaRetry(log, give_up=self._fail, timeout_s=s.broker_wait_timeout_s, on_denied=self._denied)
        if s.exactly_once:
            self.delivery = ExactlyOnce(s.group_id, partial(clients.new_transactional_producer, s, limits=self.limits),
                                        tracker,
                                        next_step=self.done, log=log, retry=retry, on_fenced=self._lost)
        else:
            self.delivery = AtLeastOnce(self.producer, self.consumer, tracker, next_step=self.done, log=log,
                                        on_retry=self._on_publish_retry)
        engine_thread = EngineThread(engine, loop, self._on_step, self._on_engine_fatal)
        # Between the in-flight jobs and the engine: crash attempts written ahead, suspects alone.
        self.starts = StartGate(engine_thread, tracker, s.max_crash_attempts, wake_commit=self._commit_now, log=log)
        self.inflight = InFlight(self.tenants, self.starts, on_refused=self._refused)
        self.starts.lookup = self.inflight.get
        self.intake = Intake(self.ctx, self.guard, admit=self.inflight.admit, answer=self._answer_now,
                             on_guard_tripped=self._stop_for_bad_input, log=log,
                             crash_attempts=lambda f: tracker.attempts(f.tp, f.epoch, f.offset),
                             max_crash_attempts=s.max_crash_attempts)
        self.output = EngineOutput(self.inflight, self.tokens, tracker, self.ctx, metrics,
                                   record_input=self.intake.record, deliver=self.delivery.submit, spawn=self._spawn)
        self.fetcher = Fetcher(self.consumer, tracker, self.gate, take=self.intake.take, stopping=self._stop.is_set,
                               max_records=s.fetch_max_records, metrics=metrics, health=self.health, log=log)
        self.commits = CommitLoop(s.commit_interval_s, tracker, self.delivery, self.consumer, metrics, log,
                                  describe_fetch=self.fetcher.describe, on_committed=self.starts.after_commit)
        self.rebalance = Rebalance(s, self.consumer, tracker, self.delivery, self.done, self.inflight, retry=retry,
                                   stopping=self._stop.is_set, forget=self._forget, health=self.health, log=log,
                                   wake_commit=self._commit_now)
        self.broker_watch = BrokerWatch(self.producer.client.force_metadata_update, self._on_broker_change, log)
        self.engine_thread = engine_thread
        engine_thread.start()

    async def _drain(self) -> None:
        """Stop fetching, give in-flight jobs up to the drain timeout, answer, commit."""
        self.health.draining = True
        self.fetcher.pause_all()
        engine_thread = self.inflight.engine_thread
        # A failed engine finishes nothing more: stop waiting then.
        # Nor is anything delivered once the broker refused us (credentials, an ACL).
        left = await self.done.settle(None, self.s.drain_timeout_s,
                                      give_up=lambda: not engine_thread.alive or self.refused is not None)
        if left:
            self.log.warning("drain timeout: abandoning in-flight jobs (they are redelivered)", abandoned=left)
        # Abandoned before the last commit, so that it carries their crash attempts as they were.
        self.inflight.abandon_where(lambda job: True, "stopping")
        await self.delivery.commit(self.tracker.committable())  # a revoked one is no longer ours to commit
        committed = {f"{tp.topic}:{tp.partition}": offset for tp, offset in self.tracker.last_committed().items()}
        # uncommitted: fetched, not committed; the next owner reads it again (a commit that failed)
        self.log.info("drained", abandoned=left, committed=committed, uncommitted=self.fetcher.uncommitted())

    async def _close_kafka(self) -> None:
        # What was made before a failed or interrupted start is closed; the rest was never there.
        if hasattr(self, "delivery"):
            await self.delivery.close()
        try:
            if hasattr(self, "consumer"):
                await self.consumer.stop()  # leaves the group (unless static membership)
        except Exception as exc:
            self.log.warning("consumer close failed", error=repr(exc))
        try:
            if hasattr(self, "tokens"):
                await self.tokens.stop()
        except Exception:
            pass
        try:
            if hasattr(self, "producer"):
                await self.producer.stop()
        except Exception as exc:
            self.log.warning("producer close failed", error=repr(exc))

    async def _look_up_dlq_partitions(self) -> None:
        # Until known, dead letters go where the producer's partitioner puts them.
        self.ctx.dlq_partitions = await clients.partition_count(self.producer, self.s.dlq_topic, self.log)

    # ---------------------------------------------------------------------------------------
    # what connects the steps
    def _on_step(self, deltas: list[RequestDelta], stats: EngineStats, new_tokens: int) -> None:
        """The engine thread's report after each step, on the event loop."""
        self.health.tick()
        self.metrics.observe_engine(stats)
        # Held jobs are waiting too, from the point of view of fetching more.
        waiting = stats.waiting + self.tenants.held + self.starts.held
        self.metrics.jobs_held.set(self.tenants.held)
        gate_moved = self.fetcher.engine_load(waiting, stats.kv_usage)
        self.starts.take(deltas)  # first: a finished job's attempt ends before its tenant slot is passed on
        self.output.take(deltas)
        self.metrics.observe_tokens(new_tokens)
        if gate_moved or self.fetcher.span_paused:
            self.fetcher.update_pausing()

    def _commit_now(self) -> None:
        self.commits.wake()

    def _answer_now(self, answer: Answer) -> None:
        self.metrics.count_cuts(answer.records)
        f = answer.fetched
        self._spawn(self.delivery.submit(answer), f"answer-{f.tp.partition}-{f.offset}")

    def _refused(self, job: InFlightJob, reason: str) -> None:
        self.intake.refuse(job, reason)

    def _lost(self, tp: TopicPartition) -> None:
        self.rebalance.lost(tp)

    def _forget(self, partitions: set[TopicPartition]) -> None:
        left = self.fetcher.uncommitted(partitions)
        if left:  # what the next owner reads again: answered ones among it are answered twice
            self.log.info("partitions given up", partitions=sorted(tp.partition for tp in partitions), uncommitted=left)
        self.fetcher.forget(partitions)
        self.commits.forget(partitions)

    def _on_broker_change(self, reachable: bool) -> None:
        self.health.broker_reachable = reachable
        self.metrics.broker_reachable.set(1 if reachable else 0)
        self.fetcher.set_broker_away(not reachable)

    def _denied(self, denied: KafkaAccessDenied) -> None:
        """Refused credentials, an untrusted certificate or a missing ACL: no retry can help."""
        self.refused = self.refused or denied
        self._fail(str(denied), denied.exit_code)

    def _stop_for_bad_input(self, message: str) -> None:
        self._fail(message, EXIT_BAD_INPUT)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and (denied := access_denied(exc)) is not None:
            self._denied(denied)
        elif exc is not None and not isinstance(exc, PublishAbandoned):
            self.log.error("internal task failed", task=task.get_name(), error=repr(exc), exc_info=exc)
            self._fail(f"internal task {task.get_name()} failed: {exc!r}")

    def _on_engine_fatal(self, exc: BaseException, detail: str) -> None:
        self.log.error("engine thread failed", error=repr(exc), traceback=detail)
        self._fail(f"engine failed: {exc!r}")

    def _on_publish_retry(self, exc: BaseException, attempt: int) -> None:
        reason = refusal_of(exc)
        if reason is not None:  # refused for good: cut down and sent again, or the worker stops
            self.metrics.publish_refused.labels(reason).inc()
            self.log.warning("the broker refused a record for good", reason=reason, error=repr(exc))
        elif attempt == 1 or attempt % 10 == 0:
            self.log.warning("publish failed; retrying", error=repr(exc), attempt=attempt)

    def _on_plain_producer(self, topic: str, error: BaseException | None) -> None:
        self.log.warning("the broker refused a batch: this topic's records now go through a non-idempotent "
                         "producer (a retry may write one twice)", topic=topic, error=repr(error))

    def _on_token_dropped(self, job_id: str, reason: str, error: BaseException | None) -> None:
        self.metrics.token_events_dropped.labels(reason).inc()
        dropped = self.tokens.dropped
        if dropped == 1 or dropped % 1000 == 0:  # one line per burst, not one per event
            self.log.warning("TokenEvent dropped; the stream has a gap, the Result is whole", job_id=job_id,
                             reason=reason, error=repr(error) if error else None, dropped_so_far=dropped)

    async def _read_limits(self) -> TopicLimits:
        """One try with a new admin client (read_topic_limits makes and closes its own)."""
        self.limits = await clients.read_topic_limits(self.s, self.log)
        self.log.info("output topic size limits", max_message_bytes=self.limits.by_topic)
        return self.limits


def _job_priority(job: InFlightJob) -> int:
    return job.job.priority
