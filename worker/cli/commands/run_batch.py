"""`tokenmill run-batch --model DIR INPUT.jsonl OUTPUT.jsonl`: offline batch inference, no Kafka.

Each non-blank input line is a Job or an OpenAI batch line (``custom_id`` + ``body``); each gets
exactly one output line, in input order: a Result (``--output-format tokenmill``, the default) or
an OpenAI Batch output line (``--output-format openai``). A line that cannot run (bad JSON, a
schema violation, a wrong ``model``, a prompt the model cannot take) gets an error Result with the
reason, and the run goes on. Exit code 0 when every line got its output line; 2, before anything
is loaded, for a missing or unreadable input, an output it cannot write, or a model that is not a
checkpoint (worker/cli/preflight.py), each problem on a line of its own.
"""

from __future__ import annotations

import argparse

from tokenmill.cli import preflight
from tokenmill.cli.engine_options import add_engine_options, engine_config_from_args, positive_int

PROG = "tokenmill run-batch"


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


def served_model_name(args: argparse.Namespace) -> str | None:
    """--served-model-name, else for an s3:// model its last path part (the local cache folder's
    name says nothing), else None (the engine names it after the checkpoint folder)."""
    if args.served_model_name is None and str(args.model).startswith("s3://"):
        return str(args.model).rstrip("/").rsplit("/", 1)[-1]
    return args.served_model_name


def problems(args: argparse.Namespace) -> list[str]:
    """Everything wrong with the command line, its files and its model, found without torch."""
    found = [
        *preflight.input_file(args.input, "input"),
        *preflight.output_file(args.output, "output", input_path=args.input),
        *preflight.model(args.model, backend=args.backend),
    ]
    try:  # the settings' cross-field rules (each flag's own bounds were argparse's)
        engine_config_from_args(args, args.model, served_model_name=served_model_name(args))
    except ValueError as exc:
        found.append(str(exc))
    return found or preflight.remote_model(args.model, backend=args.backend)


def build_runner(args: argparse.Namespace):
    """The engine from the flags, and the BatchRunner that drives it."""
    from tokenmill.batch_runner import BatchRunner
    from tokenmill.engine import create_engine
    from tokenmill.storage.checkpoint import resolve_model_path

    config = engine_config_from_args(args, str(resolve_model_path(args.model)),
                                     served_model_name=served_model_name(args))
    return BatchRunner(create_engine(config), worker_name=args.worker_name, output_format=args.output_format,
                       max_in_flight=args.max_in_flight, progress=not args.no_progress)


def run(args: argparse.Namespace) -> int:
    found = problems(args)
    if found:
        return preflight.fail(PROG, found)
    from tokenmill.engine.checkpoint_files import CheckpointError
    from tokenmill.engine.heap import freeze_startup_heap, thaw
    from tokenmill.storage.s3 import S3Error

    try:
        runner = build_runner(args)
    except (CheckpointError, S3Error, FileNotFoundError) as exc:  # what only the load itself could find
        return preflight.fail(PROG, [f"--model {args.model}: {exc}"])
    freeze_startup_heap()  # the engine's start-up objects leave the collector's full passes while it runs
    try:
        summary = runner.run(args.input, args.output)
    finally:
        thaw()
    print(
        f"run-batch: {summary['lines']} lines -> {summary['ok']} ok, {summary['error']} error, "
        f"{summary['expired']} expired; output {args.output}"
    )
    return 0
