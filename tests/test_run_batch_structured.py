"""`tokenmill run-batch --output-format openai` of OpenAI batch lines with `response_format`: every
json_schema line's content parses and validates against its schema, json_object lines give a JSON
object, and a schema that does not compile fails its own line (invalid_constraint) only.

The model is the tiny random Llama: its tokens are noise, so the schemas bound every string and
array (maxLength, maxItems, enums, integer ranges, no additional properties) and the grammar, not
the model, is what ends each output within max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill.cli import main

CHAT = "/v1/chat/completions"


def obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = {
    "sentiment": obj({"label": {"enum": ["positive", "negative", "neutral"]},
                      "score": {"type": "integer", "minimum": 0, "maximum": 9}}),
    "tagged": obj({"name": {"type": "string", "maxLength": 6},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}}),
    "nested": obj({"ok": {"type": "boolean"}, "where": obj({"city": {"type": "string", "maxLength": 5}})}),
    "letters": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
}
# Does not compile: an unknown type (the matcher's reason reaches the line's error message).
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}


def line(custom_id: str, response_format: dict | None, **body) -> dict:
    body = {"messages": [{"role": "user", "content": f"{custom_id}: answer in JSON"}], "max_tokens": 48, **body}
    if response_format is not None:
        body["response_format"] = response_format
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def schema_format(name: str, schema: dict, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, **extra}}


def batch_lines() -> list[dict]:
    lines = []
    for i in range(8):  # each schema twice: greedy and sampled, strict true / false / absent
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        strict = ({"strict": True}, {"strict": False}, {})[i % 3]
        sampling = {"temperature": 0} if i % 2 else {"seed": i, "temperature": 1.0}
        lines.append(line(f"schema-{i}-{name}", schema_format(name, SCHEMAS[name], **strict), **sampling))
    lines.insert(3, line("bad-schema", schema_format("bad", BAD_SCHEMA), max_tokens=8))
    lines.append(line("object-greedy", {"type": "json_object"}, temperature=0))
    lines.append(line("object-seeded", {"type": "json_object"}, seed=1))
    lines.append(line("text", {"type": "text"}, max_tokens=4, temperature=0))
    return lines


@pytest.fixture(scope="module")
def output(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("structured-batch")
    lines = batch_lines()
    src, out = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code = main(["run-batch", "--model", str(tiny_llama_dir), str(src), str(out), "--output-format", "openai",
                 "--kv-cache-gb", "0.02", "--max-num-seqs", "16", "--no-progress"])
    assert code == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [x["custom_id"] for x in lines]  # one line each, in order
    return {g["custom_id"]: g for g in got}


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _choice(out_line: dict) -> dict:
    resp = out_line["response"]
    assert resp["status_code"] == 200 and out_line["error"] is None, resp
    (choice,) = resp["body"]["choices"]
    return choice


def test_every_json_schema_line_validates_against_its_schema(output):
    lines = {k: v for k, v in output.items() if k.startswith("schema-")}
    assert len(lines) == 8
    for custom_id, out_line in lines.items():
        choice = _choice(out_line)
        content = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", (custom_id, content)  # the grammar ended it
        schema = SCHEMAS[custom_id.split("-", 2)[2]]
        jsonschema.validate(json.loads(content), schema)
        # Compact whitespace (the default): none outside string values.
        assert not re.search(r"\s", _JSON_STRING.sub('""', content)), (custom_id, content)


def test_json_object_lines_give_a_json_object(output):
    for custom_id in ("object-greedy", "object-seeded"):
        choice = _choice(output[custom_id])
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_a_bad_schema_fails_its_own_line_only(output):
    bad = output["bad-schema"]["response"]
    assert bad["status_code"] == 400
    error = bad["body"]["error"]
    assert error["code"] == "invalid_constraint" and error["type"] == "invalid_request_error"
    assert "nope" in error["message"]  # the matcher's reason
    others = [v for k, v in output.items() if k != "bad-schema"]
    assert all(v["response"]["status_code"] == 200 for v in others)


def test_a_text_response_format_is_unconstrained(output):
    choice = _choice(output["text"])
    assert choice["finish_reason"] in ("stop", "length")
