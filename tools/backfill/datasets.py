"""Stream the rows of a dataset file (JSONL, CSV or Parquet) one at a time.

Rows come out as dicts in file order, never all at once: JSONL and CSV are read line by line,
Parquet record batch by record batch. Gzip-compressed JSONL and CSV (`.gz`) are read as well.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

FORMATS = ("jsonl", "csv", "parquet")
_PARQUET_BATCH_ROWS = 4096


class DatasetError(ValueError):
    """The dataset cannot be read; the message names the file and, where known, the row."""


def detect_format(name: str) -> str:
    lower = name.lower()
    if lower.endswith(".gz"):
        lower = lower[:-3]
    for suffix, fmt in ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "jsonl"),
                        (".csv", "csv"), (".parquet", "parquet"), (".pq", "parquet")):
        if lower.endswith(suffix):
            return fmt
    raise DatasetError(f"cannot tell the format of {name!r} from its name; pass --input-format {{{','.join(FORMATS)}}}")


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def iter_rows(path: str | Path, fmt: str) -> Iterator[dict]:
    path = Path(path)
    if fmt == "jsonl":
        yield from _iter_jsonl(path)
    elif fmt == "csv":
        yield from _iter_csv(path)
    elif fmt == "parquet":
        yield from _iter_parquet(path)
    else:
        raise DatasetError(f"unknown dataset format {fmt!r}; expected one of {', '.join(FORMATS)}")


def count_rows(path: str | Path, fmt: str) -> int:
    """Row count for the progress bar (Parquet: from the footer; text formats: one cheap pass)."""
    path = Path(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if fmt == "jsonl":  # blank lines are skipped by the reader; nothing else needs parsing to count
        with _open_text(path) as f:
            return sum(1 for line in f if line.strip())
    return sum(1 for _ in iter_rows(path, fmt))


def _iter_jsonl(path: Path) -> Iterator[dict]:
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"{path.name} line {line_no}: not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{path.name} line {line_no}: expected a JSON object, got {type(obj).__name__}")
            yield obj


def _iter_csv(path: Path) -> Iterator[dict]:
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            return
        if len(set(reader.fieldnames)) != len(reader.fieldnames):
            raise DatasetError(f"{path.name}: duplicate column names in the header: {reader.fieldnames}")
        for row in reader:
            if None in row:
                raise DatasetError(f"{path.name} line {reader.line_num}: more fields than the header has")
            yield row


def _iter_parquet(path: Path) -> Iterator[dict]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise DatasetError(f"{path.name}: not a readable Parquet file ({exc})") from None
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        yield from batch.to_pylist()
