"""Stable, honest job ids for dataset rows.

A row's job id is a function of exactly what decides its output:

- the dataset identity (its location, or a name given with --dataset-id),
- the row number,
- a fingerprint of the row's content (every column, canonical JSON),
- a fingerprint of the generation config (model, prompt template or column mapping, sampling).

So a rerun of the same backfill finds the results it already has, and a rerun with a changed row,
template, model or sampling setting gets new ids and new results; an old result is never reused
for a question it did not answer. Format: `bf-<dataset:8>-<row:09d>-<digest:16>` (readable row
number, well under the 256-character limit).
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import hashlib
import json
from typing import Any


def _jsonable(value: Any) -> Any:
    """Parquet cells may be bytes, dates, decimals: give each one stable text form."""
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, (_dt.date, _dt.datetime, _dt.time)):
        return {"$time": value.isoformat()}
    if isinstance(value, _dt.timedelta):
        return {"$delta": value.total_seconds()}
    if isinstance(value, decimal.Decimal):
        return {"$decimal": str(value)}
    raise TypeError(f"cannot fingerprint a value of type {type(value).__name__}")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_jsonable)


def fingerprint(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def job_id_for(dataset_id: str, row_number: int, row_fp: str, config_fp: str) -> str:
    dataset_fp = hashlib.sha256(dataset_id.encode()).hexdigest()
    digest = hashlib.sha256(f"{dataset_id}\0{row_number}\0{row_fp}\0{config_fp}".encode()).hexdigest()
    return f"bf-{dataset_fp[:8]}-{row_number:09d}-{digest[:16]}"


def job_id_prefix(dataset_id: str) -> str:
    """Every job id of one dataset starts with this (cheap filter on a shared results topic)."""
    return f"bf-{hashlib.sha256(dataset_id.encode()).hexdigest()[:8]}-"
