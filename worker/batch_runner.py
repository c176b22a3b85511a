"""Offline batch inference: a JSONL file of Jobs (or OpenAI batch lines) through the engine.

Input is streamed: at most `max_in_flight` requests sit in the engine at once (enough for the
scheduler to batch and to group shared prefixes), and output lines are written as soon as every
earlier line is done, so memory stays bounded by the in-flight window, not by the file.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from schemas import (
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    ERROR_INTERNAL,
    ERROR_INVALID_JOB,
    ERROR_MODEL_MISMATCH,
    ERROR_PROMPT_TOO_LONG,
    JobDecodeError,
    Result,
    openai_batch_output_line,
    read_input_line,
)
from schemas.job import Job
from worker.job_mapping import build_result, error_result, job_to_engine_request, new_attempt_id

JOB_ID_MAX_CHARS = 256


@dataclass
class _Pending:
    """One input line whose output is not written yet."""

    line_no: int
    job: Job | None = None
    url: str | None = None
    result: Result | None = None
    attempt: str = ""


class BatchRunner:
    def __init__(self, engine: Any, *, worker_name: str = "run-batch", output_format: str = "tokenmill",
                 max_in_flight: int | None = None, progress: bool = True) -> None:
        if output_format not in ("tokenmill", "openai"):
            raise ValueError(f"output_format must be tokenmill or openai, got {output_format!r}")
        self.engine = engine
        self.worker_name = worker_name
        self.output_format = output_format
        self.max_in_flight = max_in_flight or 4 * engine.config.max_num_seqs
        self.progress = progress
        self.model_name = engine.served_model_name

    @classmethod
    def from_args(cls, args) -> BatchRunner:
        from worker.cli.engine_options import engine_kwargs
        from worker.engine import Engine, EngineConfig
        from worker.storage.checkpoint import resolve_model_path

        engine = Engine(EngineConfig(model=str(resolve_model_path(args.model)), **engine_kwargs(args)))
        if args.served_model_name is None and str(args.model).startswith("s3://"):
            engine.served_model_name = str(args.model).rstrip("/").rsplit("/", 1)[-1]
        return cls(engine, worker_name=args.worker_name, output_format=args.output_format,
                   max_in_flight=args.max_in_flight, progress=not args.no_progress)

    # ------------------------------------------------------------------ input
    @staticmethod
    def _lines(stream: IO[bytes]) -> Iterator[tuple[int, bytes]]:
        for line_no, raw in enumerate(stream, start=1):
            if raw.strip():
                yield line_no, raw

    def _error(self, p: _Pending, code: str, message: str, job_id: str | None) -> None:
        jid = job_id if job_id and len(job_id) <= JOB_ID_MAX_CHARS else f"line-{p.line_no}"
        p.result = error_result(
            jid, code, message, model=self.model_name, worker=self.worker_name, attempt=p.attempt,
            metadata=p.job.metadata if p.job is not None else None,
        )

    def _admit(self, p: _Pending, raw: bytes, in_flight: dict[str, _Pending]) -> None:
        """Parse one line and hand it to the engine, or give it an error Result."""
        p.attempt = new_attempt_id(self.worker_name)
        try:
            parsed = read_input_line(raw)
        except JobDecodeError as exc:
            self._error(p, exc.code, exc.message, exc.job_id)
            return
        p.job, p.url = parsed.job, parsed.openai_url
        job = p.job
        if job.model is not None and job.model != self.model_name:
            self._error(p, ERROR_MODEL_MISMATCH,
                        f"job asks for model {job.model!r}; this run serves {self.model_name!r}", job.job_id)
            return
        request_id = f"{p.line_no}:{job.job_id}"  # job ids may repeat in a file; lines do not
        try:
            self.engine.add(job_to_engine_request(job, request_id=request_id))
        except ValueError as exc:
            message = str(exc)
            code = ERROR_PROMPT_TOO_LONG if message.startswith("prompt_too_long") else ERROR_INVALID_JOB
            self._error(p, code, message, job.job_id)
            return
        in_flight[request_id] = p

    # ------------------------------------------------------------------ output
    def _output_line(self, p: _Pending) -> str:
        assert p.result is not None
        if self.output_format == "tokenmill":
            return p.result.model_dump_json(exclude_none=True)
        url = p.url
        if url is None and p.job is not None:
            url = CHAT_COMPLETIONS_URL if p.job.messages is not None else COMPLETIONS_URL
        return json.dumps(openai_batch_output_line(p.result, url), ensure_ascii=False)

    # ------------------------------------------------------------------ run
    def run(self, input_path: str, output_path: str) -> dict[str, int]:
        in_stream = sys.stdin.buffer if input_path == "-" else open(input_path, "rb")
        out_file = Path(output_path)
        out_file.parent.mkdir(parents=True, exist_ok=True)
        counts = {"lines": 0, "ok": 0, "error": 0, "expired": 0}
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(unit="line", desc="run-batch", dynamic_ncols=True)
        order: dict[int, _Pending] = {}  # line_no -> pending, for lines not yet written
        in_flight: dict[str, _Pending] = {}  # engine request_id -> pending
        next_to_write: list[int] = []  # line numbers in input order, not yet written
        try:
            with in_stream, open(out_file, "w", encoding="utf-8") as out:
                lines = self._lines(in_stream)
                exhausted = False
                while True:
                    while not exhausted and len(in_flight) < self.max_in_flight:
                        item = next(lines, None)
                        if item is None:
                            exhausted = True
                            break
                        line_no, raw = item
                        p = _Pending(line_no)
                        order[line_no] = p
                        next_to_write.append(line_no)
                        self._admit(p, raw, in_flight)
                    if self.engine.has_work():
                        self._step(in_flight)
                    self._flush(order, next_to_write, out, counts, bar)
                    if exhausted and not in_flight and not next_to_write:
                        break
                    if exhausted and in_flight and not self.engine.has_work():
                        for rid, p in list(in_flight.items()):  # cannot happen; never hang on it
                            self._error(p, ERROR_INTERNAL, "the engine dropped the request", p.job.job_id)
                            del in_flight[rid]
        finally:
            if bar is not None:
                bar.close()
        return counts

    def _step(self, in_flight: dict[str, _Pending]) -> None:
        for delta in self.engine.step():
            p = in_flight.get(delta.request_id)
            if p is None:
                continue
            if not delta.finished:
                continue
            del in_flight[delta.request_id]
            try:
                p.result = build_result(
                    p.job, delta, model=self.model_name, worker=self.worker_name, attempt=p.attempt
                )
            except ValueError as exc:  # an engine outcome the contract cannot express: say so
                self._error(p, ERROR_INTERNAL, str(exc), p.job.job_id)

    def _flush(self, order, next_to_write: list[int], out, counts, bar) -> None:
        i = 0
        while i < len(next_to_write) and order[next_to_write[i]].result is not None:
            p = order.pop(next_to_write[i])
            out.write(self._output_line(p) + "\n")
            counts["lines"] += 1
            counts[p.result.status] += 1
            i += 1
        if i:
            del next_to_write[:i]
            out.flush()
            if bar is not None:
                bar.update(i)
