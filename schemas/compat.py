"""Contract compatibility: today's exported JSON Schemas against the last recorded ones.

``python -m tokenmill.schemas.compat`` checks; ``--record`` writes the recorded version
(``schemas/compat/contract.json``: the contract version and the three schemas) after checking.

Every exported schema must stay compatible with the recorded one, so that a producer or a
reader written against the recorded contract keeps working after an upgrade:

- a **Job** is input: today's schema must accept every Job the recorded one accepted. No
  property may go (unknown fields are rejected, so a producer still sending it would fail), no
  type, enum, bound or length may narrow, nothing may become required, and no new rule
  (`allOf` / `oneOf` entry) may be added;
- a **TokenEvent** and a **Result** are output: every record written today must satisfy the
  recorded schema. No property may go, no type, enum or bound may widen, nothing required may
  become optional, and no recorded rule may be dropped.

A change that breaks this needs the contract's version raised (`CONTRACT_VERSION` in
constants.py); then the check passes and `--record` starts the new version's record. A
compatible change (a new optional field) must be recorded too (the test says so), so that a
field added today is protected tomorrow.

The rules cover what the exported schemas use: `$ref` into `$defs`, `anyOf` branches,
`properties`, `required`, `items`, `enum`/`const`, numeric and length bounds,
`additionalProperties` and `allOf`/`oneOf` rules (compared whole).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenmill.schemas.constants import CONTRACT_VERSION
from tokenmill.schemas.export import SCHEMAS, json_schema

RECORD_PATH = Path(__file__).parent / "compat" / "contract.json"
INPUTS = ("job",)  # the rest are outputs (the worker writes them)

# bound -> +1 when a larger value accepts more, -1 when a smaller one does
_BOUNDS = {"maximum": 1, "exclusiveMaximum": 1, "maxLength": 1, "maxItems": 1, "maxProperties": 1,
           "minimum": -1, "exclusiveMinimum": -1, "minLength": -1, "minItems": -1, "minProperties": -1}
_RULES = ("allOf", "oneOf", "not", "if", "then", "else")


class _Side:
    """One schema document: resolves `$ref`s into its `$defs`."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.defs = root.get("$defs", {})

    def resolve(self, node: Any) -> Any:
        seen = 0
        while isinstance(node, dict) and "$ref" in node and seen < 32:
            ref = node["$ref"]
            if not ref.startswith("#/$defs/"):
                raise ValueError(f"unsupported $ref {ref!r}")
            node = self.defs[ref[len("#/$defs/"):]]
            seen += 1
        return node


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    if t is None:
        if "const" in node:
            return {_json_type(node["const"])}
        if "enum" in node:
            return {_json_type(v) for v in node["enum"]}
        return {"any"}
    return set(t) if isinstance(t, list) else {t}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _covers(wide: set[str], narrow: set[str]) -> bool:
    """Whether every value of the types `narrow` has one of the types `wide`."""
    if "any" in wide:
        return True
    return all(t in wide or (t == "integer" and "number" in wide) for t in narrow)


def _values(node: dict[str, Any]) -> list[Any] | None:
    if "const" in node:
        return [node["const"]]
    return list(node["enum"]) if "enum" in node else None


def _branches(side: _Side, node: Any) -> list[dict[str, Any]]:
    node = side.resolve(node)
    if isinstance(node, dict) and "anyOf" in node:  # beside it only title, default, description
        out = []
        for branch in node["anyOf"]:
            out += _branches(side, branch)
        return out
    return [node if isinstance(node, dict) else {}]


class _Check:
    def __init__(self, old: dict[str, Any], new: dict[str, Any], is_input: bool) -> None:
        self.old, self.new = _Side(old), _Side(new)
        self.is_input = is_input
        self.problems: list[str] = []

    def run(self, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
        self.node(old, new, "")
        return self.problems

    def node(self, old_node: Any, new_node: Any, path: str) -> None:
        olds, news = _branches(self.old, old_node), _branches(self.new, new_node)
        # Input: each recorded branch must still be accepted by a branch of today's schema.
        # Output: each branch of today's must be allowed by a recorded one.
        want, have = (olds, news) if self.is_input else (news, olds)
        for branch in want:
            match = next((h for h in have if _covers(_types(h), _types(branch))), None)
            if match is None:
                kind = "no longer accepts" if self.is_input else "may now write"
                self.problems.append(f"{path or '/'}: {kind} {'/'.join(sorted(_types(branch)))}")
                continue
            o, n = (branch, match) if self.is_input else (match, branch)
            self.pair(o, n, path)

    def pair(self, old: dict[str, Any], new: dict[str, Any], path: str) -> None:
        where = path or "/"
        wide, narrow = (new, old) if self.is_input else (old, new)  # `wide` must accept all of `narrow`
        narrowed = "narrowed" if self.is_input else "widened"
        values_wide, values_narrow = _values(wide), _values(narrow)
        if values_wide is not None and (values_narrow is None or any(v not in values_wide for v in values_narrow)):
            self.problems.append(f"{where}: allowed values {narrowed}")
        for bound, sign in _BOUNDS.items():
            if bound in wide and (bound not in narrow or (narrow[bound] - wide[bound]) * sign > 0):
                self.problems.append(f"{where}: {bound} {narrowed} ({old.get(bound)} -> {new.get(bound)})")
        old_props, new_props = old.get("properties", {}), new.get("properties", {})
        for name, sub in old_props.items():
            if name not in new_props:
                self.problems.append(f"{path}/{name}: removed")
            else:
                self.node(sub, new_props[name], f"{path}/{name}")
        old_req, new_req = set(old.get("required", ())), set(new.get("required", ()))
        if self.is_input and new_req - old_req:
            self.problems.append(f"{where}: now requires {', '.join(sorted(new_req - old_req))}")
        if not self.is_input and old_req - new_req:
            self.problems.append(f"{where}: no longer always writes {', '.join(sorted(old_req - new_req))}")
        if self.is_input and old.get("additionalProperties", True) is not False \
                and new.get("additionalProperties", True) is False:
            self.problems.append(f"{where}: unknown properties now rejected")
        if "items" in old and "items" in new:
            self.node(old["items"], new["items"], f"{path}[]")
        for rule in _RULES:
            old_rules, new_rules = _rule_list(old, rule), _rule_list(new, rule)
            extra = [r for r in (new_rules if self.is_input else old_rules)
                     if r not in (old_rules if self.is_input else new_rules)]
            if extra:
                self.problems.append(f"{where}: {rule} rule {'added' if self.is_input else 'dropped'}")


def _rule_list(node: dict[str, Any], rule: str) -> list[Any]:
    value = node.get(rule)
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def problems(name: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What makes `new` incompatible with `old` for the record type `name` (empty: compatible)."""
    return _Check(old, new, name in INPUTS).run(old, new)


def current() -> dict[str, dict[str, Any]]:
    return {name: json_schema(name) for name in SCHEMAS}


def read_record(path: Path = RECORD_PATH) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def check(record: dict[str, Any], schemas: dict[str, dict[str, Any]], version: int = CONTRACT_VERSION) -> list[str]:
    """Every incompatibility of `schemas` with the record; none when the version was raised."""
    if version > record["version"]:
        return []
    if version < record["version"]:
        return [f"the contract version {version} is older than the recorded {record['version']}"]
    out = []
    for name, schema in schemas.items():
        if name not in record["schemas"]:
            continue  # a new record type: nothing to be compatible with yet
        out += [f"{name}: {p}" for p in problems(name, record["schemas"][name], schema)]
    missing = set(record["schemas"]) - set(schemas)
    out += [f"{name}: record type removed" for name in sorted(missing)]
    return out


def render_record(schemas: dict[str, dict[str, Any]], version: int = CONTRACT_VERSION) -> str:
    return json.dumps({"version": version, "schemas": schemas}, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.schemas.compat", description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true",
                        help="write today's schemas as the recorded version (only when compatible or the "
                             "contract version was raised)")
    args = parser.parse_args(argv)
    schemas = current()
    found = check(read_record(), schemas) if RECORD_PATH.exists() else []
    for line in found:
        print(f"incompatible: {line}", file=sys.stderr)
    if found:
        print(f"raise CONTRACT_VERSION (now {CONTRACT_VERSION}) for a breaking change", file=sys.stderr)
        return 1
    if args.record:
        RECORD_PATH.parent.mkdir(parents=True, exist_ok=True)
        RECORD_PATH.write_text(render_record(schemas), encoding="utf-8")
        print(RECORD_PATH)
    return 0


if __name__ == "__main__":
    sys.exit(main())
