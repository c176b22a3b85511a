"""Follow Results, or reassemble token streams, from Kafka.

Reads every partition by manual assignment (no consumer group, so tailing never disturbs the
workers' groups or other readers), from the end or from the beginning, `read_committed` so an
exactly-once worker's aborted Results never show.

Records are read as plain JSON or, with a schema registry, also in Confluent's wire format:
Results framed with their JSON Schema or Avro schema, TokenEvents with their JSON Schema
(worker/kafka/registry.py's ResultReader, the writer's schema fetched by its id).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.kafka.registry import RegistrySettings


@dataclass
class StreamState:
    attempt: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    next_index: int = 0
    gaps: int = 0
    replaced: set[str] = field(default_factory=set)  # earlier attempts of this job, now ignored
    # A job with n > 1: each choice's text and token ids (its events carry `choice`).
    choice_texts: dict[int, str] = field(default_factory=dict)
    choice_ids: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class StreamUpdate:
    """What one TokenEvent changed: `restarted` when a new attempt replaced an older one's text."""

    job_id: str
    attempt: str
    delta: str
    text: str
    finished: bool
    restarted: bool
    gap: bool
    token_ids: list[int]
    choice: int | None = None  # the choice of an n > 1 job this event belongs to (text is that choice's)
    # When an n > 1 job's stream finishes: every choice's (text, token ids), by index.
    choices: dict[int, tuple[str, list[int]]] | None = None


class TokenAssembler:
    """Rebuilds each job's text from its TokenEvents.

    A new `attempt` for a job (a redelivery after a crash or rebalance) starts that job's text
    again; later events of the attempt it replaced (a worker that had not noticed it lost the
    partition) are ignored. Finished jobs are forgotten, so
    memory holds only streams in progress.
    """

    def __init__(self) -> None:
        self.streams: dict[str, StreamState] = {}
        self.finished_attempts: dict[str, str] = {}  # job_id -> attempt that finished last

    def add(self, event: dict[str, Any]) -> StreamUpdate | None:
        job_id, attempt = event["job_id"], event["attempt"]
        state = self.streams.get(job_id)
        restarted = False
        if state is None or state.attempt != attempt:
            if self.finished_attempts.get(job_id) == attempt:
                return None  # a late duplicate of a stream already complete
            if state is not None and attempt in state.replaced:
                return None  # an attempt already replaced by a newer one
            restarted = state is not None or job_id in self.finished_attempts
            replaced = (state.replaced | {state.attempt}) if state is not None else set()
            state = self.streams[job_id] = StreamState(attempt=attempt, replaced=replaced)
        gap = event["index"] != state.next_index
        if gap:
            state.gaps += 1
        state.next_index = event["index"] + 1
        choice = event.get("choice")
        if choice is None:
            state.text += event.get("text", "")
            state.token_ids.extend(event.get("token_ids", []))
            text, ids = state.text, state.token_ids
        else:
            text = state.choice_texts[choice] = state.choice_texts.get(choice, "") + event.get("text", "")
            ids = state.choice_ids.setdefault(choice, [])
            ids.extend(event.get("token_ids", []))
        update = StreamUpdate(job_id, attempt, event.get("text", ""), text, bool(event.get("finished")),
                              restarted, gap, list(ids), choice)
        if update.finished and state.choice_texts:
            update.choices = {i: (state.choice_texts[i], list(state.choice_ids[i])) for i in sorted(state.choice_texts)}
        if update.finished:
            del self.streams[job_id]
            self.finished_attempts[job_id] = attempt
            if len(self.finished_attempts) > 100_000:  # bounded: forget the oldest
                self.finished_attempts.pop(next(iter(self.finished_attempts)))
        return update


async def follow(
    bootstrap_servers: str,
    topic: str,
    *,
    from_beginning: bool = False,
    job_ids: set[str] | None = None,
    idle_timeout: float | None = None,
    kafka_options: dict | None = None,
    registry: RegistrySettings | None = None,
    on_ready: Callable[[], None] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Yield each record of `topic` as a dict (undecodable records are reported and skipped; a
    registry that refuses or does not answer stops the reading with RegistryError or
    RegistryUnreachable)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from tokenmill.kafka.metadata_pacing import paced
    from tokenmill.kafka.registry import RegistryClient, ResultReader
    from tokenmill.kafka.security import start_checked

    reader = ResultReader(RegistryClient(registry) if registry is not None else None)
    consumer = paced(AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, group_id=None, enable_auto_commit=False,
                                      isolation_level="read_committed", **(kafka_options or {})))
    # Refused credentials raise KafkaAccessDenied here; a missing READ ACL raises from
    # topic_partitions or from a fetch.
    await start_checked(consumer, bootstrap_servers, kafka_options or {})
    try:
        from tokenmill.tools.kafka_topics import topic_partitions

        tps = [TopicPartition(topic, p) for p in await topic_partitions(consumer, topic)]
        consumer.assign(tps)
        if from_beginning:
            await consumer.seek_to_beginning(*tps)
        else:
            for tp, off in (await consumer.end_offsets(tps)).items():
                consumer.seek(tp, off)
        for tp in tps:
            await consumer.position(tp)  # resolve positions now, so nothing produced after this is missed
        if on_ready:
            on_ready()
        keys = {j.encode() for j in job_ids} if job_ids else None
        last = time.monotonic()
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=1000)
            got = False
            for tp, records in batches.items():
                for rec in records:
                    got = True
                    if keys is not None and rec.key not in keys:
                        continue
                    try:
                        value = await reader.decode(rec.value)
                    except (ValueError, TypeError, EOFError) as exc:  # EOFError: Avro bytes cut short
                        print(f"{tp.topic}/{tp.partition}@{rec.offset}: not readable ({exc}), skipped",
                              file=sys.stderr)
                        continue
                    if keys is not None and value.get("job_id") not in job_ids:
                        continue
                    yield value
            if got:
                last = time.monotonic()
            elif idle_timeout is not None and time.monotonic() - last > idle_timeout:
                return
    finally:
        await consumer.stop()


def format_result(result: dict[str, Any]) -> str:
    """One Result for a person: status, job, text (or error), tokens and timings."""
    status = result.get("status", "?")
    usage = result.get("usage") or {}
    timing = result.get("timing") or {}
    head = f"[{status}] {result.get('job_id')}"
    if status == "ok":
        body = repr(result.get("text", ""))
        tail = (f"{usage.get('prompt_tokens', 0)}+{usage.get('completion_tokens', 0)} tokens "
                f"({usage.get('cached_prompt_tokens', 0)} cached), {result.get('finish_reason')}, "
                f"ttft {timing.get('ttft_ms', 0):.0f} ms, total {timing.get('total_ms', 0):.0f} ms")
    elif status == "error":
        err = result.get("error") or {}
        body, tail = f"{err.get('code')}: {err.get('message')}", ""
    else:
        body, tail = "expired before it started", ""
    return f"{head} {body}" + (f"\n        {tail} (model {result.get('model')}, worker {result.get('worker')})" if tail else "")


async def tail(
    bootstrap_servers: str,
    *,
    results_topic: str = "tokenmill.results",
    tokens_topic: str = "tokenmill.tokens",
    tokens: bool = False,
    job_ids: set[str] | None = None,
    from_beginning: bool = False,
    as_json: bool = False,
    unique: bool = False,
    count: int | None = None,
    idle_timeout: float | None = None,
    kafka_options: dict | None = None,
    registry: RegistrySettings | None = None,
    out: IO[str] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Print Results (or reassembled streams); return how many were printed."""
    out = out or sys.stdout
    printed = 0
    seen: set[str] = set()
    assembler = TokenAssembler()
    topic = tokens_topic if tokens else results_topic
    async for value in follow(bootstrap_servers, topic, from_beginning=from_beginning, job_ids=job_ids,
                              idle_timeout=idle_timeout, kafka_options=kafka_options, registry=registry,
                              on_ready=on_ready):
        if tokens:
            update = assembler.add(value)
            if update is None:
                continue
            if as_json:
                if not update.finished:
                    continue
                record = {"job_id": update.job_id, "attempt": update.attempt, "text": update.text,
                          "token_ids": update.token_ids}
                if update.choices is not None:  # n > 1: text and token_ids are choice 0's, as in the Result
                    record["choices"] = [{"index": i, "text": t, "token_ids": ids}
                                         for i, (t, ids) in update.choices.items()]
                    record["text"], record["token_ids"] = update.choices.get(0, ("", []))
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            else:
                if update.restarted:
                    out.write(f"[{update.job_id}] new attempt {update.attempt}: text restarts\n")
                name = update.job_id if update.choice is None else f"{update.job_id}#{update.choice}"
                if update.delta:
                    out.write(f"[{name}] {update.delta!r}\n")
                if update.finished and update.choices is not None:
                    for i, (text, _) in update.choices.items():
                        out.write(f"[{update.job_id}#{i}] finished: {text!r}\n")
                elif update.finished:
                    out.write(f"[{update.job_id}] finished: {update.text!r}\n")
            out.flush()
            if update.finished:
                printed += 1
        else:
            job_id = value.get("job_id")
            if unique:
                if job_id in seen:
                    continue
                seen.add(job_id)
            out.write((json.dumps(value, ensure_ascii=False) if as_json else format_result(value)) + "\n")
            out.flush()
            printed += 1
        if count is not None and printed >= count:
            break
    return printed


def run_tail(**kw) -> int:
    return asyncio.run(tail(**kw))
