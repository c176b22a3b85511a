"""Results in Avro: the schema derived from the Result's exported JSON Schema, and the records.

Avro is the second format of Results on a schema registry (`--result-format avro`), so a stock
sink (Kafka Connect's S3 or JDBC sinks, Flink) can write them to Parquet or a table. The Avro
schema is derived from the JSON Schema, not written by hand, so the two cannot drift:

- an object with properties is a record (named after its `$defs` entry, namespace `tokenmill`);
  a property that is not required is `["null", T]` with default null;
- string (enums included: a string keeps a new value readable by old readers), integer (long),
  number (double), boolean and array map to their Avro types; a nullable `anyOf` is a union
  with null;
- a free-form object (`metadata`) has no Avro type: it travels as its JSON text.

`to_avro` and `from_avro` convert a Result's JSON form to the Avro record and back; the JSON form
read back validates as the same Result.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.schemas.export import json_schema

NAMESPACE = "tokenmill"
_SCALARS = {"string": "string", "integer": "long", "number": "double", "boolean": "boolean"}


class _Converter:
    def __init__(self, root: dict[str, Any]) -> None:
        self.defs = root.get("$defs", {})
        self.named: set[str] = set()

    def resolve(self, node: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        name = None
        while "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            node = self.defs[name]
        return node, name

    def type_of(self, node: dict[str, Any], name: str | None = None) -> Any:
        node, ref_name = self.resolve(node)
        name = ref_name or name
        if "anyOf" in node:
            branches = [b for b in node["anyOf"] if b.get("type") != "null"]
            nullable = len(branches) < len(node["anyOf"])
            inner = self.type_of(branches[0], name) if len(branches) == 1 else "string"
            return ["null", inner] if nullable else inner
        kind = node.get("type")
        if kind in _SCALARS:
            return _SCALARS[kind]
        if kind == "array":
            return {"type": "array", "items": self.type_of(node.get("items", {}), name)}
        if kind == "object" and node.get("properties"):
            return self.record(node, name or "Record")
        return "string"  # a free-form value: its JSON text

    def record(self, node: dict[str, Any], name: str) -> Any:
        if name in self.named:
            return f"{NAMESPACE}.{name}"
        self.named.add(name)
        required = set(node.get("required", ()))
        fields = []
        for prop, sub in node["properties"].items():
            t = self.type_of(sub, prop.title().replace("_", ""))
            if prop not in required and not (isinstance(t, list) and t[0] == "null"):
                t = ["null", t]
            field: dict[str, Any] = {"name": prop, "type": t}
            if prop not in required:  # a required field that may be null keeps its null when read back
                field["default"] = None
            fields.append(field)
        return {"type": "record", "name": name, "namespace": NAMESPACE, "fields": fields}


def avro_schema(name: str = "result") -> dict[str, Any]:
    """The Avro schema of a record type, derived from its exported JSON Schema."""
    root = json_schema(name)
    return _Converter(root).record(root, root.get("title", "Record"))


def _walk(schema: Any, value: Any, named: dict[str, Any], out: bool) -> Any:
    """value along the Avro schema: every record field present (out=True, to Avro) or the absent
    ones left out (out=False, back to the JSON form)."""
    if value is None:
        return None
    if isinstance(schema, list):
        schema = next(s for s in schema if s != "null")
    if isinstance(schema, str):
        schema = named.get(schema, schema)
    if isinstance(schema, dict) and schema["type"] == "record":
        named.setdefault(f"{NAMESPACE}.{schema['name']}", schema)
        return {f["name"]: _walk(f["type"], value.get(f["name"]), named, out) for f in schema["fields"]
                if out or value.get(f["name"]) is not None or "default" not in f}
    if isinstance(schema, dict) and schema["type"] == "array":
        return [_walk(schema["items"], v, named, out) for v in value]
    return value


class AvroResults:
    """A Result's JSON form to its Avro record and back, for one derived schema."""

    def __init__(self) -> None:
        self.schema = avro_schema("result")
        self._free = _free_form_fields(json_schema("result"))

    def to_avro(self, result: dict[str, Any]) -> dict[str, Any]:
        record = dict(result)
        for name in self._free:
            if record.get(name) is not None:
                record[name] = json.dumps(record[name], ensure_ascii=False, separators=(",", ":"))
        return _walk(self.schema, record, {}, True)

    def from_avro(self, record: dict[str, Any]) -> dict[str, Any]:
        out = _walk(self.schema, record, {}, False)
        for name in self._free:
            if out.get(name) is not None:
                out[name] = json.loads(out[name])
        return out


def _free_form_fields(root: dict[str, Any]) -> list[str]:
    """Top-level properties whose value is a free-form object (sent as JSON text)."""
    conv = _Converter(root)
    return [name for name, sub in root["properties"].items() if conv.type_of(sub) in ("string", ["null", "string"])
            and _is_object(conv, sub)]


def _is_object(conv: _Converter, node: dict[str, Any]) -> bool:
    node, _ = conv.resolve(node)
    kinds = [b.get("type") for b in node.get("anyOf", [node])]
    return "object" in kinds
