"""`tokenmill run-batch --model DIR INPUT.jsonl OUTPUT.jsonl`: offline batch inference, no Kafka.

Each non-blank input line is a Job or an OpenAI batch line (``custom_id`` + ``body``); each gets
exactly one output line, in input order: a Result (``--output-format tokenmill``, the default) or
an OpenAI Batch output line (``--output-format openai``). A line that cannot run (bad JSON, a
schema violation, a wrong ``model``, a prompt the model cannot take) gets an error Result with the
reason, and the run goes on. Exit code 0 when every line got its output line.
"""

from __future__ import annotations

import argparse

from worker.cli.engine_options import add_engine_options, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="run a JSONL file of Jobs or OpenAI batch lines through the engine, no Kafka",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("input", help="JSONL input: Job lines or OpenAI batch lines ('-' = stdin)")
    p.add_argument("output", help="JSONL output, one line per input line, in input order")
    p.add_argument("--output-format", choices=["tokenmill", "openai"], default="tokenmill")
    p.add_argument("--worker-name", default="run-batch", help="worker name written in Results")
    p.add_argument("--max-in-flight", type=positive_int, default=None,
                   help="requests handed to the engine at once (default: 4 x max-num-seqs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from worker.batch_runner import BatchRunner

    runner = BatchRunner.from_args(args)
    summary = runner.run(args.input, args.output)
    print(
        f"run-batch: {summary['lines']} lines -> {summary['ok']} ok, {summary['error']} error, "
        f"{summary['expired']} expired; output {args.output}"
    )
    return 0
