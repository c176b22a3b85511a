"""tools/structured_workload.py: the bench's 8 schemas accept real instances, and its checks catch bad output."""

import copy
import json

import pytest

from tokenmill.tools.bench_structured import percentile
from tokenmill.tools.structured_workload import (
    SCHEMAS,
    Schema,
    check_choice,
    check_json,
    check_outputs,
    check_regex,
    structured_workload,
    whitespace_run,
    whitespace_runs,
)


def _walk(schema: dict):
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _walk(sub)
    if "items" in schema:
        yield from _walk(schema["items"])


def test_there_are_eight_distinct_schemas_and_each_accepts_its_example():
    assert len(SCHEMAS) == 8 and len({s.name for s in SCHEMAS}) == 8
    assert len({json.dumps(s.schema, sort_keys=True) for s in SCHEMAS}) == 8
    for s in SCHEMAS:
        assert check_json(json.dumps(s.example, separators=(",", ":")), s.schema) is None, s.name


def test_every_schema_is_bounded_so_a_random_model_can_finish():
    kinds = set()
    for s in SCHEMAS:
        for node in _walk(s.schema):
            kinds.add(node.get("type") if "enum" not in node else "enum")
            if node.get("type") == "object":
                assert node["additionalProperties"] is False and node["required"] == list(node["properties"]), s.name
            if node.get("type") == "string" and "enum" not in node:
                assert "maxLength" in node or "pattern" in node, s.name
            if node.get("type") == "array":
                assert "maxItems" in node, s.name
    assert {"object", "array", "enum", "integer", "number", "string", "boolean"} <= kinds
    assert sum("pattern" in n for s in SCHEMAS for n in _walk(s.schema)) >= 5


@pytest.mark.parametrize("schema", SCHEMAS, ids=[s.name for s in SCHEMAS])
def test_check_json_names_what_is_wrong(schema: Schema):
    # A missing key, an unknown key, a wrong type: each is caught, with where it is.
    key = next(iter(schema.example))
    missing = {k: v for k, v in schema.example.items() if k != key}
    assert "required" in check_json(json.dumps(missing), schema.schema)
    extra = {**schema.example, "zz_extra": 1}
    assert "zz_extra" in check_json(json.dumps(extra), schema.schema)
    wrong = copy.deepcopy(schema.example)
    wrong[key] = [wrong[key]]
    assert f"at {key}" in check_json(json.dumps(wrong), schema.schema)
    assert check_json(json.dumps(schema.example)[:-1], schema.schema).startswith("not JSON")


def test_check_json_catches_patterns_enums_bounds_and_lengths():
    person, product, _, _, event, order, _, log = SCHEMAS
    assert "does not match" in check_json(json.dumps({**person.example, "name": "ada"}), person.schema)
    assert "at age" in check_json(json.dumps({**person.example, "age": 121}), person.schema)
    assert "tags/0" in check_json(json.dumps({**person.example, "tags": ["boss"]}), person.schema)
    assert "at title" in check_json(json.dumps({**product.example, "title": "x" * 25}), product.schema)
    assert "at date" in check_json(json.dumps({**event.example, "date": "2025-13-01"}), event.schema)
    assert "at items" in check_json(json.dumps({**order.example, "items": []}), order.schema)
    assert "at labels" in check_json(json.dumps({**log.example, "labels": ["a=b"] * 4}), log.schema)


def test_choice_and_regex_checks():
    assert check_choice("yes", ["yes", "no"]) is None
    assert "not one of the 2 choices" in check_choice("yes ", ["yes", "no"])
    assert check_regex("AB-12", r"[A-Z]+-\d+") is None
    assert "does not match" in check_regex("AB-12x", r"[A-Z]+-\d+")  # the whole text, not a prefix


@pytest.mark.parametrize("text,max_run,run", [
    ('{"a":1,"b":[1,2]}', 0, False),
    ('{"a": 1}', 0, True),  # compact allows no free whitespace at all
    ('{"a": 1}', 1, False),
    ('{"a":  1}', 1, True),
    ('{"a":"x   y","b":"\\"  "}', 0, False),  # inside strings, escaped quotes included, it is content
    ('{"a":1}\n', 0, True),  # padding after the value
    ('{"a":1}\n', 4, True),  # trailing whitespace counts whatever runs the setting allows
    ('{"a":"cut mid string ', 0, False),  # an output cut by max_tokens inside a string
    ('{"a":[1,\n\n\n\n', 0, True),
    ('{"a":"x ', 4, False),  # cut inside a string after a space: content, not padding
    ('{"a": "x ', 4, False),
])
def test_whitespace_run(text, max_run, run):
    assert whitespace_run(text, max_run) is run


def test_whitespace_runs_lists_the_runs_outside_strings():
    assert whitespace_runs('{"a": [1,  2],\t"b c":"  "}\n\n') == [1, 2, 1, 2]
    assert whitespace_runs('{"a":1}') == []


def test_check_outputs_counts_stop_length_valid_and_whitespace():
    person = SCHEMAS[0]
    good = json.dumps(person.example, separators=(",", ":"))
    spaced = json.dumps(person.example)  # valid JSON, but with free whitespace
    out = check_outputs([
        (good, "stop", person), (spaced, "stop", person), ('{"name":"Ada"}', "stop", person),
        ('{"name":"Ad', "length", person), ("", "error", person),
    ])
    assert (out.outputs, out.stop, out.length, out.other, out.valid) == (5, 3, 1, 1, 2)
    assert out.valid_fraction == pytest.approx(2 / 3)
    assert out.whitespace_runs == 1
    assert len(out.problems) == 2 and "required" in out.problems[0] and "error" in out.problems[1]


def test_workload_spreads_requests_over_the_schemas():
    work = structured_workload(2048, num_requests=20, seed=3, special={0, 1, 2})
    assert len(work.prompts) == 20 and work.schema_index[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    assert all(8 <= len(p) <= 32 and min(p) >= 3 and max(p) < 2048 for p in work.prompts)
    assert work.schema_of(9) is SCHEMAS[1]
    assert structured_workload(2048, 20, seed=3, special={0, 1, 2}).prompts == work.prompts


def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_numbers_step_by_exact_binary_fractions_so_validation_is_not_fooled_by_rounding():
    product = SCHEMAS[1]
    assert check_json(json.dumps({**product.example, "price": 12.75}), product.schema) is None
    assert "multiple of" in check_json(json.dumps({**product.example, "price": 12.3}), product.schema)
    for s in SCHEMAS:
        for node in _walk(s.schema):
            if node.get("type") == "number":
                assert 1 / node["multipleOf"] in (2, 4, 8), s.name
