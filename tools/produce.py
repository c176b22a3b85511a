"""Send Job lines (or OpenAI batch lines) to Kafka: partition keys, per-model topics, a rate limit.

Keys (`--key`):
- `job_id` (default): spreads jobs evenly over partitions.
- `prefix`: a hash of the tenant plus the system message (chat jobs) or the first N prompt characters
  (or N prompt token ids). Jobs that share a prefix land on one partition, so one worker's
  prefix cache serves them all.
- `none`: no key; the producer picks partitions.

Topics: `--jobs-topic` may contain `{model}` (e.g. `tokenmill.jobs.{model}`): each job then goes
to the topic of its `model` field, one topic and one worker group per served model.

With a schema registry (`--schema-registry`), each Job is written in Confluent's wire format with
the Job's JSON Schema, registered under its topic's subject `<topic>-value` (tools/job_framing.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.kafka.registry import RegistrySettings

KEY_MODES = ("job_id", "prefix", "none")
DEFAULT_PREFIX_CHARS = 256
SEND_BATCH = 500


class ProduceAborted(RuntimeError):
    """--strict: an invalid line stops the run (the message names the line)."""


@dataclass
class InvalidLine:
    line_no: int
    message: str


@dataclass
class ProduceReport:
    sent: int = 0
    invalid: list[InvalidLine] = field(default_factory=list)
    by_topic: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0


def prefix_key(job, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> bytes:
    """Same tenant + same system message (or same prompt start) -> same key -> same partition."""
    if job.messages is not None:
        system = [m.content for m in job.messages if m.role == "system"]
        basis: Any = {"system": system[0]} if system else {"first": job.messages[0].content[:prefix_chars]}
    elif job.prompt is not None:
        basis = {"prompt": job.prompt[:prefix_chars]}
    else:
        basis = {"ids": list(job.prompt_token_ids[:prefix_chars])}
    basis["tenant"] = job.tenant
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16].encode()


def key_for(job, mode: str, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> bytes | None:
    if mode == "job_id":
        return job.job_id.encode()
    if mode == "prefix":
        return prefix_key(job, prefix_chars)
    if mode == "none":
        return None
    raise ValueError(f"--key must be one of {', '.join(KEY_MODES)}")


def topic_for(job, template: str) -> str:
    if "{model}" not in template:
        return template
    if not job.model:
        raise ValueError("job has no `model` field, and --jobs-topic routes by {model}")
    return template.format(model=job.model)


def job_value(job) -> bytes:
    """The Job as the worker reads it (OpenAI batch lines are converted to Jobs here)."""
    return json.dumps(job.model_dump(mode="json", exclude_unset=True), separators=(",", ":"),
                      ensure_ascii=False).encode()


def parse_lines(lines: Iterable[bytes], template: str) -> Iterator[tuple[int, Any, str | None, str | None]]:
    """(line number, Job or None, topic, error message) for each non-blank line."""
    from tokenmill.schemas import JobDecodeError, read_input_line

    for line_no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            job = read_input_line(raw).job
            yield line_no, job, topic_for(job, template), None
        except JobDecodeError as exc:
            yield line_no, None, None, exc.message if hasattr(exc, "message") else str(exc)
        except ValueError as exc:
            yield line_no, None, None, str(exc)


class RateLimiter:
    """At most `rate` sends per second on average (None = unlimited)."""

    def __init__(self, rate: float | None):
        if rate is not None and rate <= 0:
            raise ValueError("--rate must be > 0")
        self.rate = rate
        self.start = time.monotonic()
        self.count = 0

    async def wait(self) -> None:
        if self.rate is None:
            return
        self.count += 1
        due = self.start + (self.count - 1) / self.rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


def validate_all(stream: IO[bytes], template: str) -> tuple[int, list[InvalidLine]]:
    """--strict pre-pass over a file: (valid count, invalid lines); nothing is sent."""
    valid, invalid = 0, []
    for line_no, job, _topic, problem in parse_lines(stream, template):
        if job is None:
            invalid.append(InvalidLine(line_no, problem or "invalid"))
        else:
            valid += 1
    return valid, invalid


async def produce(
    stream: IO[bytes],
    *,
    bootstrap_servers: str,
    jobs_topic: str = "tokenmill.jobs",
    key: str = "job_id",
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    rate: float | None = None,
    strict: bool = False,
    total: int | None = None,
    progress: bool = True,
    kafka_options: dict | None = None,
    registry: RegistrySettings | None = None,
    err: IO[str] | None = None,
) -> ProduceReport:
    from aiokafka import AIOKafkaProducer
    from tqdm import tqdm

    from tokenmill.kafka.metadata_pacing import paced
    from tokenmill.kafka.security import start_checked
    from tokenmill.tools.job_framing import JobFraming

    if key not in KEY_MODES:
        raise ValueError(f"--key must be one of {', '.join(KEY_MODES)}")
    err = err or sys.stderr
    limiter = RateLimiter(rate)
    report = ProduceReport()
    framing = JobFraming(registry)
    started = time.monotonic()
    producer = paced(AIOKafkaProducer(bootstrap_servers=bootstrap_servers, acks="all", enable_idempotence=True,
                                      linger_ms=5, **(kafka_options or {})))
    # Refused credentials raise KafkaAccessDenied here; a missing ACL raises from a send below.
    await start_checked(producer, bootstrap_servers, kafka_options or {})
    bar = tqdm(total=total, unit="job", disable=not progress, file=sys.stderr, desc="produce", dynamic_ncols=True)
    pending: list = []
    try:
        for line_no, job, topic, problem in parse_lines(stream, jobs_topic):
            if job is None:
                report.invalid.append(InvalidLine(line_no, problem or "invalid"))
                print(f"line {line_no}: {problem} (skipped)", file=err)
                if strict:
                    raise ProduceAborted(f"line {line_no}: {problem}")
                bar.update(1)
                continue
            await limiter.wait()
            value = await framing.value(topic, job_value(job))
            pending.append(await producer.send(topic, value=value, key=key_for(job, key, prefix_chars)))
            report.by_topic[topic] = report.by_topic.get(topic, 0) + 1
            if len(pending) >= SEND_BATCH or rate is not None:
                await asyncio.gather(*pending)
                report.sent += len(pending)
                bar.update(len(pending))
                pending = []
        if pending:
            await asyncio.gather(*pending)
            report.sent += len(pending)
            bar.update(len(pending))
            pending = []
    finally:
        if pending:  # aborted: wait for what was already handed to the producer, so the count is true
            done = await asyncio.gather(*pending, return_exceptions=True)
            report.sent += sum(1 for d in done if not isinstance(d, BaseException))
        bar.close()
        await producer.stop()
        report.elapsed_s = time.monotonic() - started
    return report
