"""`tokenmill tail`: follow Results, or reassembled token streams.

Prints Results as they arrive (human-readable, or --json for JSON lines). With --tokens, reassembles
each job's TokenEvents; a new attempt of a job restarts its text. With --schema-registry, records
in Confluent's wire format are read too (Results in JSON Schema or Avro, TokenEvents in JSON
Schema), besides plain JSON. A broker that refuses the credentials exits 76, a missing ACL (READ on
the topic) 77; a registry that refuses the credentials 76, the permission 77, one that does not
answer 1.
"""

from __future__ import annotations

import argparse

from tokenmill.cli.commands._kafka_client import add_kafka_client_args, client_error_exit, kafka_client_kwargs
from tokenmill.cli.commands._registry_client import (
    add_schema_registry_args,
    registry_error_exit,
    registry_settings_from_args,
)

HELP = "follow Results (or, with --tokens, token streams reassembled per job)"


def register(subparsers) -> None:
    p = subparsers.add_parser("tail", help=HELP, description=__doc__.split("\n\n", 1)[1])
    add_kafka_client_args(p)
    p.add_argument("--tokens", action="store_true", help="follow the token stream instead of Results")
    p.add_argument("--job-id", action="append", help="only this job (repeatable)")
    p.add_argument("--from-beginning", action="store_true", help="start at the oldest record, not the end")
    p.add_argument("--json", action="store_true", help="JSON lines (Results as published; streams when finished)")
    p.add_argument("--unique", action="store_true", help="print only the first Result per job_id")
    p.add_argument("--count", type=int, help="exit after this many Results (or finished streams)")
    p.add_argument("--idle-timeout", type=float, help="exit after this many seconds with no new record")
    p.add_argument("--results-topic", default="tokenmill.results")
    p.add_argument("--tokens-topic", default="tokenmill.tokens")
    add_schema_registry_args(p.add_argument_group("Schema Registry"),
                             what="read records in Confluent's wire format (JSON Schema, Avro) too")
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from tokenmill.tools.tail import run_tail

    try:
        run_tail(
            bootstrap_servers=args.bootstrap_servers, results_topic=args.results_topic,
            tokens_topic=args.tokens_topic, tokens=args.tokens,
            job_ids=set(args.job_id) if args.job_id else None, from_beginning=args.from_beginning,
            as_json=args.json, unique=args.unique, count=args.count, idle_timeout=args.idle_timeout,
            kafka_options=kafka_client_kwargs(args), registry=registry_settings_from_args(args),
        )
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # bad flags or topic: 2; refused credentials or a missing ACL: 76 / 77
        refused = registry_error_exit("tokenmill tail", exc)
        if refused is not None:
            return refused
        return client_error_exit("tokenmill tail", exc, bad_input=(ValueError,))
    return 0
