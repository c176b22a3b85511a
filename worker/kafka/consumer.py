"""The Kafka worker: consume jobs, run them in the engine thread, publish answers, commit watermarks.

Life of one input record:

1. The poll task (always running, so aiokafka's max_poll_interval never trips) fetches it; the
   offset tracker records it as outstanding under its partition's assignment epoch.
2. It is decoded. Bad input (not JSON, schema violation, wrong model) is answered at once with a
   dead letter and, when a job_id can be read, an error Result. A deadline already passed is
   answered with an `expired` Result. Otherwise it goes to the engine thread (after the tenant
   cap lets it).
3. The engine thread hands back deltas once per step. Streaming jobs get one TokenEvent per step.
   When the job finishes, its TokenEvents are confirmed first, then its Result is published.
4. At-least-once: once the broker acknowledged the Result, the offset is complete; the commit
   task commits each partition's watermark (lowest outstanding offset) on an interval, on revoke
   and at shutdown. Exactly-once: the answer is buffered and committed with the offset in one
   transaction of the partition's own transactional producer (see transactions.py).

A partition revoked in a rebalance gets a short grace for its in-flight jobs, its watermark is
committed, the rest is aborted and left for the new owner; anything of it that completes later
carries a stale epoch and is dropped.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field, replace

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from schemas.constants import ERROR_INVALID_JOB, ERROR_MODEL_MISMATCH, ERROR_PROMPT_TOO_LONG
from schemas.decode import decode_job
from schemas.errors import JobDecodeError
from worker.config import WorkerSettings
from worker.engine.types import EngineStats, RequestDelta
from worker.kafka import answers
from worker.kafka.backpressure import BackpressureGate
from worker.kafka.guard import BadInputGuard, BadInputGuardTripped
from worker.kafka.offsets import OffsetTracker
from worker.kafka.publisher import OutRecord, PublishAbandoned, TokenStream, send_acked
from worker.kafka.tenants import TenantLimiter
from worker.kafka.transactions import PartitionFenced, PartitionTransactions
from worker.logging import get_logger, job_log
from worker.metrics import HealthState, MetricsServer, WorkerMetrics
from worker.runtime.engine_thread import EngineThread

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_BAD_INPUT = 3


@dataclass(eq=False)
class InFlightJob:
    tp: TopicPartition
    epoch: int
    offset: int
    key: bytes | None
    value: bytes | None
    job: object  # schemas.job.Job
    attempt: str
    log: object
    next_index: int = 0
    token_sink: list = field(default_factory=list)
    submitted: bool = False

    @property
    def request_id(self) -> str:
        return self.attempt


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: KafkaWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked):
        await self.worker._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        await self.worker._on_assigned(set(assigned))


class KafkaWorker:
    def __init__(self, settings: WorkerSettings, engine=None, log=None) -> None:
        settings.validate()
        self.s = settings
        self.log = (log or get_logger("tokenmill.worker")).bind(worker=settings.worker_name)
        self.engine = engine
        self.metrics = WorkerMetrics()
        self.health = HealthState()
        self.tracker = OffsetTracker(settings.max_inflight_per_partition)
        self.gate = BackpressureGate(settings.backpressure)
        self.guard = BadInputGuard(settings.bad_input_ratio, settings.bad_input_window)
        self.tenants: TenantLimiter[InFlightJob] = TenantLimiter(settings.max_inflight_per_tenant)
        self._jobs: dict[str, InFlightJob] = {}  # request_id -> job, for everything not yet answered
        self._span_paused: set[TopicPartition] = set()
        self._revoking: set[TopicPartition] = set()
        self._txns: dict[TopicPartition, PartitionTransactions] = {}
        self._progress = asyncio.Event()  # set whenever an offset completes
        self._stop = asyncio.Event()
        self._fatal: str | None = None
        self.exit_code = EXIT_OK
        self.answered = 0  # inputs whose answer is durable (or staged, exactly-once), this process
        self.first_fetch_at: tuple[float, float] | None = None  # (perf_counter, process_time)
        self.last_answer_at: tuple[float, float] | None = None
        self._tasks: set[asyncio.Task] = set()
        self._dlq_partitions: int | None = None
        self._lag_labels: set[tuple[str, str]] = set()
        self._engine_thread: EngineThread | None = None
        self.served_model_name: str | None = None
        self.metrics_port: int | None = None
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None

    # ---------------------------------------------------------------------------------------
    # start-up and shutdown
    def request_stop(self, reason: str = "signal") -> None:
        if not self._stop.is_set():
            self.log.info("stop requested; draining", reason=reason, in_flight=len(self._jobs))
            self._stop.set()

    def _fail(self, message: str, code: int = EXIT_FATAL) -> None:
        if self._fatal is None:
            self._fatal = message
            self.exit_code = code
            self.log.error("worker stopping on error", error=message)
        self._stop.set()

    def _client_kwargs(self) -> dict:
        return dict(bootstrap_servers=self.s.bootstrap_servers, **self.s.security.aiokafka_kwargs())

    def _producer_kwargs(self) -> dict:
        return dict(
            acks="all",
            enable_idempotence=True,
            request_timeout_ms=30_000,
            linger_ms=2,
            max_batch_size=256 * 1024,
            **self._client_kwargs(),
        )

    def _new_txn_producer(self, txn_id: str) -> AIOKafkaProducer:
        return AIOKafkaProducer(transactional_id=txn_id, transaction_timeout_ms=60_000, **self._producer_kwargs())

    def _load_engine(self):
        from worker.engine import Engine
        from worker.storage.checkpoint import resolve_model_path

        # Every engine setting goes through unchanged; the model becomes a local directory.
        return Engine(replace(self.s.engine, model=str(resolve_model_path(self.s.engine.model))))

    async def run(self, install_signal_handlers: bool = True) -> int:
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop, sig.name)
        server = None
        if self.s.metrics_port is not None:
            server = MetricsServer(self.metrics, self.health, self.s.metrics_host, self.s.metrics_port).start()
            self.metrics_port = server.port
            self.log.info("metrics endpoint up", port=server.port)
        self.log.info(
            "worker starting",
            bootstrap=self.s.bootstrap_servers,
            group=self.s.group_id,
            jobs_topic=self.s.jobs_topic,
            exactly_once=self.s.exactly_once,
            security=self.s.security.describe(),
        )
        engine_thread = None
        try:
            if self.engine is None:
                t0 = time.monotonic()
                self.engine = await asyncio.to_thread(self._load_engine)
                self.log.info("model loaded", seconds=round(time.monotonic() - t0, 2))
            self.served_model_name = self.engine.served_model_name
            self.health.model_loaded = True
            if self._stop.is_set():
                return self.exit_code
            engine_thread = EngineThread(self.engine, loop, self._on_step, self._on_engine_fatal)
            self._engine_thread = engine_thread
            engine_thread.start()
            await self._run_kafka()
        except Exception as exc:
            self.log.exception("worker failed")
            self._fatal = self._fatal or repr(exc)
            self.exit_code = EXIT_FATAL
        finally:
            if engine_thread is not None:
                await asyncio.to_thread(engine_thread.stop)
            if server is not None:
                server.stop()
            if install_signal_handlers:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
        self.log.info("worker stopped", exit_code=self.exit_code, error=self._fatal)
        return self.exit_code

    async def _run_kafka(self) -> None:
        self.producer = AIOKafkaProducer(**self._producer_kwargs())
        await self.producer.start()
        self.tokens = TokenStream(self.producer, self.s.tokens_topic, on_retry=self._on_publish_retry)
        self.tokens.start()
        self.consumer = AIOKafkaConsumer(
            group_id=self.s.group_id,
            group_instance_id=self.s.instance_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            session_timeout_ms=self.s.session_timeout_ms,
            heartbeat_interval_ms=self.s.heartbeat_interval_ms,
            max_poll_interval_ms=self.s.max_poll_interval_ms,
            rebalance_timeout_ms=self.s.max_poll_interval_ms,
            max_partition_fetch_bytes=1 << 20,
            **self._client_kwargs(),
        )
        self.consumer.subscribe([self.s.jobs_topic], listener=_Rebalance(self))
        await self.consumer.start()
        try:
            poll = self._spawn(self._poll_loop(), "poll")
            commit = self._spawn(self._commit_loop(), "commit")
            await self._stop.wait()
            await self._drain()
            for task in (poll, commit):
                task.cancel()
            await asyncio.gather(poll, commit, return_exceptions=True)
        finally:
            await self._close_kafka()

    async def _close_kafka(self) -> None:
        for tp in list(self._txns):
            await self._txns.pop(tp).stop()
        try:
            await self.consumer.stop()  # leaves the group (unless static membership)
        except Exception as exc:
            self.log.warning("consumer close failed", error=repr(exc))
        try:
            await self.tokens.stop()
        except Exception:
            pass
        try:
            await self.producer.stop()
        except Exception as exc:
            self.log.warning("producer close failed", error=repr(exc))

    async def _drain(self) -> None:
        """Stop fetching, give in-flight jobs up to the drain timeout, answer, commit."""
        self.health.draining = True
        assigned = self.consumer.assignment()
        if assigned:
            self.consumer.pause(*assigned)
        deadline = time.monotonic() + self.s.drain_timeout_s
        while self.tracker.in_flight() and time.monotonic() < deadline:
            if not self._engine_thread.alive:
                break  # the engine failed: nothing in flight will finish
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                pass
        left = self.tracker.in_flight()
        await self._commit(list(self.tracker.partitions()))
        if left:
            self.log.warning("drain timeout: abandoning in-flight jobs (they are redelivered)", abandoned=left)
        for job in list(self._jobs.values()):
            self._abandon(job)
        self.log.info("drained", abandoned=left, committed=self._committed_summary())

    def _committed_summary(self) -> dict:
        out = {}
        for tp in self.tracker.partitions():
            part = self.tracker.get(tp)
            out[f"{tp.topic}:{tp.partition}"] = part.last_committed
        return out

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, PublishAbandoned):
            self.log.error("internal task failed", task=task.get_name(), error=repr(exc), exc_info=exc)
            self._fail(f"internal task {task.get_name()} failed: {exc!r}")

    def _on_engine_fatal(self, exc: BaseException, detail: str) -> None:
        self.log.error("engine thread failed", error=repr(exc), traceback=detail)
        self._fail(f"engine failed: {exc!r}")

    def _on_publish_retry(self, exc: BaseException, attempt: int) -> None:
        if attempt == 1 or attempt % 10 == 0:
            self.log.warning("publish failed; retrying", error=repr(exc), attempt=attempt)

    # ---------------------------------------------------------------------------------------
    # rebalancing
    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        assigned = {tp for tp in assigned if tp.topic == self.s.jobs_topic}
        starts: dict[TopicPartition, int | None] = {}
        for tp in assigned:
            if self.s.exactly_once:
                txn = PartitionTransactions(tp, self.s.group_id, self._new_txn_producer, self.log)
                # Initialising the id aborts what a previous owner left open; only then is the
                # committed offset final, so it is read afterwards.
                await self._retrying(txn.start, f"initialise transactions of partition {tp.partition}")
                self._txns[tp] = txn
            # aiokafka may hand out records of a new assignment while this callback still runs;
            # those are skipped (the partition is not tracked yet), so the position is set here
            # explicitly: the committed offset, or the beginning when nothing was committed.
            start = await self._retrying(lambda tp=tp: self.consumer.committed(tp), "read the committed offset")
            if start is None:
                start = (await self._retrying(lambda tp=tp: self.consumer.beginning_offsets([tp]),
                                              "read the beginning offset"))[tp]
            starts[tp] = start
        # No await from here on: seeking and starting the epochs happen together as far as the
        # poll task is concerned (a seek made before an await would let records from the new
        # position arrive, and be skipped, while the partition is not tracked yet).
        for tp, start in starts.items():
            self.consumer.seek(tp, start)
        epochs = self.tracker.assign(assigned)
        for tp, start in starts.items():
            self.tracker.get(tp).expect_from(start)
        if self._stop.is_set() and assigned:
            self.consumer.pause(*assigned)
        self.health.group_joined = True
        self.log.info("partitions assigned", partitions=sorted(tp.partition for tp in assigned),
                      epochs=list(epochs.values()), start_offsets={tp.partition: o for tp, o in starts.items()})

    async def _retrying(self, call, what: str, attempts: int = 30):
        """Await call() until it succeeds; Kafka errors (a broker away) are retried with backoff."""
        for attempt in range(1, attempts + 1):
            try:
                return await call()
            except KafkaError as exc:
                if attempt == attempts:
                    self._fail(f"cannot {what}: {exc!r}")
                    raise
                self.log.warning(f"cannot {what} yet; retrying", error=repr(exc), attempt=attempt)
                await asyncio.sleep(min(5.0, 0.2 * 2**attempt))

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        owned = {tp for tp in revoked if self.tracker.get(tp) is not None}
        if not owned:
            return
        self._revoking |= owned
        grace = self.s.drain_timeout_s if self._stop.is_set() else self.s.revoke_grace_s
        deadline = time.monotonic() + grace
        while any(self.tracker.in_flight(tp) for tp in owned) and time.monotonic() < deadline:
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                pass
        await self._commit(list(owned))
        abandoned = 0
        for job in [j for j in self._jobs.values() if j.tp in owned]:
            self._abandon(job)
            abandoned += 1
        self.tenants.drop_held(lambda j: j.tp in owned)
        if self.s.exactly_once:
            for tp in owned:
                txn = self._txns.pop(tp, None)
                if txn is not None:
                    await txn.stop()
        for tp in owned:
            label = (tp.topic, str(tp.partition))
            if label in self._lag_labels:
                self.metrics.commit_lag.remove(*label)
                self._lag_labels.discard(label)
        self.tracker.revoke(owned)
        self._span_paused -= owned
        self._revoking -= owned
        self.log.info(
            "partitions revoked", partitions=sorted(tp.partition for tp in owned), abandoned_in_flight=abandoned
        )

    def _abandon(self, job: InFlightJob) -> None:
        """Forget a job whose answer will not be published (its partition is gone or we stop)."""
        if self._jobs.pop(job.request_id, None) is not None and job.submitted:
            self._engine_thread.abort(job.request_id)
            self._release_tenant(job)

    # ---------------------------------------------------------------------------------------
    # fetching
    async def _poll_loop(self) -> None:
        consumer = self.consumer
        while True:
            self.health.tick()
            try:
                batches = await consumer.getmany(timeout_ms=200, max_records=self.s.fetch_max_records)
            except KafkaError as exc:  # e.g. the broker is away: aiokafka reconnects by itself
                self.log.warning("fetch failed; retrying", error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            for tp, records in batches.items():
                for rec in records:
                    if not self._accept(tp, rec):
                        # Span cap reached: rewind to this record and pause the partition.
                        consumer.seek(tp, rec.offset)
                        consumer.pause(tp)
                        self._span_paused.add(tp)
                        break
            self._update_pausing()

    def _update_pausing(self) -> None:
        consumer = self.consumer
        if self._stop.is_set():
            return
        assigned = consumer.assignment()
        for tp in list(self._span_paused):
            part = self.tracker.get(tp)
            if part is None or part.span() <= part.max_span // 2:
                self._span_paused.discard(tp)
        want_paused = set(self._span_paused)
        if self.gate.paused:
            want_paused |= set(assigned)
        self.metrics.paused.set(1 if self.gate.paused else 0)
        now_paused = consumer.paused()
        to_pause = [tp for tp in assigned if tp in want_paused and tp not in now_paused]
        to_resume = [tp for tp in assigned if tp not in want_paused and tp in now_paused]
        if to_pause:
            consumer.pause(*to_pause)
        if to_resume:
            consumer.resume(*to_resume)

    def _accept(self, tp: TopicPartition, rec) -> bool:
        """Take one fetched record; False if the partition's in-flight span is full."""
        part = self.tracker.get(tp)
        if part is None or tp in self._revoking or self._stop.is_set():
            return True  # not ours (any more): the next owner reads it from the committed offset
        if not part.accepts(rec.offset):
            # Below where this epoch starts, or already tracked: a record fetched for an older
            # position. Its offset is covered by the committed offset or by this epoch's fetching.
            self.log.warning("skipping a record fetched before the current position", partition=tp.partition,
                             offset=rec.offset, expected_from=part.next_expected)
            return True
        if not part.has_room():
            return False
        epoch = part.epoch
        part.track(rec.offset)
        if self.first_fetch_at is None:
            self.first_fetch_at = (time.perf_counter(), time.process_time())
        self.metrics.jobs_in.inc()
        source = answers.source_of(tp.topic, tp.partition, rec.offset)
        attempt = answers.new_attempt_id(self.s.worker_name)
        try:
            if rec.value is None:
                raise JobDecodeError.invalid("the record has no value (a tombstone is not a job)")
            job = decode_job(rec.value)
            if job.model is not None and job.model != self.served_model_name:
                raise JobDecodeError(
                    ERROR_MODEL_MISMATCH,
                    f"job asks for model {job.model!r}; this worker serves {self.served_model_name!r}",
                    job.job_id,
                )
        except JobDecodeError as err:
            self._guard(err.code)
            log = job_log(self.log, err.job_id, tp.partition, rec.offset)
            log.warning("bad input; dead-lettering", code=err.code, reason=err.message)
            self._spawn_answer(
                tp, epoch, rec.offset,
                self._bad_input_records(tp, rec, err.code, err.message, err.job_id, attempt, source, None),
                log, outcome=("dead_letter", err.code),
            )
            return True
        self._guard(None)
        log = job_log(self.log, job.job_id, tp.partition, rec.offset)
        if job.deadline_ms is not None and job.deadline_ms <= time.time() * 1000:
            result = answers.expired_result(
                job, model=self.served_model_name, worker=self.s.worker_name, attempt=attempt, source=source
            )
            log.info("deadline passed before start; expired")
            self._spawn_answer(tp, epoch, rec.offset, [answers.result_record(result, self.s.results_topic)], log,
                               outcome=("expired", None))
            return True
        job_state = InFlightJob(tp, epoch, rec.offset, rec.key, rec.value, job, attempt, log.bind(attempt=attempt))
        self._jobs[job_state.request_id] = job_state
        if self.tenants.admit(job.tenant, job_state):
            self._submit(job_state)
        else:
            log.debug("tenant at its in-flight cap; held", tenant=job.tenant)
        return True

    def _guard(self, code: str | None) -> None:
        try:
            self.guard.record(code)
        except BadInputGuardTripped as exc:
            self._fail(str(exc), EXIT_BAD_INPUT)

    def _submit(self, job: InFlightJob) -> None:
        try:
            request = answers.job_to_engine_request(job.job, request_id=job.request_id)
        except ValueError as exc:  # sampling values the engine refuses although the schema allowed them
            self._jobs.pop(job.request_id, None)
            self._release_tenant(job, submit_next=True)
            self._guard(ERROR_INVALID_JOB)
            self._spawn_answer(
                job.tp, job.epoch, job.offset,
                self._bad_input_records(job.tp, job, ERROR_INVALID_JOB, str(exc), job.job.job_id, job.attempt,
                                        self._source(job), job.job.metadata),
                job.log, outcome=("dead_letter", ERROR_INVALID_JOB),
            )
            return
        job.submitted = True
        self._engine_thread.submit(request, every_delta=job.job.stream)
        job.log.debug("submitted to engine", attempt=job.attempt)

    def _release_tenant(self, job: InFlightJob, submit_next: bool = True) -> None:
        nxt = self.tenants.release(job.job.tenant)
        if nxt is not None and submit_next:
            if nxt.request_id in self._jobs:
                self._submit(nxt)
            else:
                self._release_tenant(nxt)

    @staticmethod
    def _source(job: InFlightJob):
        return answers.source_of(job.tp.topic, job.tp.partition, job.offset)

    def _bad_input_records(self, tp, rec, code, message, job_id, attempt, source, metadata) -> list[OutRecord]:
        records = [
            answers.dead_letter(
                rec.key, rec.value, code, message, dlq_topic=self.s.dlq_topic, source_topic=tp.topic,
                partition=tp.partition, offset=rec.offset,
                dlq_partition=tp.partition if self._dlq_partitions and tp.partition < self._dlq_partitions else None,
            )
        ]
        if job_id is not None:
            result = answers.error_result(
                job_id, code, answers.clip(message), model=self.served_model_name, worker=self.s.worker_name,
                attempt=attempt, source=source, metadata=metadata,
            )
            records.append(answers.result_record(result, self.s.results_topic))
        return records

    # ---------------------------------------------------------------------------------------
    # engine output
    def _on_step(self, deltas: list[RequestDelta], stats: EngineStats, new_tokens: int) -> None:
        self.health.tick()
        self.metrics.running.set(stats.running)
        self.metrics.waiting.set(stats.waiting)
        self.metrics.kv_usage.set(stats.kv_usage)
        self.metrics.prefix_hit_rate.set(stats.prefix_hit_rate)
        # Held jobs are waiting too, from the point of view of fetching more.
        was_paused = self.gate.paused
        self.gate.update(stats.waiting + self.tenants.held, stats.kv_usage)
        for delta in deltas:
            job = self._jobs.get(delta.request_id)
            if job is None:
                continue  # aborted (revoked partition or shutdown)
            if job.job.stream and (delta.new_token_ids or delta.text_delta or delta.finished):
                payload = answers.token_event(job.job.job_id, job.attempt, job.next_index, delta)
                job.next_index += 1
                self.tokens.publish(job.job.job_id, payload, job.token_sink)
            if delta.finished:
                del self._jobs[delta.request_id]
                self._release_tenant(job)
                self._spawn(self._finish(job, delta), f"finish-{job.attempt}")
        self.metrics.observe_tokens(new_tokens)
        if self.consumer is not None and (self.gate.paused != was_paused or self._span_paused):
            self._update_pausing()

    async def _finish(self, job: InFlightJob, delta: RequestDelta) -> None:
        def wanted() -> bool:
            return self.tracker.get(job.tp, job.epoch) is not None

        if job.job.stream:
            try:
                await self.tokens.confirm(job.token_sink, still_wanted=wanted)
            except PublishAbandoned:
                return
        source = self._source(job)
        try:
            result = answers.build_result(
                job.job, delta, model=self.served_model_name, worker=self.s.worker_name, attempt=job.attempt,
                source=source,
            )
        except ValueError as exc:  # an engine outcome the contract cannot express: say so, do not drop
            result = answers.error_result(
                job.job.job_id, "internal", answers.clip(str(exc)), model=self.served_model_name,
                worker=self.s.worker_name, attempt=job.attempt, source=source, metadata=job.job.metadata,
            )
        records = [answers.result_record(result, self.s.results_topic)]
        outcome = (result.status, result.error.code if result.error else None)
        if result.status == "error":
            # A job that cannot run here (prompt too long) is dead-lettered like other bad input.
            code = result.error.code
            # Counted as good when it decoded; the engine found it bad after all, so it is
            # counted once more as bad (the guard errs towards stopping, never towards missing).
            if code in (ERROR_PROMPT_TOO_LONG, ERROR_INVALID_JOB):
                self._guard(code)
            records.insert(
                0,
                answers.dead_letter(
                    job.key, job.value, code, result.error.message, dlq_topic=self.s.dlq_topic,
                    source_topic=job.tp.topic, partition=job.tp.partition, offset=job.offset,
                    dlq_partition=job.tp.partition
                    if self._dlq_partitions and job.tp.partition < self._dlq_partitions else None,
                ),
            )
        if result.status == "ok" and delta.timing is not None:
            self.metrics.ttft.observe(delta.timing.ttft_ms)
            n = len(result.token_ids)
            if n > 1:
                self.metrics.tpot.observe(delta.timing.decode_ms / (n - 1))
        await self._answer(job.tp, job.epoch, job.offset, records, job.log, outcome)

    def _spawn_answer(self, tp, epoch, offset, records, log, outcome) -> None:
        self._spawn(self._answer(tp, epoch, offset, records, log, outcome), f"answer-{tp.partition}-{offset}")

    async def _answer(self, tp, epoch, offset, records: list[OutRecord], log, outcome) -> None:
        """Publish a job's answer; the offset completes once it is durable (or staged, exactly-once)."""
        def wanted() -> bool:
            return self.tracker.get(tp, epoch) is not None

        if self.s.exactly_once:
            txn = self._txns.get(tp)
            if txn is None or not wanted():
                return
            txn.add(offset, records)
        else:
            try:
                for rec in records:
                    await send_acked(self.producer, rec, still_wanted=wanted, on_retry=self._on_publish_retry)
            except PublishAbandoned:
                log.info("answer dropped: partition no longer ours")
                return
        if self.tracker.complete(tp, epoch, offset):
            self.answered += 1
            self.last_answer_at = (time.perf_counter(), time.process_time())
            self._count(outcome)
            log.info("answered", status=outcome[0], code=outcome[1])
            self._progress.set()

    def _count(self, outcome) -> None:
        status, code = outcome
        m = self.metrics
        if status == "ok":
            m.jobs_ok.inc()
        elif status == "expired":
            m.jobs_expired.inc()
        elif status == "dead_letter":
            m.jobs_dead_lettered.labels(code).inc()
            m.jobs_error.labels(code).inc()
        else:  # an engine-side error: dead-lettered as well (see _finish)
            m.jobs_error.labels(code or "internal").inc()
            m.jobs_dead_lettered.labels(code or "internal").inc()

    # ---------------------------------------------------------------------------------------
    # committing
    async def _commit_loop(self) -> None:
        if self._dlq_partitions is None:
            try:
                parts = await self.producer.partitions_for(self.s.dlq_topic)
                self._dlq_partitions = len(parts) if parts else 0
            except KafkaError as exc:
                self.log.warning("cannot read dead-letter topic partitions", error=repr(exc))
                self._dlq_partitions = 0
        while True:
            await asyncio.sleep(self.s.commit_interval_s)
            self.log.debug("commit tick", partitions=[tp.partition for tp in self.tracker.partitions()],
                           paused=sorted(tp.partition for tp in self.consumer.paused()),
                           gate_paused=self.gate.paused, span_paused=sorted(tp.partition for tp in self._span_paused),
                           in_flight=self.tracker.in_flight())
            await self._commit([tp for tp in self.tracker.partitions() if tp not in self._revoking])
            self._update_lag()

    async def _commit(self, partitions) -> None:
        if self.s.exactly_once:
            for tp in partitions:
                txn, part = self._txns.get(tp), self.tracker.get(tp)
                if txn is None or part is None:
                    continue
                try:
                    await txn.flush(part.commit_point())
                    if txn.last_committed is not None:
                        part.mark_committed(txn.last_committed)
                except PartitionFenced:
                    self.log.warning("partition taken over by another worker; dropping its work", partition=tp.partition)
                    for job in [j for j in self._jobs.values() if j.tp == tp]:
                        self._abandon(job)
                    self._txns.pop(tp, None)
                    self.tracker.revoke([tp])
            return
        offsets = {}
        for tp in partitions:
            part = self.tracker.get(tp)
            if part is not None and part.needs_commit():
                offsets[tp] = part.commit_point()
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            self.log.warning("offset commit failed; will retry", error=repr(exc))
            return
        for tp, point in offsets.items():
            part = self.tracker.get(tp)
            if part is not None:
                part.mark_committed(point)

    def _update_lag(self) -> None:
        for tp in self.tracker.partitions():
            part = self.tracker.get(tp)
            high = self.consumer.highwater(tp) if self.consumer else None
            if part is None or high is None:
                continue
            committed = part.last_committed if part.last_committed is not None else part.commit_point()
            if committed is None:
                continue
            self.metrics.commit_lag.labels(tp.topic, str(tp.partition)).set(max(0, high - committed))
            self._lag_labels.add((tp.topic, str(tp.partition)))
