"""The docs hold what they promise: docs/engine.md's settings table is the one EngineConfig renders
(so a new field fails here until the table is regenerated) and the page names every TOKENMILL_*
variable the engine's code reads; README.md stays short with no long table cell; and every relative
link of README.md and docs/*.md reaches a file (and, into a Markdown file, a heading) that exists."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

from tokenmill.cli import build_parser
from tokenmill.cli.engine_options import ENGINE_GROUP_TITLE
from tokenmill.cli.settings_doc import (
    BEGIN_MARKER,
    END_MARKER,
    REGENERATE,
    main,
    render_table,
    table_in,
)
from tokenmill.engine.config import EngineConfig

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
ENGINE_DOC = REPO / "docs" / "engine.md"
MAX_README_LINES = 200
MAX_TABLE_CELL = 300

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
ENV_NAME = re.compile(r"TOKENMILL_[A-Z0-9_]+")
# Where the engine and its kernels read their own environment variables.
ENGINE_CODE = (REPO / "worker" / "engine", REPO / "kernels")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link syntax and punctuation dropped, lower case, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def table_cells(path: Path) -> list[tuple[int, str]]:
    """(line number, cell text) of every cell of every Markdown table row, separator rows left out."""
    cells = []
    for number, line in prose_lines(path):
        if not line.lstrip().startswith("|"):
            continue
        parts = re.split(r"(?<!\\)\|", line.strip().strip("|"))
        if all(re.fullmatch(r"\s*:?-+:?\s*", part) for part in parts):
            continue
        cells += [(number, part.strip()) for part in parts]
    return cells


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    for number, line in prose_lines(path):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} (no heading with that anchor in {dest.name})")
    return problems


def test_docs_engine_md_holds_exactly_the_settings_table_that_engine_config_renders():
    text = ENGINE_DOC.read_text(encoding="utf-8")
    assert BEGIN_MARKER in text and END_MARKER in text, (
        f"docs/engine.md lost the settings table's markers; put them back and run {REGENERATE}")
    assert table_in(text) == render_table(), (
        f"docs/engine.md's settings table differs from EngineConfig's fields; regenerate it: {REGENERATE}")


def test_the_table_has_a_row_per_engine_config_field_with_the_flag_run_batch_accepts():
    rows = render_table().splitlines()[2:]
    fields = dataclasses.fields(EngineConfig)
    assert [r.split(" | ")[0].strip("| `") for r in rows] == [f.name for f in fields]

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    group = next(g for g in sub.choices["run-batch"]._action_groups if g.title == ENGINE_GROUP_TITLE)
    accepted = {s for action in group._group_actions for s in action.option_strings}
    listed = {r.split(" | ")[1].strip("`") for r in rows}
    assert listed == accepted
    assert "`--no-prefix-caching` | `TOKENMILL_NO_PREFIX_CACHING`" in render_table()


def environment_names_read_by(folders: tuple[Path, ...]) -> set[str]:
    """Every string constant that is a whole TOKENMILL_* name in the folders' Python files."""
    return {node.value for folder in folders for path in folder.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value)}


def test_docs_engine_md_names_every_environment_variable_the_engine_reads():
    text = ENGINE_DOC.read_text(encoding="utf-8")
    missing = sorted(name for name in environment_names_read_by(ENGINE_CODE) if name not in text)
    assert not missing, f"docs/engine.md does not name {', '.join(missing)}, which the engine's code reads"


def test_write_replaces_a_stale_table_between_the_markers_and_check_then_passes(tmp_path):
    doc = tmp_path / "engine.md"
    doc.write_text(f"# Engine\n\nbefore\n{BEGIN_MARKER}\n| old | table |\n{END_MARKER}\nafter\n", encoding="utf-8")
    assert main(["--path", str(doc), "--check"]) == 1
    assert main(["--path", str(doc), "--write"]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# Engine\n\nbefore\n") and text.endswith(f"{END_MARKER}\nafter\n")
    assert table_in(text) == render_table()
    assert main(["--path", str(doc), "--check"]) == 0


def test_readme_is_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_no_table_cell_of_the_readme_is_over_300_characters():
    cells = table_cells(README)
    assert cells, "README.md has no table: the parser found none"
    long = [f"README.md:{n}: {len(c)} characters: {c[:60]}..." for n, c in cells if len(c) > MAX_TABLE_CELL]
    assert not long, "\n".join(long)


def test_every_relative_link_in_the_readme_and_docs_reaches_an_existing_file_and_heading():
    docs = [README, *sorted((REPO / "docs").glob("*.md"))]
    problems = [p for doc in docs for p in broken_links(doc)]
    assert not problems, "\n".join(problems)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section: with `code`\n", encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](other.md#a-section-with-code) [gone](missing.md) [bad](other.md#nowhere) "
        "[web](https://example.com/x.md) `[code](missing.md)`\n```\n[fenced](missing.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(doc, root=tmp_path) == [
        "doc.md:1: missing.md (no such file)",
        "doc.md:1: other.md#nowhere (no heading with that anchor in other.md)",
    ]
