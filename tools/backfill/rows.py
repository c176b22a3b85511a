"""A backfill's rows on their way to jobs.

The planner streams the dataset in chunks of `PlannedRow`s: each row's number, stable job id,
output key and URL kind (chat or completion), with its columns. The store records every planned
row and says which need a job (no result yet); only those become Jobs (`jobs_for`), validated
once, or, when a row cannot become one, an `invalid_job` error Result in its place.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.tools.backfill.datasets import iter_rows
from tokenmill.tools.backfill.identity import fingerprint, job_id_for
from tokenmill.tools.backfill.jobs import JobSpec, RowError

if TYPE_CHECKING:
    from tokenmill.schemas import Job

PLAN_CHUNK_ROWS = 512
WORKER_NAME = "backfill"


@dataclass(frozen=True)
class PlannedRow:
    number: int  # 0-based position in the dataset
    job_id: str  # a function of the dataset, the row number, its content and the config
    key: str  # the output's key: --key-column's value, or the row number
    chat: bool  # the job sends chat messages (an OpenAI output line is a chat completion)
    columns: dict[str, Any]  # the row itself, for building its Job


class RowPlanner:
    """Streams chunks of PlannedRows from a local dataset file."""

    def __init__(self, spec: JobSpec, path: Path, fmt: str, dataset_id: str, config_fp: str,
                 key_column: str | None = None):
        self.spec, self.path, self.fmt = spec, path, fmt
        self.dataset_id, self.config_fp, self.key_column = dataset_id, config_fp, key_column
        self.rows_seen = 0

    def chunks(self) -> Iterator[list[PlannedRow]]:
        chunk: list[PlannedRow] = []
        for n, columns in enumerate(iter_rows(self.path, self.fmt)):
            self.rows_seen = n + 1
            chunk.append(PlannedRow(n, job_id_for(self.dataset_id, n, fingerprint(columns), self.config_fp),
                                    self._key(n, columns), self.spec.uses_messages, columns))
            if len(chunk) >= PLAN_CHUNK_ROWS:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def _key(self, n: int, columns: dict[str, Any]) -> str:
        if not self.key_column:
            return str(n)
        if self.key_column not in columns:
            raise ValueError(f"row {n} has no key column {self.key_column!r} (--key-column)")
        return str(columns[self.key_column])


def jobs_for(rows: list[PlannedRow], spec: JobSpec, model_name: str) -> tuple[list[tuple[PlannedRow, Job]], list[dict]]:
    """Each row's validated Job; a row that cannot become one gets an error Result (invalid_job)
    right away, as a stored-result dict."""
    from tokenmill.job_mapping import error_result, new_attempt_id
    from tokenmill.schemas import ERROR_INVALID_JOB

    jobs, errors = [], []
    for row in rows:
        try:
            jobs.append((row, spec.job(row.job_id, row.number, row.columns)))
        except RowError as exc:
            res = error_result(
                row.job_id, ERROR_INVALID_JOB, f"row {row.number}: {exc}", model=model_name or "none",
                worker=WORKER_NAME, attempt=new_attempt_id(WORKER_NAME), metadata={"row": row.number},
            )
            errors.append(res.model_dump(mode="json", exclude_none=True))
    return jobs, errors
