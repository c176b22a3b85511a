"""The Kafka backend: jobs to the jobs topic, Results read back from the results topic.

The results topic is read from positions kept in the store, committed in the same transaction as
the results they carried, so a crash never skips or double-counts one. Only records of this
dataset (job id prefix, see identity.job_id_prefix) are kept.

With a schema registry (`KafkaSettings.registry`), the jobs go out in Confluent's wire format with
the Job's JSON Schema (tools/job_framing.py), and Results are read framed (JSON Schema or Avro) as
well as plain. While the registry does not answer, the collector tries the same records again
every few seconds (their position is stored only with their Results, so nothing is skipped); a
Result that no reader can decode is logged and passed over, like a record that is not JSON.

The backend needs only the connection and topics (`KafkaSettings`), so other resumable clients
(`tokenmill eval`) reuse it with their own job ids; a BackfillConfig is taken as is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.kafka.registry import RegistryClient, RegistrySettings, RegistryUnreachable, ResultReader
from tokenmill.tools.backfill.backend import Backend
from tokenmill.tools.backfill.config import BackfillConfig
from tokenmill.tools.job_framing import JobFraming

if TYPE_CHECKING:
    from tokenmill.schemas import Job
    from tokenmill.tools.backfill.store import ResultStore

log = logging.getLogger(__name__)

REGISTRY_RETRY_S = 2.0  # between two tries of a Result's schema while the registry does not answer


@dataclass(frozen=True)
class KafkaSettings:
    """Where the jobs go and the Results come from."""

    bootstrap_servers: str | None
    jobs_topic: str = "tokenmill.jobs"  # 'tokenmill.jobs.{model}' routes by the job's model
    results_topic: str = "tokenmill.results"
    kafka_options: dict[str, Any] = field(default_factory=dict)  # security kwargs for aiokafka
    model: str | None = None  # the served model name the jobs carry
    registry: RegistrySettings | None = None  # a schema registry: jobs framed, framed Results read

    @classmethod
    def of(cls, cfg: BackfillConfig | KafkaSettings) -> KafkaSettings:
        if isinstance(cfg, KafkaSettings):
            return cfg
        return cls(cfg.bootstrap_servers, cfg.jobs_topic, cfg.results_topic, dict(cfg.kafka_options), cfg.spec.model,
                   cfg.registry)


class KafkaBackend(Backend):
    def __init__(self, cfg: BackfillConfig | KafkaSettings, id_prefix: str):
        super().__init__()
        cfg = KafkaSettings.of(cfg)
        if not cfg.bootstrap_servers:
            raise ValueError("--engine kafka needs --bootstrap-servers")
        self.cfg = cfg
        self.prefix = id_prefix.encode()
        self.producer = None
        self.consumer = None
        self.collector: asyncio.Task | None = None
        self.model_name = cfg.model or ""
        self.framing = JobFraming(cfg.registry)
        self.reader = ResultReader(RegistryClient(cfg.registry) if cfg.registry is not None else None)

    async def start(self, store: ResultStore) -> str | None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

        from tokenmill.kafka.metadata_pacing import paced
        from tokenmill.kafka.security import start_checked
        from tokenmill.tools.kafka_topics import topic_partitions

        opts = dict(self.cfg.kafka_options)
        topic = self.cfg.results_topic
        self.consumer = paced(AIOKafkaConsumer(
            bootstrap_servers=self.cfg.bootstrap_servers, group_id=None, enable_auto_commit=False,
            isolation_level="read_committed", auto_offset_reset="earliest", **opts,
        ))
        # Refused credentials raise KafkaAccessDenied here (and a missing ACL from the first use
        # of the topic); the run stops, nothing is retried.
        await start_checked(self.consumer, self.cfg.bootstrap_servers, opts)
        self.producer = paced(AIOKafkaProducer(
            bootstrap_servers=self.cfg.bootstrap_servers, acks="all", enable_idempotence=True,
            linger_ms=5, **opts,
        ))
        await self.producer.start()
        tps = [TopicPartition(topic, p) for p in await topic_partitions(self.consumer, topic)]
        self.consumer.assign(tps)
        stored = store.offsets(topic)
        fresh = [tp for tp in tps if tp.partition not in stored]
        if fresh:
            # First run (or new partitions): results start at the current end, recorded before
            # any job is sent, so none of ours can be missed.
            ends = await self.consumer.end_offsets(fresh)
            store.add_results([], {(topic, tp.partition): off for tp, off in ends.items()})
            stored = store.offsets(topic)
        for tp in tps:
            self.consumer.seek(tp, stored[tp.partition])
        self.store = store
        self.collector = asyncio.create_task(self._collect())
        return None  # the model is identified by its served name (KafkaSettings.model)

    async def _collect(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=300, max_records=2000)
            results, offsets = [], {}
            for tp, records in batches.items():
                for rec in records:
                    key = rec.key or b""
                    if key.startswith(self.prefix) or (not key and rec.value and self.prefix in rec.value[:400]):
                        result = await self._decode(rec)
                        if result is not None:
                            results.append(result)
                if records:
                    offsets[(tp.topic, tp.partition)] = records[-1].offset + 1
            if offsets:
                self.record(results, offsets)

    async def _decode(self, rec) -> dict[str, Any] | None:
        """A Result record's JSON form; None for one no reader can decode (logged)."""
        while True:
            try:
                return await self.reader.decode(rec.value)
            except RegistryUnreachable as exc:
                log.warning("%s; reading %s:%d offset %d again in %.0f s", exc, rec.topic, rec.partition,
                            rec.offset, REGISTRY_RETRY_S)
                await asyncio.sleep(REGISTRY_RETRY_S)
            except (ValueError, TypeError, EOFError) as exc:  # EOFError: Avro bytes cut short
                log.warning("unreadable record at %s:%d offset %d: %s", rec.topic, rec.partition, rec.offset, exc)
                return None

    def _topic_for(self, job: Job) -> str:
        template = self.cfg.jobs_topic
        if "{model}" in template:
            if not job.model:
                raise ValueError("--jobs-topic routes by {model} but no --model was given")
            return template.format(model=job.model)
        return template

    def partition_key(self, job: Job) -> bytes:
        """The jobs-topic key (the partition it goes to): its job id; subclasses may group jobs
        that share a prompt prefix on one partition, so one worker's prefix cache serves them."""
        return job.job_id.encode()

    async def submit(self, jobs: list[Job]) -> None:
        futures = []
        for job in jobs:
            topic = self._topic_for(job)
            futures.append(await self.producer.send(topic, value=await self.framing.value(topic, job.to_json_bytes()),
                                                    key=self.partition_key(job)))
        await asyncio.gather(*futures)
        self._raise_if_collector_failed()

    def _raise_if_collector_failed(self) -> None:
        if self.collector is not None and self.collector.done() and not self.collector.cancelled():
            exc = self.collector.exception()
            if exc is not None:
                raise exc

    async def wait_done(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            t0 = time.monotonic()
            pending = self.store.counts()["pending"]
            query_s = time.monotonic() - t0
            if not pending:
                return
            self._raise_if_collector_failed()
            if deadline is not None and time.monotonic() > deadline:
                return
            # Counting is a scan of the store: poll less often on very large backfills.
            await asyncio.sleep(max(0.25, 10 * query_s))

    async def close(self) -> None:
        if self.collector is not None:
            self.collector.cancel()
            try:
                await self.collector
            except (asyncio.CancelledError, Exception):
                pass
        if self.producer is not None:
            await self.producer.stop()
        if self.consumer is not None:
            await self.consumer.stop()
