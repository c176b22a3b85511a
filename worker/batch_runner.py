"""Offline batch inference: a JSONL file of Jobs (or OpenAI batch lines) through the engine.

Input is streamed into tokenmill.offline.OfflineRunner, which keeps at most ``max_in_flight``
requests in the engine; output lines are written as soon as every earlier line is done, so
memory stays bounded by the in-flight window, not by the file. A line that cannot run (bad JSON,
a schema violation, a wrong ``model``, a request the engine refuses) gets an error Result in its
place, and the run goes on.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tokenmill.job_mapping import error_result, new_attempt_id
from tokenmill.offline import OfflineRunner
from tokenmill.schemas import (
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    ERROR_INVALID_JOB,
    ERROR_MODEL_MISMATCH,
    JobDecodeError,
    Result,
    openai_batch_output_line,
    openai_output_refusal,
    read_input_line,
)
from tokenmill.schemas.job import Job

JOB_ID_MAX_CHARS = 256
OUTPUT_FORMATS = ("tokenmill", "openai")


@dataclass
class _Pending:
    """One input line whose output is not written yet."""

    line_no: int
    job: Job | None = None
    url: str | None = None
    result: Result | None = None
    attempt: str = ""


class BatchRunner:
    """One run-batch file: lines in, one output line per input line out, in input order.

    ``engine`` is built by the caller (the ``run-batch`` command builds it from its flags).
    """

    def __init__(self, engine: Any, *, worker_name: str = "run-batch", output_format: str = "tokenmill",
                 max_in_flight: int | None = None, progress: bool = True) -> None:
        if output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output_format must be tokenmill or openai, got {output_format!r}")
        self.offline: OfflineRunner[_Pending] = OfflineRunner(engine, worker=worker_name,
                                                              max_in_flight=max_in_flight)
        self.worker_name = worker_name
        self.output_format = output_format
        self.progress = progress
        self.model_name = self.offline.model_name

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

    def _admit(self, p: _Pending, raw: bytes) -> None:
        """Parse one line and hand it to the engine, or give it an error Result."""
        p.attempt = new_attempt_id(self.worker_name)
        try:
            parsed = read_input_line(raw)
        except JobDecodeError as exc:
            self._error(p, exc.code, exc.message, exc.job_id)
            return
        p.job, p.url = parsed.job, parsed.openai_url
        job = p.job
        refusal = openai_output_refusal(job, p.url) if self.output_format == "openai" and p.url else None
        if refusal is not None:  # its Result could not be written: refused before it runs
            self._error(p, ERROR_INVALID_JOB, refusal, job.job_id)
            return
        if job.model is not None and job.model != self.model_name:
            self._error(p, ERROR_MODEL_MISMATCH,
                        f"job asks for model {job.model!r}; this run serves {self.model_name!r}", job.job_id)
            return
        p.result = self.offline.add(job, p, attempt=p.attempt)  # a Result only if the engine refused it

    # ------------------------------------------------------------------ output
    def _output_line(self, p: _Pending) -> str:
        assert p.result is not None
        if self.output_format == "tokenmill":
            return p.result.model_dump_json(exclude_none=True)
        url = p.url
        if url is None and p.job is not None:
            url = CHAT_COMPLETIONS_URL if p.job.messages is not None else COMPLETIONS_URL
        echo_head = None
        if p.result.prompt_logprobs is not None and p.job is not None:
            echo_head = self._echo_head(p.job)
        return json.dumps(openai_batch_output_line(p.result, url, echo_head=echo_head), ensure_ascii=False)

    def _echo_head(self, job: Job) -> list[str]:
        """The token texts of the prompt before score_from: the echoed head that has no logprob."""
        from tokenmill.engine.tokenizer import encode_request

        tokenizer = self.offline.engine.tokenizer
        ids = encode_request(tokenizer, prompt=job.prompt, messages=job.messages,
                             prompt_token_ids=job.prompt_token_ids)
        return [tokenizer.decode([t], skip_special_tokens=False) for t in ids[: job.sampling.score_from]]

    # ------------------------------------------------------------------ run
    def run(self, input_path: str, output_path: str) -> dict[str, int]:
        in_stream = sys.stdin.buffer if input_path == "-" else open(Path(input_path).expanduser(), "rb")
        out_file = Path(output_path).expanduser()  # as the command's checks read both (worker/cli/preflight.py)
        out_file.parent.mkdir(parents=True, exist_ok=True)
        counts = {"lines": 0, "ok": 0, "error": 0, "expired": 0}
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(unit="line", desc="run-batch", dynamic_ncols=True)
        unwritten: deque[_Pending] = deque()  # lines read, not yet written, in input order
        try:
            with in_stream, open(out_file, "w", encoding="utf-8") as out:
                lines = self._lines(in_stream)
                exhausted = False
                while True:
                    while not exhausted and not self.offline.full:
                        item = next(lines, None)
                        if item is None:
                            exhausted = True
                            break
                        p = _Pending(item[0])
                        unwritten.append(p)
                        self._admit(p, item[1])
                    for p, result in self.offline.step():
                        p.result = result
                    self._flush(unwritten, out, counts, bar)
                    if exhausted and not unwritten:
                        break
        finally:
            if bar is not None:
                bar.close()
        return counts

    def _flush(self, unwritten: deque[_Pending], out, counts, bar) -> None:
        written = 0
        while unwritten and unwritten[0].result is not None:
            p = unwritten.popleft()
            out.write(self._output_line(p) + "\n")
            counts["lines"] += 1
            counts[p.result.status] += 1
            written += 1
        if written:
            out.flush()
            if bar is not None:
                bar.update(written)
