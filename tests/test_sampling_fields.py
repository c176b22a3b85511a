"""The wire's Sampling (schemas/job.py) and the engine's SamplingParams (worker/engine/types.py)
are one concept written twice, in pydantic and in a torch-free dataclass: held equal here, field
by field, so a new sampling field cannot reach one side only."""

from __future__ import annotations

import dataclasses
import math

import annotated_types
import pytest
from pydantic_core import PydanticUndefined

from tokenmill.engine import types as engine_types
from tokenmill.engine.types import SamplingParams, StructuredOutputsParams
from tokenmill.job_mapping import job_to_engine_request
from tokenmill.schemas.constants import STRUCTURED_OUTPUT_KINDS, WHITESPACE_MODES
from tokenmill.schemas.job import Sampling, StructuredOutputs

ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
CONSTRAINT_FIELDS = {f.name: f for f in dataclasses.fields(StructuredOutputsParams)}


def _engine_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _wire_bounds(name: str) -> dict:
    """ge/gt/le and allow_inf_nan of a wire field, from its own and its type's constraints."""
    info = Sampling.model_fields[name]
    found: dict = {}
    metadata = list(info.metadata)
    ann = info.annotation
    for arg in getattr(ann, "__args__", ()) or ():  # Int64 | None: the bounds sit on the Annotated arm
        metadata += getattr(arg, "__metadata__", ())
    metadata += [inner for m in metadata for inner in getattr(m, "metadata", ())]  # FieldInfo in Annotated
    for m in metadata:
        for key in ("ge", "gt", "le"):
            if getattr(m, key, None) is not None:
                found[key] = getattr(m, key)
        if isinstance(m, annotated_types.Interval):
            found.update({k: v for k, v in (("ge", m.ge), ("gt", m.gt), ("le", m.le)) if v is not None})
        if getattr(m, "allow_inf_nan", None) is False:
            found["finite"] = True
    return found


def _engine_bounds(name: str) -> dict:
    meta = ENGINE_FIELDS[name].metadata
    if "minimum" not in meta:
        return {}
    found = {k: meta[m] for k, m in (("ge", "minimum"), ("gt", "above"), ("le", "maximum")) if meta[m] is not None}
    if meta["finite"]:
        found["finite"] = True
    return found


def test_the_same_field_names():
    assert list(ENGINE_FIELDS) == list(Sampling.model_fields)


@pytest.mark.parametrize("name", list(Sampling.model_fields))
def test_the_same_default(name):
    info = Sampling.model_fields[name]
    wire = info.default_factory() if info.default is PydanticUndefined else info.default
    assert _engine_default(ENGINE_FIELDS[name]) == wire


@pytest.mark.parametrize("name", [n for n, f in ENGINE_FIELDS.items() if "minimum" in f.metadata])
def test_the_same_bounds(name):
    assert _engine_bounds(name) == _wire_bounds(name), name


def test_every_scalar_wire_field_with_bounds_is_bounded_in_the_engine_too():
    for name in Sampling.model_fields:
        if _wire_bounds(name) and not isinstance(_engine_default(ENGINE_FIELDS[name]), list):
            assert _engine_bounds(name), f"{name} has bounds on the wire but none in the engine"


@pytest.mark.parametrize(
    "name,bad",
    [("max_tokens", 0), ("top_p", 0.0), ("top_p", 1.5), ("temperature", math.inf), ("logprobs", 21),
     ("presence_penalty", -2.5), ("repetition_penalty", 0.0), ("top_k", -1), ("seed", 2**63)],
)
def test_values_the_wire_refuses_the_engine_refuses(name, bad):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: bad})
    with pytest.raises(ValueError):
        Sampling.model_validate({name: bad})


def test_min_tokens_above_max_tokens_is_refused_on_both_sides():
    with pytest.raises(ValueError, match="must not exceed"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="must not exceed"):
        Sampling(max_tokens=2, min_tokens=3)


def test_a_job_maps_every_sampling_field_by_name():
    from tokenmill.schemas import Job

    values = {"max_tokens": 9, "min_tokens": 1, "temperature": 0.5, "top_p": 0.5, "top_k": 3, "min_p": 0.1,
              "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 7,
              "stop": ["x"], "stop_token_ids": [4], "ignore_eos": True, "logprobs": 2,
              "structured_outputs": {"choice": ["yes", "no"], "whitespace": "flexible"},
              "prompt_logprobs": 3, "score_from": 2, "n": 2}
    assert set(values) == set(Sampling.model_fields)
    job = Job.model_validate({"job_id": "j", "prompt": "p", "sampling": values})
    got = job_to_engine_request(job).sampling
    unset = {"json": None, "json_object": False, "regex": None, "grammar": None}
    constraint = {**unset, **values["structured_outputs"]}
    assert dataclasses.asdict(got) == {**values, "structured_outputs": constraint}
    got.stop.append("y")  # the engine's lists are its own
    got.structured_outputs.choice.append("maybe")
    assert job.sampling.stop == ["x"] and job.sampling.structured_outputs.choice == ["yes", "no"]


# --- structured_outputs: the wire's StructuredOutputs and the engine's StructuredOutputsParams ---


def test_the_same_constraint_field_names_in_the_same_order():
    assert list(CONSTRAINT_FIELDS) == list(StructuredOutputs.model_fields)
    assert engine_types.CONSTRAINT_KINDS == STRUCTURED_OUTPUT_KINDS
    assert engine_types.WHITESPACE_MODES == WHITESPACE_MODES


@pytest.mark.parametrize("name", list(StructuredOutputs.model_fields))
def test_the_same_constraint_default(name):
    assert _engine_default(CONSTRAINT_FIELDS[name]) == StructuredOutputs.model_fields[name].default


@pytest.mark.parametrize(
    "given",
    [
        {"json": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}},
        {"json": '{"type": "array", "maxItems": 3}', "whitespace": "flexible"},
        {"json_object": True},
        {"regex": "[0-9]{3}"},
        {"choice": ["positive", "negative"]},
        {"grammar": 'start: "a"+'},
    ],
)
def test_every_constraint_kind_reaches_the_engine_as_given(given):
    from tokenmill.schemas import Job

    job = Job.model_validate({"job_id": "j", "prompt": "p", "sampling": {"structured_outputs": given}})
    got = job_to_engine_request(job).sampling.structured_outputs
    assert isinstance(got, StructuredOutputsParams)
    kind = next(k for k in STRUCTURED_OUTPUT_KINDS if k in given)
    assert got.kind == job.sampling.structured_outputs.kind == kind
    assert getattr(got, kind) == given[kind] and got.whitespace == given.get("whitespace", "compact")
    if kind == "json" and isinstance(given["json"], dict):  # key order kept: the output writes keys in it
        assert list(got.json["properties"]) == ["b", "a"]


@pytest.mark.parametrize(
    "bad",
    [{}, {"regex": "a", "choice": ["x"]}, {"json_object": False}, {"regex": ""}, {"grammar": ""},
     {"choice": []}, {"choice": [""]}, {"json": 5}, {"whitespace": "loose", "regex": "a"},
     {"regex": "a", "x": 1}],
)
def test_constraints_the_wire_refuses_the_engine_refuses(bad):
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=bad)
    with pytest.raises(ValueError):
        StructuredOutputs.model_validate(bad)


def test_no_constraint_is_none_on_both_sides():
    from tokenmill.schemas import Job

    job = Job.model_validate({"job_id": "j", "prompt": "p"})
    assert job.sampling.structured_outputs is None
    assert job_to_engine_request(job).sampling.structured_outputs is None
