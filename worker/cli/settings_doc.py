"""The settings table of docs/engine.md, rendered from EngineConfig's fields.

``python -m tokenmill.cli.settings_doc`` prints the table; ``--write`` puts it into docs/engine.md
between the two marker comments; ``--check`` exits 1 when the file's table differs from the fields.
A row is a field of ``EngineConfig`` (worker/engine/config.py): its flag comes from the function
that adds it to the commands (``engine_options.flag_of``), its variable from the one that reads it
(``env_var_for``), its default, choices, bounds and help from its ``setting(...)`` metadata. So a
new setting needs no edit here, and the table never names a flag the commands do not have.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from tokenmill.cli import env_var_for
from tokenmill.cli.engine_options import engine_fields, flag_of
from tokenmill.engine.fields import describe_bounds

DOC_PATH = Path("docs/engine.md")
REGENERATE = "python -m tokenmill.cli.settings_doc --write"
BEGIN_MARKER = f"<!-- settings table: generated from EngineConfig by `{REGENERATE}`; do not edit by hand -->"
END_MARKER = "<!-- end of the generated settings table -->"
HEADER = ("setting", "flag", "environment variable", "default", "choices / bounds", "help")


def _cell(text: str) -> str:
    """Markdown table cell text: a pipe would end the cell, a newline the row."""
    return " ".join(text.replace("|", "\\|").split())


def _code(value: Any) -> str:
    return f"`{value}`"


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return _code(value)


def limits_text(f: dataclasses.Field) -> str:
    meta = f.metadata
    if meta["choices"] is not None:
        return ", ".join(_code(choice) for choice in meta["choices"])
    parts = []
    if any(meta[key] is not None for key in ("minimum", "above", "maximum")):
        parts.append(describe_bounds(meta))
    if meta["finite"]:
        parts.append("finite")
    return ", ".join(parts)


def row(f: dataclasses.Field) -> tuple[str, ...]:
    flag = flag_of(f)
    return (_code(f.name), _code(flag), _code(env_var_for(flag)), default_text(f), limits_text(f),
            f.metadata["help"])


def render_table() -> str:
    """The settings table, one row per EngineConfig field in declaration order, ending in a newline."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cell(text) for text in row(f)) + " |" for f in engine_fields()]
    return "\n".join(lines) + "\n"


def table_in(text: str) -> str:
    """What a document holds between the markers. Raises ValueError where they are missing."""
    start = text.find(BEGIN_MARKER)
    end = text.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"the settings table's markers are missing; they are:\n{BEGIN_MARKER}\n{END_MARKER}")
    return text[start + len(BEGIN_MARKER):end].strip("\n") + "\n"


def with_table(text: str) -> str:
    """The document with the current table between its markers."""
    table_in(text)  # the same error where the markers are missing
    start = text.index(BEGIN_MARKER) + len(BEGIN_MARKER)
    end = text.index(END_MARKER)
    return text[:start] + "\n" + render_table() + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.cli.settings_doc",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=DOC_PATH, help="the document holding the markers")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="replace the table between the markers")
    action.add_argument("--check", action="store_true", help="exit 1 when the table between the markers is stale")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        sys.stdout.write(render_table())
        return 0
    text = args.path.read_text(encoding="utf-8")
    if args.check:
        if table_in(text) != render_table():
            print(f"stale: the settings table of {args.path} (run {REGENERATE})", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(with_table(text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
