"""`tokenmill schema [job|token-event|result|dead-letter|all]`: print the contract's JSON Schemas."""

from __future__ import annotations

import argparse

CHOICES = ("job", "token-event", "result", "dead-letter", "all")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "schema",
        help="print the JSON Schema of Job, TokenEvent or Result",
        description="Print the JSON Schema (draft 2020-12) of a wire record. 'all' prints one JSON "
        "object keyed by record name.",
    )
    parser.add_argument(
        "record", nargs="?", default="all", choices=CHOICES, help="which record (default: all)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from tokenmill.schemas.export import SCHEMAS, json_schema, render

    if args.record == "all":
        print(json.dumps({name: json_schema(name) for name in SCHEMAS}, indent=2, ensure_ascii=False))
    else:
        print(render(args.record), end="")
    return 0
