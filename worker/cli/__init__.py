"""The `tokenmill` console command.

Each subcommand lives in its own module under ``tokenmill.cli.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed
namespace; its return value is the exit code). Modules are discovered, so adding a command
never touches this file.

Every flag also reads an environment variable ``TOKENMILL_<FLAG_IN_CAPS>`` (dashes become
underscores): ``--bootstrap-servers`` <- ``TOKENMILL_BOOTSTRAP_SERVERS``. A flag given on the
command line wins over the environment.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from tokenmill.cli import commands as _commands_pkg

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_var_for(option: str) -> str:
    return "TOKENMILL_" + option.lstrip("-").replace("-", "_").upper()


def _apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Turn TOKENMILL_* variables into defaults of the matching long options."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _apply_env_defaults(sub)
            continue
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest in ("help",):
            continue
        name = env_var_for(longs[0])
        raw = os.environ.get(name)
        if raw is None:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                parser.error(f"{name}={raw!r}: expected one of true/false/1/0/yes/no")
            value = low in _TRUE
            if isinstance(action, argparse._StoreFalseAction):
                value = not value
            action.default = value
        elif isinstance(action, argparse.BooleanOptionalAction):
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                parser.error(f"{name}={raw!r}: expected one of true/false/1/0/yes/no")
            action.default = low in _TRUE
        else:
            try:
                action.default = action.type(raw) if callable(action.type) else raw
            except (TypeError, ValueError) as exc:
                parser.error(f"{name}={raw!r}: {exc}")
            if action.nargs in ("*", "+") and isinstance(action.default, str):
                action.default = action.default.split(",")
        # An env var satisfies a required option.
        action.required = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="Queue-driven, crash-safe batch inference for LLMs over Apache Kafka.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(_commands_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{_commands_pkg.__name__}.{info.name}")
        module.register(subparsers)
    _apply_env_defaults(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    code = args.func(args)
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
