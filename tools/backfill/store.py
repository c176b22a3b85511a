"""The on-disk state of one backfill (sqlite, from the standard library).

Tables:
- `rows`:    row number -> job id, row key, and the OpenAI url kind; rewritten each run as the
             input is streamed, so a changed row or config simply points the row at a new job id.
- `results`: job id -> the first Result received (later duplicates of the same job id are
             ignored: at-least-once delivery deduplicated here). Only results of planned rows
             are kept, unless the store is opened with ``keep_unplanned`` (an evaluation plans
             its jobs in several rounds and must keep a result that comes before its round).
- `offsets`: the results-topic position already folded into `results` (committed in the same
             transaction as the results, so a crash never skips or double-counts a result).

Nothing is kept in memory per row: a million-row backfill is a million sqlite rows on disk.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.tools.backfill.rows import PlannedRow

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rows (
    row INTEGER PRIMARY KEY,
    job_id TEXT NOT NULL,
    key TEXT,
    chat INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL
);
CREATE INDEX IF NOT EXISTS rows_by_job ON rows(job_id);
CREATE TABLE IF NOT EXISTS results (
    job_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    received_at REAL NOT NULL,
    result TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS offsets (
    topic TEXT NOT NULL, partition INTEGER NOT NULL, next_offset INTEGER NOT NULL,
    PRIMARY KEY (topic, partition)
);
"""

RETRYABLE = ("error", "expired")


@dataclass(frozen=True)
class StoredRow:
    """One row of the output as the store holds it (`iter_output`)."""

    row: int
    job_id: str
    key: str | None
    chat: bool
    submitted_at: float | None  # unix seconds, when this row's job was last submitted
    received_at: float | None  # unix seconds, when its result was stored
    result: dict[str, Any] | None  # the Result as JSON; None while the row is pending


class ResultStore:
    def __init__(self, path: str | Path, *, keep_unplanned: bool = False):
        self.path = Path(path)
        self.keep_unplanned = keep_unplanned
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # -- meta -------------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    # -- planning ---------------------------------------------------------------------------
    def plan_rows(self, entries: Iterable[PlannedRow], retry_failed: bool) -> list[int]:
        """Record the planned rows; return the indexes (into entries) to submit.

        A row needs a job when its job id has no result, or (with retry_failed) only an error or
        expired one, which is then dropped so the new attempt's result replaces it.
        """
        entries = list(entries)
        todo: list[int] = []
        self.db.execute("BEGIN")
        try:
            self.db.executemany(
                "INSERT OR REPLACE INTO rows(row, job_id, key, chat, submitted_at) VALUES "
                "(?, ?, ?, ?, (SELECT submitted_at FROM rows WHERE row=? AND job_id=?))",
                [(e.number, e.job_id, e.key, int(e.chat), e.number, e.job_id) for e in entries],
            )
            for i, e in enumerate(entries):
                got = self.db.execute("SELECT status FROM results WHERE job_id=?", (e.job_id,)).fetchone()
                if got is None:
                    todo.append(i)
                elif retry_failed and got[0] in RETRYABLE:
                    self.db.execute("DELETE FROM results WHERE job_id=?", (e.job_id,))
                    todo.append(i)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return todo

    def mark_submitted(self, rows: Iterable[int]) -> None:
        now = time.time()
        self.db.execute("BEGIN")
        self.db.executemany("UPDATE rows SET submitted_at=? WHERE row=?", [(now, r) for r in rows])
        self.db.execute("COMMIT")

    def truncate_rows(self, row_count: int) -> None:
        """The input now has row_count rows: forget rows beyond (the dataset shrank)."""
        self.db.execute("DELETE FROM rows WHERE row >= ?", (row_count,))

    def prune_results(self) -> int:
        """Drop results no row points at any more (old template, old rows)."""
        cur = self.db.execute("DELETE FROM results WHERE job_id NOT IN (SELECT job_id FROM rows)")
        return cur.rowcount

    # -- results ----------------------------------------------------------------------------
    def add_results(
        self, results: Iterable[dict[str, Any]], offsets: dict[tuple[str, int], int] | None = None
    ) -> list[dict[str, Any]]:
        """Store results of our rows (any job, with keep_unplanned) that have none yet; return the
        ones newly stored.

        offsets (topic, partition) -> next offset are saved in the same transaction.
        """
        added = []
        now = time.time()
        self.db.execute("BEGIN")
        try:
            for res in results:
                job_id = res.get("job_id")
                if not isinstance(job_id, str):
                    continue
                if not self.keep_unplanned and self.db.execute(
                    "SELECT 1 FROM rows WHERE job_id=? LIMIT 1", (job_id,)
                ).fetchone() is None:
                    continue  # not one of this backfill's rows (or a row since changed)
                usage = res.get("usage") or {}
                cur = self.db.execute(
                    "INSERT OR IGNORE INTO results(job_id, status, completion_tokens, received_at, result) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (job_id, res.get("status", "error"), int(usage.get("completion_tokens") or 0), now,
                     json.dumps(res, separators=(",", ":"), ensure_ascii=False)),
                )
                if cur.rowcount:
                    added.append(res)
            for (topic, partition), nxt in (offsets or {}).items():
                self.db.execute(
                    "INSERT OR REPLACE INTO offsets(topic, partition, next_offset) VALUES (?, ?, ?)",
                    (topic, partition, nxt),
                )
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return added

    def offsets(self, topic: str) -> dict[int, int]:
        return {
            p: o for p, o in self.db.execute("SELECT partition, next_offset FROM offsets WHERE topic=?", (topic,))
        }

    # -- progress and output ----------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Rows by outcome: ok / error / expired / pending (no result yet)."""
        out = {"ok": 0, "error": 0, "expired": 0, "pending": 0}
        for status, n in self.db.execute(
            "SELECT COALESCE(results.status, 'pending'), COUNT(*) FROM rows "
            "LEFT JOIN results ON results.job_id = rows.job_id GROUP BY 1"
        ):
            out[status] = out.get(status, 0) + n
        return out

    def results_for(self, job_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The stored Result (as JSON) of each of these job ids that has one."""
        out = {}
        for job_id in job_ids:
            got = self.db.execute("SELECT result FROM results WHERE job_id=?", (job_id,)).fetchone()
            if got is not None:
                out[job_id] = json.loads(got[0])
        return out

    def row_count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]

    def iter_output(self) -> Iterator[StoredRow]:
        """Every row with its result (if any), in input order, streamed."""
        cur = self.db.execute(
            "SELECT rows.row, rows.job_id, rows.key, rows.chat, rows.submitted_at, results.received_at, "
            "results.result FROM rows LEFT JOIN results ON results.job_id = rows.job_id ORDER BY rows.row"
        )
        for row, job_id, key, chat, sub, rec, res in cur:
            yield StoredRow(row, job_id, key, bool(chat), sub, rec, json.loads(res) if res is not None else None)
