"""Write the backfill output: exactly one row per input row, in input order, streamed from the store.

Formats:
- `jsonl` / `parquet`: columns row, key, job_id, status, text, finish_reason, usage
  {prompt_tokens, completion_tokens, cached_prompt_tokens}, latency_ms (submit -> result received,
  as the backfill saw it), engine_ms (the worker's own arrival -> finish), error_code, error_message;
  with a json, json_object or choice constraint also `parsed` (constraints.py): in JSONL the parsed
  JSON value itself (or the label), in Parquet a string column holding it as compact JSON text (or
  the label), since one schema-free column type has to fit every schema; null where the output
  did not parse. With sampling.n > 1 also `texts`: every choice's text, by index (`text` is
  choice 0's).
- `openai`: OpenAI Batch output lines (`id`, `custom_id`, `response`, `error`), JSONL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.tools.backfill.constraints import OutputParser
from tokenmill.tools.backfill.store import ResultStore, StoredRow

OUTPUT_FORMATS = ("jsonl", "parquet", "openai")
_PARQUET_ROWS_PER_GROUP = 8192


def output_row(stored: StoredRow, parser: OutputParser | None = None, samples: bool = False) -> dict[str, Any]:
    result = stored.result or {}
    usage = result.get("usage") or {}
    error = result.get("error") or {}
    timing = result.get("timing") or {}
    latency = None
    sub, rec = stored.submitted_at, stored.received_at
    if sub is not None and rec is not None and rec >= sub:
        latency = round((rec - sub) * 1000.0, 3)
    row = {
        "row": stored.row,
        "key": stored.key,
        "job_id": stored.job_id,
        "status": result.get("status"),
        "text": result.get("text"),
        "finish_reason": result.get("finish_reason"),
        "usage": {
            "prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0),
            "cached_prompt_tokens": int(usage.get("cached_prompt_tokens") or 0),
        },
        "latency_ms": latency,
        "engine_ms": timing.get("total_ms"),
        "error_code": error.get("code"),
        "error_message": error.get("message"),
    }
    if parser is not None:
        row["parsed"] = parser.value(result)
    if samples:  # n > 1: each choice's text (null for a row without a result's choices, e.g. an error)
        choices = result.get("choices")
        row["texts"] = [c.get("text", "") for c in choices] if choices else None
    return row


def _parquet_schema(parsed: bool, samples: bool = False):
    import pyarrow as pa

    return pa.schema(
        [
            ("row", pa.int64()),
            ("key", pa.string()),
            ("job_id", pa.string()),
            ("status", pa.string()),
            ("text", pa.string()),
            ("finish_reason", pa.string()),
            ("usage", pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                                 ("cached_prompt_tokens", pa.int64())])),
            ("latency_ms", pa.float64()),
            ("engine_ms", pa.float64()),
            ("error_code", pa.string()),
            ("error_message", pa.string()),
        ]
        + ([("parsed", pa.string())] if parsed else [])
        + ([("texts", pa.list_(pa.string()))] if samples else [])
    )


def write_output(
    store: ResultStore, path: Path, fmt: str, parser: OutputParser | None = None, samples: bool = False
) -> int:
    """Write every row of the store to a local file; return the number of rows written.

    Every row must have a result (the caller checks); a row without one is a bug, not a blank line.
    With a parser, the jsonl and parquet rows get the `parsed` column (the parser counts them);
    with `samples` (sampling.n > 1) the `texts` column.
    """
    if fmt not in OUTPUT_FORMATS:
        raise ValueError(f"unknown output format {fmt!r}; expected one of {', '.join(OUTPUT_FORMATS)}")
    written = 0
    expected_row = 0
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = _parquet_schema(parser is not None, samples)
        buf: list[dict] = []
        with pq.ParquetWriter(str(path), schema) as writer:
            for stored in store.iter_output():
                _check(stored, expected_row)
                expected_row += 1
                row = output_row(stored, parser, samples)
                if parser is not None:
                    row["parsed"] = parser.column_text(row["parsed"])
                buf.append(row)
                if len(buf) >= _PARQUET_ROWS_PER_GROUP:
                    writer.write_table(pa.Table.from_pylist(buf, schema=schema))
                    written += len(buf)
                    buf = []
            if buf or written == 0:
                writer.write_table(pa.Table.from_pylist(buf, schema=schema))
                written += len(buf)
        return written

    with open(path, "w", encoding="utf-8") as f:
        for stored in store.iter_output():
            _check(stored, expected_row)
            expected_row += 1
            if fmt == "openai":
                from tokenmill.schemas import Result, openai_batch_output_line

                line = openai_batch_output_line(
                    Result.model_validate(stored.result), "/v1/chat/completions" if stored.chat else "/v1/completions"
                )
            else:
                line = output_row(stored, parser, samples)
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
            written += 1
    return written


def _check(stored: StoredRow, expected: int) -> None:
    if stored.row != expected:
        raise RuntimeError(f"backfill state has a gap: row {expected} missing before row {stored.row}")
    if stored.result is None:
        raise RuntimeError(f"row {stored.row} has no result yet")
