"""`tokenmill produce`: send Job lines or OpenAI batch lines from a file or stdin to Kafka.

Each line is a Job or an OpenAI batch line (custom_id + body; custom_id becomes the job_id). Invalid
lines are reported with their line numbers and skipped (exit code 1), or stop the run with --strict
(exit code 2; for a file, nothing is sent). A broker that refuses the credentials exits 76, a
missing ACL (WRITE on the jobs topic) 77. With --schema-registry, Jobs are written in Confluent's
wire format with the Job's JSON Schema (subject <jobs topic>-value); a registry that refuses the
credentials exits 76, one that refuses the permission 77, one that does not answer or refuses the
schema 1.
"""

from __future__ import annotations

import argparse
import sys

from tokenmill.cli.commands._kafka_client import add_kafka_client_args, client_error_exit, kafka_client_kwargs
from tokenmill.cli.commands._registry_client import (
    add_schema_registry_args,
    registry_error_exit,
    registry_settings_from_args,
)

HELP = "send Jobs (or OpenAI batch lines) from a JSONL file or stdin to the jobs topic"


def register(subparsers) -> None:
    p = subparsers.add_parser("produce", help=HELP, description=__doc__.split("\n\n", 1)[1])
    p.add_argument("file", help="JSONL file, or - for stdin")
    add_kafka_client_args(p)
    p.add_argument("--jobs-topic", default="tokenmill.jobs",
                   help="topic; with {model} (e.g. tokenmill.jobs.{model}) each job goes to its model's topic")
    p.add_argument("--key", choices=("job_id", "prefix", "none"), default="job_id",
                   help="partition key: job_id, prefix (same system prompt/prompt start -> same worker), none")
    p.add_argument("--prefix-chars", type=int, default=256, help="prompt characters hashed by --key prefix")
    p.add_argument("--rate", type=float, help="at most this many jobs per second")
    p.add_argument("--strict", action="store_true", help="stop at the first invalid line")
    p.add_argument("--no-progress", action="store_true")
    add_schema_registry_args(p.add_argument_group("Schema Registry"),
                             what="Jobs framed with the Job's JSON Schema (subject <jobs topic>-value)")
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    import asyncio

    from tokenmill.tools.produce import ProduceAborted, produce, validate_all

    try:
        kafka_options = kafka_client_kwargs(args)
        registry = registry_settings_from_args(args)
    except ValueError as exc:
        print(f"tokenmill produce: {exc}", file=sys.stderr)
        return 2
    total = None
    if args.file == "-":
        stream = sys.stdin.buffer
    else:
        try:
            stream = open(args.file, "rb")
        except OSError as exc:
            print(f"tokenmill produce: cannot open {args.file}: {exc.strerror}", file=sys.stderr)
            return 2
        if args.strict:
            valid, invalid = validate_all(stream, args.jobs_topic)
            if invalid:
                for bad in invalid:
                    print(f"line {bad.line_no}: {bad.message}", file=sys.stderr)
                print(f"tokenmill produce: {len(invalid)} invalid line(s); nothing sent (--strict)", file=sys.stderr)
                return 2
            total = valid
            stream.seek(0)
        else:
            total = sum(1 for line in stream if line.strip())
            stream.seek(0)
    try:
        report = asyncio.run(produce(
            stream, bootstrap_servers=args.bootstrap_servers, jobs_topic=args.jobs_topic, key=args.key,
            prefix_chars=args.prefix_chars, rate=args.rate, strict=args.strict, total=total,
            progress=not args.no_progress, kafka_options=kafka_options, registry=registry,
        ))
    except ProduceAborted as exc:
        print(f"tokenmill produce: stopped at {exc} (--strict)", file=sys.stderr)
        return 2
    except Exception as exc:  # bad input: 2; refused credentials or a missing ACL: 76 / 77
        refused = registry_error_exit("tokenmill produce", exc)
        if refused is not None:
            return refused
        return client_error_exit("tokenmill produce", exc, bad_input=(ValueError,))
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()
    topics = ", ".join(f"{t}: {n}" for t, n in sorted(report.by_topic.items())) or "none"
    print(f"sent {report.sent} job(s) in {report.elapsed_s:.1f}s ({topics}); "
          f"{len(report.invalid)} invalid line(s) skipped", file=sys.stderr)
    return 1 if report.invalid else 0
