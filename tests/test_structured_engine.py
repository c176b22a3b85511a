"""The engine's handling of constrained requests: they wait outside the batch while their
constraint compiles, a compile past the limit fails them alone, failures are cached, abort works
while compiling, constrained rows keep steps synchronous, and the grammar's end ends the request."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.types import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    SamplingParams,
    StructuredOutputsParams,
)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", max_num_seqs=16,
                               structured_compile_timeout_s=1.0))


def _req(rid: str, constraint: StructuredOutputsParams | None = None, **sampling) -> EngineRequest:
    params = dict(max_tokens=30, temperature=0.0) | sampling
    return EngineRequest(request_id=rid, prompt=f"request {rid}:",
                         sampling=SamplingParams(structured_outputs=constraint, **params))


def _run(engine: Engine, until) -> list:
    deltas, deadline = [], time.monotonic() + 60
    while not until(deltas):
        assert time.monotonic() < deadline, "the engine did not get there in 60 s"
        deltas += engine.step()
    return deltas


def _finals(deltas) -> dict:
    return {d.request_id: d for d in deltas if d.finished}


class _GatedCompile:
    """Wraps the backend's compile so a test decides when it returns."""

    def __init__(self, engine: Engine, monkeypatch) -> None:
        self.release = threading.Event()
        self.returned = threading.Event()
        self.calls = 0
        self._compiler = engine.constraints.compiler
        original = engine.constraints.backend.compile

        def compile(params):
            self.calls += 1
            self.release.wait(30)
            try:
                return original(params)
            finally:
                self.returned.set()

        monkeypatch.setattr(engine.constraints.backend, "compile", compile)

    def finish(self) -> None:
        """Let the held compile end, and wait until it has (so its timing lands in this test)."""
        self.release.set()
        assert self.returned.wait(30)
        for entry in list(self._compiler._cache.values()):  # each outcome is set after its timing
            concurrent.futures.wait([entry.future], timeout=30)


def test_a_compiling_request_waits_outside_the_batch_and_others_run(engine, monkeypatch):
    gate = _GatedCompile(engine, monkeypatch)
    engine.add(_req("slow", StructuredOutputsParams(json={"type": "object", "properties": {"k": {"enum": [1, 2]}},
                                                              "required": ["k"]})))
    for i in range(4):
        engine.add(_req(f"free{i}", max_tokens=5, ignore_eos=True))
    deltas = _run(engine, lambda ds: len(_finals(ds)) == 4)
    assert set(_finals(deltas)) == {f"free{i}" for i in range(4)}
    assert engine.held_state()["compiling"] == 1 and engine.scheduler.num_waiting == 0
    gate.release.set()
    final = _finals(_run(engine, lambda ds: "slow" in _finals(ds)))["slow"]
    assert final.finish_reason is FinishReason.STOP and json.loads(final.output_text)["k"] in (1, 2)
    assert not any(engine.held_state().values())


def test_a_compile_past_the_limit_fails_alone_and_the_key_stays_failed(engine, monkeypatch):
    gate = _GatedCompile(engine, monkeypatch)
    constraint = StructuredOutputsParams(regex=r"slow-[a-z]{3}")
    t0 = time.monotonic()  # before the add: the limit counts from there
    engine.add(_req("late", constraint))
    engine.add(_req("fine", max_tokens=4, ignore_eos=True))
    finals = _finals(_run(engine, lambda ds: {"late", "fine"} <= set(_finals(ds))))
    waited = time.monotonic() - t0
    late = finals["late"]
    assert late.finish_reason is FinishReason.ERROR and late.error_kind is ErrorKind.INVALID_CONSTRAINT
    assert "longer than the 1 s limit" in late.error and 1.0 <= waited < 5.0
    assert finals["fine"].finish_reason is FinishReason.LENGTH
    # The same constraint again fails at once from the cache: no second compile.
    engine.add(_req("again", constraint))
    t0 = time.monotonic()
    again = _finals(_run(engine, lambda ds: "again" in _finals(ds)))["again"]
    # Under the 1 s a compile would wait here (gate.calls tells it directly), with room for a loaded machine.
    assert again.error_kind is ErrorKind.INVALID_CONSTRAINT and time.monotonic() - t0 < 0.9
    assert gate.calls == 1
    gate.finish()


def test_a_bad_constraint_fails_fast_from_the_cache(engine):
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/missing"}}})
    compiles = len(engine.metrics.compile_s)
    failures = engine.metrics.constraint_failures
    for rid in ("bad1", "bad2", "bad3"):
        engine.add(_req(rid, bad))
    finals = _finals(_run(engine, lambda ds: len(_finals(ds)) == 3))
    assert {d.error_kind for d in finals.values()} == {ErrorKind.INVALID_CONSTRAINT}
    assert all("/missing" in d.error for d in finals.values())
    assert len(engine.metrics.compile_s) == compiles + 1
    assert engine.metrics.constraint_failures == failures + 3


def test_abort_while_compiling(engine, monkeypatch):
    gate = _GatedCompile(engine, monkeypatch)
    engine.add(_req("gone", StructuredOutputsParams(regex=r"abort-[0-9]+")))
    engine.step()
    engine.abort("gone")
    final = _finals(_run(engine, lambda ds: "gone" in _finals(ds)))["gone"]
    assert final.finish_reason is FinishReason.ABORTED
    assert not any(engine.held_state().values())
    gate.finish()


def test_the_grammar_end_finishes_the_request_without_eos(engine):
    engine.add(_req("pick", StructuredOutputsParams(choice=["alpha", "beta", "gamma"]), temperature=0.9, seed=4))
    final = _finals(_run(engine, lambda ds: "pick" in _finals(ds)))["pick"]
    assert final.finish_reason is FinishReason.STOP and final.output_text in ("alpha", "beta", "gamma")
    assert not set(final.output_token_ids) & set(engine.eos_token_ids)


def test_compact_json_has_no_whitespace_and_validates(engine):
    import jsonschema

    for i in range(6):
        engine.add(_req(f"j{i}", StructuredOutputsParams(json=SCHEMA), temperature=1.0, seed=i, max_tokens=60))
    finals = _finals(_run(engine, lambda ds: len(_finals(ds)) == 6))
    for d in finals.values():
        assert d.finish_reason is FinishReason.STOP, d
        jsonschema.validate(json.loads(d.output_text), SCHEMA)
        assert json.dumps(json.loads(d.output_text), separators=(",", ":"), ensure_ascii=False) == d.output_text


def test_logprobs_are_of_the_unmasked_distribution(engine):
    engine.add(_req("lp", StructuredOutputsParams(regex=r"[0-9]{4}"), logprobs=3))
    engine.add(_req("free", logprobs=3, max_tokens=1))
    finals = _finals(_run(engine, lambda ds: {"lp", "free"} <= set(_finals(ds))))
    lp = finals["lp"]
    assert lp.finish_reason is FinishReason.STOP and len(lp.output_logprobs) == len(lp.output_token_ids) == 4
    for record in lp.output_logprobs:
        assert record.logprob <= 0 and len(record.top_logprobs) == 3
        # the raw distribution's best tokens need not be digits: top-1 is at least as likely
        assert record.top_logprobs[0][2] >= record.logprob


def test_constrained_rows_keep_steps_synchronous(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", async_scheduling="on"))
    assert engine.overlap.active
    engine.add(_req("c", StructuredOutputsParams(regex=r"[a-z]{3}")))
    assert not engine.overlap.active
    final = _finals(_run(engine, lambda ds: "c" in _finals(ds)))["c"]
    assert final.finish_reason is FinishReason.STOP and len(final.output_text) == 3
    assert engine.overlap.active


def test_constraint_shape_errors_are_clear():
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs={})
    with pytest.raises(ValueError, match="unknown keys: jsonschema"):
        SamplingParams(structured_outputs={"jsonschema": {}})
    with pytest.raises(ValueError, match="compact or flexible"):
        StructuredOutputsParams(regex="a", whitespace="pretty")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json={"type": "object"}).key == StructuredOutputsParams(json='{"type":"object"}').key
