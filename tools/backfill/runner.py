"""One backfill run: stream the dataset, submit the rows that have no result, collect results into
the on-disk store as they arrive, then write the ordered output.

The run is idempotent: everything it knows lives in the store, so Ctrl-C, a crash or a lost
machine cost only the work in flight; rerunning the same command picks up where it stopped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.backfill.datasets import count_rows, detect_format, iter_rows
from tools.backfill.identity import fingerprint, job_id_for, job_id_prefix
from tools.backfill.jobs import JobSpec, RowError
from tools.backfill.output import OUTPUT_FORMATS, write_output
from tools.backfill.store import ResultStore

log = logging.getLogger(__name__)

PLAN_CHUNK_ROWS = 512
WORKER_NAME = "backfill"


@dataclass
class BackfillConfig:
    input: str
    output: str
    spec: JobSpec
    engine: str = "kafka"  # kafka | local
    input_format: str | None = None
    output_format: str | None = None  # jsonl | parquet | openai (default: from the output name)
    dataset_id: str | None = None
    key_column: str | None = None
    state: str | None = None
    retry_failed: bool = False
    timeout_s: float | None = None
    progress: bool = True
    # Kafka engine
    bootstrap_servers: str | None = None
    jobs_topic: str = "tokenmill.jobs"
    results_topic: str = "tokenmill.results"
    kafka_options: dict[str, Any] = field(default_factory=dict)  # security kwargs for aiokafka
    # Local engine
    model_path: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)  # extra EngineConfig fields
    max_in_flight: int = 64


@dataclass
class Summary:
    rows: int = 0
    ok: int = 0
    error: int = 0
    expired: int = 0
    pending: int = 0
    submitted: int = 0
    invalid_rows: int = 0
    new_results: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    generation_s: float = 0.0  # first result of this run -> last (tokens/s is measured over it)
    output: str | None = None
    state: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.generation_s if self.generation_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        return d

    def render(self) -> str:
        return (
            f"backfill: {self.rows} rows -> ok {self.ok}, error {self.error}, expired {self.expired}"
            + (f", pending {self.pending}" if self.pending else "")
            + f"; submitted {self.submitted} job(s) this run, {self.new_results} new result(s), "
            f"{self.completion_tokens} tokens in {self.elapsed_s:.1f}s ({self.tokens_per_s:.1f} tok/s)"
            + (f"; output {self.output}" if self.output else "")
        )


class BackfillIncomplete(RuntimeError):
    """Rows are still without a result (timeout); the state is kept, a rerun resumes."""


def default_state_path(output: str) -> Path:
    from worker.storage import is_s3_url
    from worker.storage.checkpoint import cache_root

    if is_s3_url(output):
        digest = hashlib.sha256(output.encode()).hexdigest()[:16]
        return cache_root() / "backfill" / f"{digest}.sqlite"
    return Path(output).expanduser().with_name(Path(output).name + ".state.sqlite")


def output_format_for(output: str, given: str | None) -> str:
    if given:
        if given not in OUTPUT_FORMATS:
            raise ValueError(f"--output-format must be one of {', '.join(OUTPUT_FORMATS)}")
        if given == "openai" and output.lower().endswith((".parquet", ".pq")):
            raise ValueError("--output-format openai writes JSON lines; name the output .jsonl")
        return given
    return "parquet" if output.lower().endswith((".parquet", ".pq")) else "jsonl"


def dataset_identity(location: str, given: str | None) -> str:
    if given:
        return given
    from worker.storage import is_s3_url

    return location if is_s3_url(location) else str(Path(location).expanduser().resolve())


def model_identity(local_dir: Path) -> str:
    """What makes a local checkpoint itself: its config and its weight files' names and sizes."""
    parts = {"config": (local_dir / "config.json").read_text() if (local_dir / "config.json").exists() else None}
    parts["files"] = sorted(
        (p.name, p.stat().st_size) for p in local_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".json")
    )
    return fingerprint(parts)


class _Progress:
    """tqdm bar: rows done (of the whole dataset), ETA, tokens/s."""

    def __init__(self, total: int, done: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="row", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True, desc="backfill")
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.new = 0

    def submitted(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def results(self, added: list[dict]) -> None:
        if not added:
            return
        self.new += len(added)
        self.last = time.monotonic()
        self.tokens += sum(int((r.get("usage") or {}).get("completion_tokens") or 0) for r in added)
        rate = self.tokens / max(1e-6, self.last - (self.first or self.start))
        self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        self.bar.update(len(added))

    def close(self) -> None:
        self.bar.close()


class _RowPlanner:
    """Streams (row_number, job dict or RowError) chunks from the dataset."""

    def __init__(self, cfg: BackfillConfig, path: Path, fmt: str, dataset_id: str, config_fp: str):
        self.cfg, self.path, self.fmt = cfg, path, fmt
        self.dataset_id, self.config_fp = dataset_id, config_fp
        self.rows_seen = 0

    def chunks(self) -> Iterator[list[tuple[int, str, str | None, bool, dict | None, str | None]]]:
        chunk = []
        for n, row in enumerate(iter_rows(self.path, self.fmt)):
            self.rows_seen = n + 1
            job_id = job_id_for(self.dataset_id, n, fingerprint(row), self.config_fp)
            key = None
            if self.cfg.key_column:
                if self.cfg.key_column not in row:
                    raise ValueError(f"row {n} has no key column {self.cfg.key_column!r} (--key-column)")
                key = str(row[self.cfg.key_column])
            else:
                key = str(n)
            try:
                job, problem = self.cfg.spec.job_dict(job_id, n, row), None
            except RowError as exc:
                job, problem = None, str(exc)
            chunk.append((n, job_id, key, self.cfg.spec.uses_messages, job, problem))
            if len(chunk) >= PLAN_CHUNK_ROWS:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def _validate_jobs(
    chunk: list, model_name: str
) -> tuple[list[tuple[int, dict]], list[dict]]:
    """Schema-check each row's Job; invalid ones become error results right away (code invalid_job)."""
    from pydantic import ValidationError

    from schemas import ERROR_INVALID_JOB, Job, format_validation_error
    from worker.job_mapping import error_result, new_attempt_id

    valid, errors = [], []
    for n, job_id, _key, _chat, job, problem in chunk:
        if job is not None:
            try:
                Job.model_validate(job)
                valid.append((n, job))
                continue
            except ValidationError as exc:
                problem = format_validation_error(exc)
        res = error_result(
            job_id, ERROR_INVALID_JOB, f"row {n}: {problem}", model=model_name or "none",
            worker=WORKER_NAME, attempt=new_attempt_id(WORKER_NAME), metadata={"row": n},
        )
        errors.append(res.model_dump(mode="json", exclude_none=True))
    return valid, errors


async def run_backfill(cfg: BackfillConfig) -> Summary:
    from worker.storage import local_input, local_output

    started = time.monotonic()
    out_fmt = output_format_for(cfg.output, cfg.output_format)
    state_path = Path(cfg.state) if cfg.state else default_state_path(cfg.output)
    dataset_id = dataset_identity(cfg.input, cfg.dataset_id)
    store = ResultStore(state_path)
    summary = Summary(state=str(state_path))
    backend: _Backend
    if cfg.engine == "local":
        backend = _LocalBackend(cfg)
    elif cfg.engine == "kafka":
        backend = _KafkaBackend(cfg, job_id_prefix(dataset_id))
    else:
        raise ValueError(f"--engine must be kafka or local, not {cfg.engine!r}")
    progress = None
    try:
        model_id = await backend.start(store)
        config_fp = cfg.spec.fingerprint(model_id)
        store.set_meta("dataset_id", dataset_id)
        with local_input(cfg.input) as path:
            fmt = cfg.input_format or detect_format(cfg.input)
            total = count_rows(path, fmt)
            progress = _Progress(total, 0, cfg.progress)
            backend.on_results = progress.results
            planner = _RowPlanner(cfg, path, fmt, dataset_id, config_fp)
            for chunk in planner.chunks():
                todo = store.plan_rows([(n, j, k, c) for n, j, k, c, _, _ in chunk], cfg.retry_failed)
                todo_set = set(todo)
                already = len(chunk) - len(todo_set)
                if already:
                    progress.bar.update(already)
                valid, errors = _validate_jobs([chunk[i] for i in todo], backend.model_name)
                if errors:
                    summary.invalid_rows += len(errors)
                    progress.results(store.add_results(errors))
                if valid:
                    store.mark_submitted([n for n, _ in valid])
                    progress.submitted()
                    await backend.submit([job for _, job in valid])
                    summary.submitted += len(valid)
            store.truncate_rows(planner.rows_seen)
        await backend.wait_done(store, cfg.timeout_s)
        counts = store.counts()
        if counts["pending"]:
            raise BackfillIncomplete(
                f"{counts['pending']} row(s) still without a result after {cfg.timeout_s}s; "
                "rerun the same command to resume"
            )
        store.prune_results()
        with local_output(cfg.output) as tmp:
            written = write_output(store, tmp, out_fmt)
        if written != store.row_count():
            raise RuntimeError(f"wrote {written} rows for {store.row_count()} input rows")
        summary.output = cfg.output
    finally:
        if progress is not None:
            summary.new_results = progress.new
            summary.completion_tokens = progress.tokens
            if progress.first is not None and progress.last is not None:
                summary.generation_s = progress.last - progress.first
            progress.close()
        await backend.close()
        counts = store.counts()
        summary.rows = store.row_count()
        summary.ok, summary.error = counts["ok"], counts["error"]
        summary.expired, summary.pending = counts["expired"], counts["pending"]
        summary.elapsed_s = time.monotonic() - started
        store.close()
    return summary


class _Backend:
    model_name: str = ""
    on_results = staticmethod(lambda added: None)

    async def start(self, store: ResultStore) -> str | None: ...
    async def submit(self, jobs: list[dict]) -> None: ...
    async def wait_done(self, store: ResultStore, timeout_s: float | None) -> None: ...
    async def close(self) -> None: ...


class _LocalBackend(_Backend):
    """The engine in this process: no Kafka, same jobs, same Results."""

    def __init__(self, cfg: BackfillConfig):
        if not cfg.model_path:
            raise ValueError("--engine local needs --model (a checkpoint folder or s3:// prefix)")
        self.cfg = cfg
        self.engine = None
        self.store: ResultStore | None = None
        self.in_flight: dict[str, tuple[Any, str]] = {}  # request id -> (Job, attempt)

    async def start(self, store: ResultStore) -> str:
        from worker.storage import resolve_model_path

        self.local_dir = resolve_model_path(self.cfg.model_path)
        self.model_name = self.cfg.engine_options.get("served_model_name") or self.local_dir.name
        self.store = store
        return model_identity(self.local_dir)

    def _engine(self):
        """Loaded on first use: a rerun with nothing left to do never loads the model."""
        if self.engine is None:
            from worker.engine.engine import Engine, EngineConfig

            options = dict(self.cfg.engine_options)
            options.setdefault("served_model_name", self.model_name)
            self.engine = Engine(EngineConfig(model=str(self.local_dir), **options))
        return self.engine

    async def submit(self, jobs: list[dict]) -> None:
        from schemas import ERROR_INVALID_JOB, Job
        from worker.job_mapping import error_result, job_to_engine_request, new_attempt_id

        for raw in jobs:
            job = Job.model_validate(raw)
            attempt = new_attempt_id(WORKER_NAME)
            try:
                self._engine().add(job_to_engine_request(job, request_id=attempt))
            except ValueError as exc:  # the engine refuses the request: that row's result is an error
                res = error_result(job.job_id, ERROR_INVALID_JOB, str(exc), model=self.model_name,
                                   worker=WORKER_NAME, attempt=attempt, metadata=job.metadata)
                self.on_results(self.store.add_results([res.model_dump(mode="json", exclude_none=True)]))
                continue
            self.in_flight[attempt] = (job, attempt)
            while len(self.in_flight) >= self.cfg.max_in_flight:
                self._step()

    def _step(self) -> None:
        from worker.job_mapping import build_result

        finished = []
        for delta in self.engine.step():
            if not delta.finished:
                continue
            job, attempt = self.in_flight.pop(delta.request_id)
            result = build_result(job, delta, model=self.model_name, worker=WORKER_NAME, attempt=attempt)
            finished.append(result.model_dump(mode="json", exclude_none=True))
        if finished:
            self.on_results(self.store.add_results(finished))

    async def wait_done(self, store: ResultStore, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.engine is not None and self.engine.has_work():
            if deadline is not None and time.monotonic() > deadline:
                return
            self._step()

    async def close(self) -> None:
        self.engine = None


class _KafkaBackend(_Backend):
    """Jobs to the jobs topic; Results read from the results topic at positions kept in the store."""

    def __init__(self, cfg: BackfillConfig, id_prefix: str):
        if not cfg.bootstrap_servers:
            raise ValueError("--engine kafka needs --bootstrap-servers")
        self.cfg = cfg
        self.prefix = id_prefix.encode()
        self.producer = None
        self.consumer = None
        self.collector: asyncio.Task | None = None
        self.model_name = cfg.spec.model or ""

    async def start(self, store: ResultStore) -> str | None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

        opts = dict(self.cfg.kafka_options)
        topic = self.cfg.results_topic
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=self.cfg.bootstrap_servers, group_id=None, enable_auto_commit=False,
            isolation_level="read_committed", auto_offset_reset="earliest", **opts,
        )
        await self.consumer.start()
        self.producer = AIOKafkaProducer(
            bootstrap_servers=self.cfg.bootstrap_servers, acks="all", enable_idempotence=True,
            linger_ms=5, **opts,
        )
        await self.producer.start()
        from tools.kafka_topics import topic_partitions

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
        return None  # the model is identified by its served name (JobSpec.model)

    async def _collect(self) -> None:
        import json

        while True:
            batches = await self.consumer.getmany(timeout_ms=300, max_records=2000)
            results, offsets = [], {}
            for tp, records in batches.items():
                for rec in records:
                    key = rec.key or b""
                    if key.startswith(self.prefix) or (not key and rec.value and self.prefix in rec.value[:400]):
                        try:
                            results.append(json.loads(rec.value))
                        except ValueError:
                            log.warning("unreadable record at %s:%d offset %d", tp.topic, tp.partition, rec.offset)
                if records:
                    offsets[(tp.topic, tp.partition)] = records[-1].offset + 1
            if offsets:
                self.on_results(self.store.add_results(results, offsets))

    def _topic_for(self, job: dict) -> str:
        template = self.cfg.jobs_topic
        if "{model}" in template:
            if not job.get("model"):
                raise ValueError("--jobs-topic routes by {model} but no --model was given")
            return template.format(model=job["model"])
        return template

    async def submit(self, jobs: list[dict]) -> None:
        import json

        futures = []
        for job in jobs:
            value = json.dumps(job, separators=(",", ":"), ensure_ascii=False).encode()
            futures.append(await self.producer.send(self._topic_for(job), value=value, key=job["job_id"].encode()))
        await asyncio.gather(*futures)
        self._raise_if_collector_failed()

    def _raise_if_collector_failed(self) -> None:
        if self.collector is not None and self.collector.done() and not self.collector.cancelled():
            exc = self.collector.exception()
            if exc is not None:
                raise exc

    async def wait_done(self, store: ResultStore, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            t0 = time.monotonic()
            pending = store.counts()["pending"]
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


def run_backfill_sync(cfg: BackfillConfig) -> Summary:
    return asyncio.run(run_backfill(cfg))


__all__ = ["BackfillConfig", "BackfillIncomplete", "Summary", "run_backfill", "run_backfill_sync"]
