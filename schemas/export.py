"""Export the contract's JSON Schema files: ``python -m schemas.export [--check] [--out-dir DIR]``.

The pydantic models are the source of truth; the files in ``schemas/json/`` are generated from
them and a test fails when they drift. ``--check`` exits 1 and names the stale files instead of
writing.

JSON Schema cannot express every rule of the models: the 16 KiB limit on metadata,
``min_tokens <= max_tokens``, ``seed + n - 1`` within 64 bits, a Result's ``choices`` indexed
0..n-1 in order, and the strict integer rule (JSON Schema counts ``1.0`` as an integer; the
models do not) are enforced by the models only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tokenmill.schemas.job import Job
from tokenmill.schemas.records import DeadLetter, Result, TokenEvent

JSON_DIR = Path(__file__).parent / "json"
DIALECT = "https://json-schema.org/draft/2020-12/schema"

# CLI name -> (file stem, model)
SCHEMAS: dict[str, tuple[str, type[BaseModel]]] = {
    "job": ("job", Job),
    "token-event": ("token_event", TokenEvent),
    "result": ("result", Result),
    "dead-letter": ("dead_letter", DeadLetter),
}


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one record type, as a dict."""
    _, model = SCHEMAS[name]
    schema = model.model_json_schema(mode="validation")
    return {"$schema": DIALECT, **schema}


def render(name: str) -> str:
    return json.dumps(json_schema(name), indent=2, ensure_ascii=False) + "\n"


def schema_path(name: str, out_dir: Path = JSON_DIR) -> Path:
    return out_dir / f"{SCHEMAS[name][0]}.schema.json"


def stale_files(out_dir: Path = JSON_DIR) -> list[Path]:
    """Files that are missing or differ from what the models export."""
    stale = []
    for name in SCHEMAS:
        path = schema_path(name, out_dir)
        if not path.exists() or path.read_text(encoding="utf-8") != render(name):
            stale.append(path)
    return stale


def write_all(out_dir: Path = JSON_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in SCHEMAS:
        path = schema_path(name, out_dir)
        path.write_text(render(name), encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m schemas.export", description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=JSON_DIR, help="where the .schema.json files go")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when a file is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.out_dir)
        for path in stale:
            print(f"stale: {path} (run python -m schemas.export)", file=sys.stderr)
        return 1 if stale else 0
    for path in write_all(args.out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
