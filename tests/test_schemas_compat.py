"""Contract compatibility: the exported schemas against the recorded version (schemas/compat.py).

A field removed or narrowed fails unless the contract's version is raised; a compatible change
passes but must be recorded, so the field it adds is protected from then on."""

from __future__ import annotations

import copy

import pytest

from tokenmill.schemas import compat
from tokenmill.schemas.constants import CONTRACT_VERSION


def _record() -> dict:
    return compat.read_record()


def _changed(name: str, change) -> dict:
    schemas = copy.deepcopy(compat.current())
    change(schemas[name])
    return schemas


def test_the_exported_schemas_are_compatible_with_the_recorded_contract():
    assert compat.check(_record(), compat.current()) == []
    assert compat.main([]) == 0


def test_the_record_holds_todays_schemas():
    record = _record()
    assert record["version"] == CONTRACT_VERSION
    assert record["schemas"] == compat.current(), (
        "the exported schemas changed compatibly: record them with python -m tokenmill.schemas.compat --record")


def test_removing_a_field_from_the_result_fails():
    schemas = _changed("result", lambda s: s["properties"].pop("usage"))
    assert compat.check(_record(), schemas) == ["result: /usage: removed"]


def test_removing_a_nested_field_or_a_required_one_fails():
    def drop_cached(s):
        s["$defs"]["Usage"]["properties"].pop("cached_prompt_tokens")

    assert compat.check(_record(), _changed("result", drop_cached)) == ["result: /usage/cached_prompt_tokens: removed"]
    problems = compat.check(_record(), _changed("token-event", lambda s: s["required"].remove("index")))
    assert problems == ["token-event: /: no longer always writes index"]


def test_narrowing_a_job_field_fails():
    def cap_max_tokens(s):
        s["$defs"]["Sampling"]["properties"]["max_tokens"]["maximum"] = 4096

    problems = compat.check(_record(), _changed("job", cap_max_tokens))
    assert len(problems) == 1 and problems[0].startswith("job: /sampling/max_tokens: maximum narrowed")

    def integer_temperature(s):
        s["$defs"]["Sampling"]["properties"]["temperature"]["type"] = "integer"

    assert any("temperature" in p for p in compat.check(_record(), _changed("job", integer_temperature)))
    assert compat.check(_record(), _changed("job", lambda s: s["required"].append("tenant"))) == [
        "job: /: now requires tenant"]


def test_widening_an_output_enum_fails_and_narrowing_an_input_enum_fails():
    def new_status(s):
        s["properties"]["status"]["enum"].append("cancelled")

    assert compat.check(_record(), _changed("result", new_status)) == ["result: /status: allowed values widened"]

    def fewer_roles(s):
        s["$defs"]["Message"]["properties"]["role"]["enum"].remove("system")

    assert compat.check(_record(), _changed("job", fewer_roles)) == [
        "job: /messages[]/role: allowed values narrowed"]


def test_an_added_optional_field_is_compatible():
    def add_field(s):
        s["properties"]["shard"] = {"type": "string"}

    for name in ("job", "result"):
        assert compat.check(_record(), _changed(name, add_field)) == []


def test_raising_the_contract_version_allows_a_breaking_change():
    schemas = _changed("result", lambda s: s["properties"].pop("usage"))
    assert compat.check(_record(), schemas, version=CONTRACT_VERSION + 1) == []
    assert compat.check(_record(), schemas, version=CONTRACT_VERSION - 1) != []


@pytest.mark.parametrize("name", ["job", "token-event", "result"])
def test_every_schema_is_compatible_with_itself(name):
    schema = compat.current()[name]
    assert compat.problems(name, schema, copy.deepcopy(schema)) == []
