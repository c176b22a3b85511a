"""`tokenmill eval`: lm-evaluation-harness tasks on a model, on a local engine or a worker fleet.

Runs lm_eval.simple_evaluate with the tokenmill evaluation model (worker/eval/lm.py) and prints
lm-eval's results table (with --output, the results JSON too). The shipped tasks (tokenmill_mc,
tokenmill_ppl, tokenmill_gen) are always on the include path. Without --bootstrap-servers an
engine runs in this process (the engine flags apply); with it every request becomes one Job on
the jobs topic, answered by the workers serving the model, and the Results are gathered from the
results topic into a state file: rerun with the same --state after an interruption or a --timeout
and only the jobs without a Result are sent again. Task datasets are read offline (HF_DATASETS_OFFLINE
and HF_HUB_OFFLINE default to 1). Exit codes: 1 a request failed (its error quoted), 2 bad input
(checked before anything loads: the flags, the files, the model folder, the broker answering),
3 Results still missing (the state is kept), 76 / 77 a broker refusing the credentials / a missing
ACL (or a schema registry refusing the credentials / the permission). With --schema-registry the
jobs go out in Confluent's wire format (the Job's JSON Schema) and framed Results are read too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from tokenmill.cli import preflight
from tokenmill.cli.commands._kafka_client import add_kafka_client_args, client_error_exit, kafka_client_kwargs
from tokenmill.cli.commands._registry_client import (
    add_schema_registry_args,
    registry_error_exit,
    registry_settings_from_args,
)
from tokenmill.cli.engine_options import (
    add_engine_options,
    engine_config_from_args,
    engine_fields,
    flag_of,
    positive_float,
)

HELP = "evaluate a model on lm-evaluation-harness tasks, locally or across a worker fleet"
INSTALL_HINT = "lm-eval is not installed: pip install 'tokenmill[eval]'"
OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
# Engine settings that still mean something through Kafka: they tell this command what the
# workers serve (the model's name in the jobs, the longest prompt they take).
FLEET_ENGINE_SETTINGS = ("model", "served_model_name", "max_model_len")
DEFAULT_JOBS_TOPIC = "tokenmill.jobs"
DEFAULT_RESULTS_TOPIC = "tokenmill.results"
KNOWN_TASKS_LISTED = 8


class EvalUsageError(ValueError):
    """A bad command line: printed as one line, exit code 2."""


def limit_value(text: str) -> int | float:
    """--limit: a number of examples per task (>= 1), or a fraction of each task in (0, 1)."""
    problem = f"must be a whole number of examples per task (>= 1) or a fraction in (0, 1), got {text!r}"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(problem) from None
    if 0 < value < 1:
        return value
    if value >= 1 and value == int(value):
        return int(value)
    raise argparse.ArgumentTypeError(problem)


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help=HELP, description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names (globs allowed)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a folder of task YAML files to add (repeatable); the shipped tasks are always there")
    p.add_argument("--limit", type=limit_value, help="examples per task (N), or a fraction of each task (0..1)")
    p.add_argument("--num-fewshot", type=non_negative_int, help="few-shot examples per question (default: the task's)")
    p.add_argument("--max-gen-toks", type=int, default=256, help="generation length of tasks that name none")
    p.add_argument("--bootstrap-iters", type=non_negative_int, default=100000,
                   help="bootstrap resamples for the standard errors of non-mean metrics (0: none)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="render each request through the model's chat template (lm-eval's --apply_chat_template)")
    p.add_argument("--system-instruction", help="a system message before each request (with the chat template)")
    p.add_argument("--fewshot-as-multiturn", action="store_true",
                   help="few-shot examples as chat turns (needs --apply-chat-template)")
    p.add_argument("--output", metavar="FILE.json", help="also write lm-eval's results as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    k = p.add_argument_group("through Kafka (with --bootstrap-servers)")
    k.add_argument("--jobs-topic", default=DEFAULT_JOBS_TOPIC,
                   help="jobs topic; 'tokenmill.jobs.{model}' routes by the served model name")
    k.add_argument("--results-topic", default=DEFAULT_RESULTS_TOPIC)
    k.add_argument("--state", metavar="FILE",
                   help="state file: the Results so far; a rerun with the same file resumes "
                        "(default: a new file for this run in the cache, named in the messages)")
    k.add_argument("--timeout", type=positive_float, metavar="SECONDS",
                   help="give up waiting for Results after this long (the state is kept; rerun to resume)")
    add_kafka_client_args(p, required=False)
    add_schema_registry_args(p.add_argument_group("Schema Registry (through Kafka)"),
                             what="jobs framed with the Job's JSON Schema, framed Results read too")
    # The engine in this process; through Kafka only --model (the tokenizer), --served-model-name
    # and --max-model-len apply (the workers' own settings do the rest).
    add_engine_options(p)
    p.set_defaults(func=handle)


# -- the command line -----------------------------------------------------------------------------
def _task_names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise EvalUsageError("--tasks names no task")
    return names


def _check_mode_flags(args: argparse.Namespace) -> None:
    """Refuse flags of the other mode instead of ignoring them."""
    if args.bootstrap_servers:
        given = []
        for f in engine_fields(FLEET_ENGINE_SETTINGS):
            default = f.default if f.default is not dataclasses.MISSING else None
            if getattr(args, f.name) != default:
                given.append(flag_of(f))
        if given:
            raise EvalUsageError(
                f"{', '.join(given)} set(s) the local engine; through Kafka (--bootstrap-servers) the workers' "
                "own settings apply: leave them out"
            )
        return
    kafka_only = [flag for flag, given in (
        ("--state", args.state is not None), ("--timeout", args.timeout is not None),
        ("--jobs-topic", args.jobs_topic != DEFAULT_JOBS_TOPIC),
        ("--results-topic", args.results_topic != DEFAULT_RESULTS_TOPIC),
        ("--schema-registry", args.schema_registry is not None),
    ) if given]
    if kafka_only:
        raise EvalUsageError(f"{', '.join(kafka_only)} only work(s) through Kafka: add --bootstrap-servers")


def _served_model_name(args: argparse.Namespace, local_dir: Path) -> str:
    """The name the workers give the model: --served-model-name, else for an s3:// model its last
    path part, else the checkpoint folder's name (as `tokenmill worker` and run-batch name it)."""
    if args.served_model_name:
        return args.served_model_name
    if str(args.model).startswith("s3://"):
        return str(args.model).rstrip("/").rsplit("/", 1)[-1]
    return Path(str(local_dir).rstrip("/")).name


def problems(args: argparse.Namespace) -> list[str]:
    """Everything wrong with the command line, its files, its model and its broker, found before lm-eval,
    torch or a model loads (worker/cli/preflight.py): every local problem at once, then, only when
    there is none, the round trips (an s3:// model, the broker)."""
    found = []
    for check in (lambda: _task_names(args.tasks), lambda: _check_mode_flags(args), lambda: _generation_flags(args),
                  lambda: registry_settings_from_args(args)):
        try:
            check()
        except ValueError as exc:  # EvalUsageError, or a bad --schema-registry combination
            found.append(str(exc))
    for folder in args.include_path:
        found += preflight.folder(folder, "--include-path")
    if args.output:
        found += preflight.output_file(args.output, "--output")
    if args.bootstrap_servers and args.state:
        found += preflight.output_file(args.state, "--state")
    fleet = bool(args.bootstrap_servers)
    # Through Kafka: the tokenizer and config only, for workers whose engine is not known here.
    backend = None if fleet else args.backend
    found += preflight.model(args.model, weights=not fleet, backend=backend)
    if not _lm_eval_installed():
        found.append(INSTALL_HINT)
    if found:
        return found
    return [*preflight.remote_model(args.model, weights=not fleet, backend=backend),
            *(preflight.broker(args.bootstrap_servers) if fleet else [])]


def _generation_flags(args: argparse.Namespace) -> None:
    if args.max_gen_toks < 1:
        raise EvalUsageError(f"--max-gen-toks must be >= 1, got {args.max_gen_toks}")
    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise EvalUsageError("--fewshot-as-multiturn needs --apply-chat-template")


def _lm_eval_installed() -> bool:
    """Whether lm-eval can be imported, without importing it (a module set to None counts as absent)."""
    import importlib.util

    if "lm_eval" in sys.modules:
        return sys.modules["lm_eval"] is not None
    return importlib.util.find_spec("lm_eval") is not None


def _set_offline() -> None:
    for name in OFFLINE_VARIABLES:
        os.environ.setdefault(name, "1")


# -- tasks ------------------------------------------------------------------------------------------
def task_manager_for(names: list[str], include_paths: list[str]):
    """lm-eval's TaskManager with the shipped tasks and the --include-path folders (lm-eval's own
    tasks only when a name is not among those, as indexing them takes a while); every name must
    be a known task, group or tag, else EvalUsageError listing some known ones."""
    from lm_eval.tasks import TaskManager

    from tokenmill.eval import TASKS_DIR

    for folder in include_paths:
        if not Path(folder).is_dir():
            raise EvalUsageError(f"--include-path {folder}: not a folder")
    paths = [str(TASKS_DIR), *(str(Path(p).resolve()) for p in include_paths)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if _unknown(manager, names):
        manager = TaskManager(include_path=paths)
    unknown = _unknown(manager, names)
    if unknown:
        local = TaskManager(include_path=[str(TASKS_DIR)], include_defaults=False).all_tasks
        shown = ", ".join(local[:KNOWN_TASKS_LISTED]) + (", ..." if len(local) > KNOWN_TASKS_LISTED else "")
        raise EvalUsageError(
            f"unknown task(s): {', '.join(unknown)}; the shipped tasks are {shown} "
            f"(lm-eval knows {len(manager.all_tasks)} in all: `lm-eval ls tasks`; add folders with --include-path)"
        )
    return manager


def _unknown(manager, names: list[str]) -> list[str]:
    return [n for n in names if not manager.match_tasks([n])]


# -- runs -------------------------------------------------------------------------------------------
def _identity(args: argparse.Namespace, tasks: list[str], model_name: str, max_length: int) -> dict[str, Any]:
    """What names this evaluation in its state file (a different one there is refused)."""
    return {
        "model": model_name, "max_length": max_length, "tasks": tasks, "limit": args.limit,
        "num_fewshot": args.num_fewshot, "max_gen_toks": args.max_gen_toks,
        "chat": [args.apply_chat_template, args.system_instruction, args.fewshot_as_multiturn],
        "include_path": [str(Path(p).resolve()) for p in args.include_path],
    }


def fresh_state_path() -> Path:
    """Without --state, a run keeps its state in a new file of its own (named in its messages): a
    later run never reuses Results it was not asked to (the workers' weights may have changed
    under the same names)."""
    import secrets
    import time

    from tokenmill.storage.checkpoint import cache_root

    return cache_root() / "eval" / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}.sqlite"


def _kafka_runner(args: argparse.Namespace, tasks: list[str]):
    """(runner, tokenizer, model name, max length) for an evaluation through the fleet."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.tokenizer import load_tokenizer
    from tokenmill.eval.kafka_runner import KafkaJobRunner
    from tokenmill.storage import resolve_model_path
    from tokenmill.tools.backfill.kafka_backend import KafkaSettings

    local_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(local_dir)
    max_length = args.max_model_len or load_model_config(local_dir).max_model_len
    name = _served_model_name(args, local_dir)
    identity = _identity(args, tasks, name, max_length)
    if args.state is None:
        args.state = str(fresh_state_path())  # named in the messages, for a rerun to resume
    state = Path(args.state)
    settings = KafkaSettings(args.bootstrap_servers, args.jobs_topic, args.results_topic, kafka_client_kwargs(args),
                             name, registry_settings_from_args(args))
    runner = KafkaJobRunner(settings, state, identity, timeout_s=args.timeout, progress=not args.no_progress)
    return runner, tokenizer, name, max_length


def _local_runner(args: argparse.Namespace):
    from tokenmill.eval.local_runner import LocalJobRunner
    from tokenmill.storage import resolve_model_path

    local_dir = resolve_model_path(args.model)
    served = args.served_model_name
    if served is None and str(args.model).startswith("s3://"):
        served = str(args.model).rstrip("/").rsplit("/", 1)[-1]
    config = engine_config_from_args(args, str(local_dir), served_model_name=served)
    runner = LocalJobRunner(local_dir, config, progress=not args.no_progress)
    return runner, runner.tokenizer, runner.model_name, runner.max_length


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """The evaluation the flags describe; lm-eval's results dict."""
    tasks = _task_names(args.tasks)
    _check_mode_flags(args)
    _generation_flags(args)
    _set_offline()
    try:
        import lm_eval
        from lm_eval.utils import make_table  # noqa: F401  (the table printer: checked with the rest)

        from tokenmill.eval.lm import TokenmillLM
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    manager = task_manager_for(tasks, args.include_path)
    if args.bootstrap_servers:
        runner, tokenizer, name, max_length = _kafka_runner(args, tasks)
    else:
        runner, tokenizer, name, max_length = _local_runner(args)
    try:
        lm = TokenmillLM(tokenizer, runner, model_name=name, max_length=max_length,
                         id_prefix=getattr(runner, "id_prefix", "eval"), max_gen_toks=args.max_gen_toks)
        results = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit, task_manager=manager,
            bootstrap_iters=args.bootstrap_iters, log_samples=False,
            apply_chat_template=args.apply_chat_template, system_instruction=args.system_instruction,
            fewshot_as_multiturn=args.fewshot_as_multiturn,
        )
    finally:
        runner.close()
    if results is None:  # only on a non-zero rank of a distributed run, which this never is
        raise RuntimeError("lm-eval returned no results")
    if args.bootstrap_servers:
        print(f"tokenmill eval: {runner.sent} job(s) sent, {runner.reused} answered from the state "
              f"{runner.state}", file=sys.stderr)
    return results


def handle(args: argparse.Namespace) -> int:
    from tokenmill.eval.kafka_runner import EvalIncomplete, EvalStateMismatch

    prog = "tokenmill eval"
    found = problems(args)
    if found:
        return preflight.fail(prog, found)
    try:
        results = run_eval(args)
    except ImportError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resume = f"; rerun with --state {args.state} to resume" if args.bootstrap_servers and args.state else ""
        print(f"{prog}: interrupted{resume}", file=sys.stderr)
        return 130
    except EvalIncomplete as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 3
    except (EvalUsageError, EvalStateMismatch, FileNotFoundError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from tokenmill.kafka.security import access_denied

        refused = registry_error_exit(prog, exc)  # a registry refusing or not answering: 76 / 77 / 1
        if refused is not None:
            return refused
        if access_denied(exc) is None and isinstance(exc, (RuntimeError, ValueError)):
            # A failed request (its error Result quoted) or a setting the evaluation cannot honour.
            print(f"{prog}: {exc}", file=sys.stderr)
            return 1 if isinstance(exc, RuntimeError) else 2
        return client_error_exit(prog, exc)  # refused credentials or a missing ACL: 76 / 77
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output:
        out = Path(args.output).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    return 0
