"""`tokenmill backfill`: a dataset in, exactly one output row per input row out, resumable.

One Job per dataset row; results are collected, deduplicated by job_id and written as one output row
per input row, in input order. Rerun the same command after an interruption: only rows without a
result are submitted again. Bad flags, an input that is not there, an output that cannot be written
or (--engine local) a model folder that is not a checkpoint exit 2 before anything loads. With
--engine kafka, a broker that refuses the credentials exits 76, a missing ACL 77; with
--schema-registry the jobs go out in Confluent's wire format (the Job's JSON Schema) and framed
Results are read too, and a registry that refuses the credentials exits 76, the permission 77, one
that does not answer at start 1 (while running, the Results are read again once it answers).
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenmill.cli import preflight
from tokenmill.cli.commands._kafka_client import add_kafka_client_args, client_error_exit, kafka_client_kwargs
from tokenmill.cli.commands._registry_client import (
    add_schema_registry_args,
    registry_error_exit,
    registry_settings_from_args,
)
from tokenmill.cli.engine_options import add_engine_options, engine_kwargs, positive_int

# --model is the served name or the checkpoint; --seed is the jobs' sampling seed.
LOCAL_ENGINE_EXCLUDED = ("model", "seed")


HELP = "run a whole dataset (JSONL, CSV, Parquet; local or s3://) through tokenmill, resumably"


def register(subparsers) -> None:
    p = subparsers.add_parser("backfill", help=HELP, description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--input", required=True, help="dataset path or s3://bucket/key (.jsonl, .csv, .parquet, .gz)")
    p.add_argument("--output", required=True, help="output path or s3:// URL (.jsonl or .parquet)")
    p.add_argument("--input-format", choices=("jsonl", "csv", "parquet"), help="default: from the input name")
    p.add_argument("--output-format", choices=("jsonl", "parquet", "openai"),
                   help="default: from the output name; openai = OpenAI Batch output lines")
    how = p.add_argument_group("rows -> jobs (one of the first three)")
    how.add_argument("--prompt-template", help='e.g. "Summarize: {text}" ({column} fields)')
    how.add_argument("--prompt-column", help="a column holding the whole prompt")
    how.add_argument("--messages-column", help="a column holding chat messages (list or JSON text)")
    how.add_argument("--system-prompt", help="send the prompt as chat messages after this system message")
    how.add_argument("--key-column", help="column copied to the output's key (default: the row number)")
    how.add_argument("--metadata-columns", default="", help="comma-separated columns copied into job metadata")
    how.add_argument("--dataset-id", help="dataset identity for job ids (default: its absolute path or URL)")
    gen = p.add_argument_group("generation")
    gen.add_argument("--model", help="served model name (kafka) or checkpoint folder / s3:// prefix (local)")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--sampling", help="any other sampling fields as a JSON object")
    gen.add_argument("--json-schema", metavar="FILE",
                     help="constrain every output to this JSON Schema (a local file); adds the parsed column")
    gen.add_argument("--choice", action="append", metavar="LABEL",
                     help="constrain every output to one of these labels (repeat: --choice yes --choice no)")
    gen.add_argument("--whitespace", choices=("compact", "flexible"),
                     help="with --json-schema: no free whitespace (compact, the default) or short runs")
    gen.add_argument("--priority", type=int, default=0)
    gen.add_argument("--tenant")
    run = p.add_argument_group("run")
    run.add_argument("--engine", choices=("kafka", "local"), default="kafka",
                     help="kafka: through workers; local: an engine in this process (small jobs)")
    run.add_argument("--state", help="state file (default: OUTPUT.state.sqlite, or the cache for s3://)")
    run.add_argument("--retry-failed", action="store_true", help="also resubmit rows whose result was error/expired")
    run.add_argument("--timeout", type=float, help="give up waiting after this many seconds (state is kept)")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--summary-json", help="also write the summary as JSON to this path")
    k = p.add_argument_group("kafka engine")
    k.add_argument("--jobs-topic", default="tokenmill.jobs",
                   help="jobs topic; 'tokenmill.jobs.{model}' routes by --model")
    k.add_argument("--results-topic", default="tokenmill.results")
    add_kafka_client_args(p, required=False)
    add_schema_registry_args(p.add_argument_group("Schema Registry (kafka engine)"),
                             what="jobs framed with the Job's JSON Schema, framed Results read too")
    loc = p.add_argument_group("local engine")
    loc.add_argument("--max-in-flight", type=positive_int, default=64, help="requests inside the engine at once")
    # Every engine setting, as run-batch has them; --seed above is the sampling seed of the jobs.
    add_engine_options(p, model_required=False, exclude=LOCAL_ENGINE_EXCLUDED)
    p.set_defaults(func=handle)


def _sampling(args: argparse.Namespace) -> dict:
    sampling = {}
    if args.sampling:
        try:
            sampling = json.loads(args.sampling)
        except ValueError as exc:
            raise ValueError(f"--sampling is not JSON: {exc}") from None
        if not isinstance(sampling, dict):
            raise ValueError("--sampling must be a JSON object")
    for name in ("max_tokens", "temperature", "top_p", "seed", "stop"):
        value = getattr(args, name)
        if value is not None:
            sampling[name] = value
    from tokenmill.tools.backfill.constraints import constraint_from_options, with_constraint

    return with_constraint(sampling, constraint_from_options(args.json_schema, args.choice, args.whitespace))


def _registry(args: argparse.Namespace, local: bool):
    """The registry settings (--engine kafka only: a local engine reads and writes no topic)."""
    settings = registry_settings_from_args(args)
    if settings is not None and local:
        raise ValueError("--schema-registry works with --engine kafka only")
    return settings


def problems(args: argparse.Namespace) -> list[str]:
    """The files and, with --engine local, the model, checked before anything loads (an s3:// input,
    output or model is looked at by the run itself, or by remote_model when all else is well)."""
    from tokenmill.storage.s3 import is_s3_url

    found = []
    if not is_s3_url(args.input):
        found += preflight.input_file(args.input, "--input")
    for flag, path in (("--output", args.output), ("--state", args.state), ("--summary-json", args.summary_json)):
        if path and not is_s3_url(path):
            found += preflight.output_file(path, flag, input_path=None if is_s3_url(args.input) else args.input)
    if args.engine == "local" and args.model:  # without --model the backend names what is missing
        found += preflight.model(args.model, backend=args.backend)
        if not found:
            found = preflight.remote_model(args.model, backend=args.backend)
    return found


def handle(args: argparse.Namespace) -> int:
    from tokenmill.tools.backfill import BackfillConfig, BackfillIncomplete, JobSpec, run_backfill_sync
    from tokenmill.tools.backfill.datasets import DatasetError

    found = problems(args)
    try:
        local = args.engine == "local"
        spec = JobSpec(
            prompt_template=args.prompt_template,
            prompt_column=args.prompt_column,
            messages_column=args.messages_column,
            system_prompt=args.system_prompt,
            model=None if local else args.model,
            sampling=_sampling(args),
            priority=args.priority,
            tenant=args.tenant,
            metadata_columns=tuple(c for c in args.metadata_columns.split(",") if c),
        )
        engine_options = engine_kwargs(args, exclude=LOCAL_ENGINE_EXCLUDED)
        cfg = BackfillConfig(
            input=args.input, output=args.output, spec=spec, engine=args.engine,
            input_format=args.input_format, output_format=args.output_format, dataset_id=args.dataset_id,
            key_column=args.key_column, state=args.state, retry_failed=args.retry_failed,
            timeout_s=args.timeout, progress=not args.no_progress,
            bootstrap_servers=args.bootstrap_servers, jobs_topic=args.jobs_topic,
            results_topic=args.results_topic,
            kafka_options={} if local else kafka_client_kwargs(args),
            registry=_registry(args, local),
            model_path=args.model if local else None, engine_options=engine_options,
            max_in_flight=args.max_in_flight,
        )
    except ValueError as exc:
        found.append(str(exc))
    if found:
        return preflight.fail("tokenmill backfill", found)
    summary = None
    code = 0
    try:
        summary = run_backfill_sync(cfg)
    except KeyboardInterrupt:
        print("tokenmill backfill: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except BackfillIncomplete as exc:
        print(f"tokenmill backfill: {exc}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError, DatasetError) as exc:
        print(f"tokenmill backfill: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # refused credentials or a missing ACL: 76 / 77 (the state is kept)
        refused = registry_error_exit("tokenmill backfill", exc)
        if refused is not None:
            return refused
        return client_error_exit("tokenmill backfill", exc)
    print(summary.render(), file=sys.stderr)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary.as_dict(), f, indent=1)
    return code
