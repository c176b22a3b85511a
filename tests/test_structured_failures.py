"""A constraint that cannot run fails its request loudly and early, and nothing else.

A bad schema (syntax, an unknown type, a $ref to nothing), an unsupported feature (an unknown
format, an unimplemented keyword), a regex that does not compile, a bad grammar, schemas past
llguidance's limits (too large, nested too deep) and one whose compile runs past the engine's time
limit each end as ERROR / INVALID_CONSTRAINT with the library's reason, within the time limit,
while 100 other jobs of the same batch (constrained and not) finish ok. The same bad schema again
fails from the cache without a compile. max_tokens cutting a constrained output gives "length" and
the text as it is.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.structured_helpers import new_matcher, output_problem
from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.types import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    SamplingParams,
    StructuredOutputsParams,
)

COMPILE_TIMEOUT_S = 1.0  # the engine's default is 5 s; lowered so the slow compile below is quick to fail
SLACK_S = 1.5  # scheduling and step time on a shared 2-core machine, on top of the time limit

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                     "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def deep_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def many_properties(n: int) -> dict:
    props = {f"p{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def S(**kw) -> StructuredOutputsParams:  # noqa: N802
    return StructuredOutputsParams(**kw)


# (name, constraint, a piece of llguidance's reason, or None where only the engine can word it)
BAD = [
    ("json_syntax", S(json='{"type": "object", "properties": {'), "EOF while parsing"),
    ("unknown_type", S(json={"type": "strin"}), "Invalid type: strin"),
    ("dangling_ref", S(json={"$ref": "#/$defs/missing"}), "does not exist"),
    ("unknown_format", S(json={"type": "string", "format": "credit-card"}), "Unknown format"),
    ("unimplemented_keyword", S(json={"type": "array", "uniqueItems": True}), "Unimplemented keys"),
    ("regex_syntax", S(regex="(ab"), "unclosed group"),
    ("regex_lookaround", S(regex="(?<=a)b"), "look-around"),
    ("grammar_unknown_rule", S(grammar='start: item\nitem: "a" other'), "unknown name"),
    ("schema_too_large", S(json=many_properties(20_000)), "schema too large"),
    ("nested_too_deep", S(json=deep_arrays(200)), "recursion limit"),
]
# Compiles in about a second on one core: past the lowered time limit.
SLOW = ("compile_past_time_limit", S(json=many_properties(16_000)), None)  # ~3 s to compile

GOOD = [
    None,
    S(json=PERSON),
    S(json_object=True),
    S(regex=r"[a-z]{1,4}-[0-9]{2}"),
    S(choice=["yes", "no", "maybe"]),
    S(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
]


def new_engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_num_seqs=128, kv_cache_gb=0.1,
                               structured_compile_timeout_s=COMPILE_TIMEOUT_S))


@pytest.fixture(scope="module")
def shared_engine(tiny_llama_dir) -> Engine:
    return new_engine(tiny_llama_dir)


@pytest.fixture
def engine(shared_engine):
    yield shared_engine
    left = shared_engine.has_work()
    while shared_engine.has_work():  # the next test starts from an idle engine even after a failure
        shared_engine.step()
    assert not left, "the test left requests in the engine"


def request(rid: str, constraint: StructuredOutputsParams | None, max_tokens: int = 24, **sampling) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[10 + len(rid) % 7, 20, 30, 40, 50],
                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=constraint,
                                                 **sampling))


def run_timed(engine: Engine, requests: list[EngineRequest]) -> tuple[dict, dict]:
    """Add every request, step to the end; returns (final delta, seconds from add to finish) by id."""
    start = time.monotonic()
    for r in requests:
        engine.add(r)
    results, took = {}, {}
    while engine.has_work():
        for d in engine.step():
            if d.finished:
                results[d.request_id] = d
                took[d.request_id] = time.monotonic() - start
    assert sorted(results) == sorted(r.request_id for r in requests)
    return results, took


def assert_invalid_constraint(delta, reason_piece: str | None) -> None:
    assert delta.finish_reason is FinishReason.ERROR, (delta.request_id, delta.finish_reason, delta.output_text)
    assert delta.error_kind is ErrorKind.INVALID_CONSTRAINT, (delta.request_id, delta.error_kind, delta.error)
    assert delta.error and delta.error.strip(), delta.request_id
    if reason_piece is not None:
        assert reason_piece.lower() in delta.error.lower(), (delta.request_id, delta.error)
    assert delta.output_token_ids == []


def test_bad_constraints_fail_with_a_reason_in_time_while_100_other_jobs_finish_ok(engine, tiny_llama_dir):
    failures_before = engine.metrics.constraint_failures
    bad = [*BAD, SLOW]
    reqs = []
    for i in range(100):
        reqs.append(request(f"ok-{i:03d}", GOOD[i % len(GOOD)], max_tokens=4 + i % 20))
        if i % 9 == 4 and bad:  # the bad ones sit among the good ones
            name, constraint, _ = bad.pop(0)
            reqs.append(request(f"bad-{name}", constraint))
    reqs += [request(f"bad-{name}", c) for name, c, _ in bad]
    results, took = run_timed(engine, reqs)

    for name, _, piece in [*BAD, SLOW]:
        d = results[f"bad-{name}"]
        assert_invalid_constraint(d, piece)
        assert took[d.request_id] < COMPILE_TIMEOUT_S + SLACK_S, (name, took[d.request_id])
    assert engine.metrics.constraint_failures - failures_before == len(BAD) + 1

    for i in range(100):
        d = results[f"ok-{i:03d}"]
        constraint = GOOD[i % len(GOOD)]
        assert d.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (d.request_id, d.finish_reason, d.error)
        assert d.error_kind is None and d.output_token_ids
        if constraint is not None and d.finish_reason is FinishReason.STOP:
            assert output_problem(constraint, d.output_text, tiny_llama_dir, d.output_token_ids) is None


@pytest.mark.slow
def test_the_same_bad_constraint_again_fails_fast_from_the_cache(tiny_llama_dir):
    engine = new_engine(tiny_llama_dir)  # its own compile cache: the first submission here compiles
    first, _ = run_timed(engine, [request("first-" + name, c) for name, c, _ in [*BAD, SLOW]])
    # The compile that ran past the limit goes on in its thread and is counted when it ends.
    deadline = time.monotonic() + 60
    while len(engine.metrics.compile_s) < len(BAD) + 1:
        assert time.monotonic() < deadline, "the slow compile never ended"
        time.sleep(0.05)
    compiles = len(engine.metrics.compile_s)
    for name, c, _ in [*BAD, SLOW]:
        engine.add(request("again-" + name, c))
    again = {d.request_id: d for _ in range(2) for d in engine.step()}  # the next step or the one after
    assert len(engine.metrics.compile_s) == compiles  # no compile ran: every failure came from the cache
    for name, _, _ in [*BAD, SLOW]:
        d = again["again-" + name]
        assert d.finished
        # The failure the first compile gave, whatever it was: each constraint's own reason is held in
        # the test above; here, on a loaded machine, a compile queued behind the slow one in the two
        # compile threads may have met the time limit first, and then that is what the cache keeps.
        assert_invalid_constraint(d, None)
        assert d.error == first["first-" + name].error
    # The same schema given as its text is the same cache entry.
    text = json.dumps({"type": "strin"}, separators=(",", ":"))
    d, = run_timed(engine, [request("as-text", S(json=text))])[0].values()
    assert_invalid_constraint(d, "Invalid type")
    assert len(engine.metrics.compile_s) == compiles


def test_max_tokens_cutting_a_constrained_output_gives_length_and_the_text_as_is(engine, tiny_llama_dir):
    # None of these can be complete in 3 tokens.
    cut = {"json": S(json=PERSON), "grammar": S(grammar='start: "<" /[a-z]{30,40}/ ">"'),
           "regex": S(regex=r"[a-z]{30,40}")}
    results, _ = run_timed(engine, [request(f"cut-{k}", c, max_tokens=3) for k, c in cut.items()])
    tokenizer = engine.tokenizer
    for kind, constraint in cut.items():
        d = results[f"cut-{kind}"]
        assert d.finish_reason is FinishReason.LENGTH, (kind, d.finish_reason, d.error)
        assert len(d.output_token_ids) == 3
        assert d.output_text == tokenizer.decode(d.output_token_ids)
        assert output_problem(constraint, d.output_text, tiny_llama_dir, d.output_token_ids) is not None
        matcher = new_matcher(tiny_llama_dir, constraint)  # a prefix the grammar accepts, not yet complete
        assert matcher.consume_tokens(d.output_token_ids) and not matcher.is_accepting(), (kind, d.output_text)


class _SlowBackend:
    """A backend whose compile takes `seconds` (a stand-in for a schema that compiles slowly)."""

    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def compile(self, params):
        time.sleep(self.seconds)
        return object()


def test_a_compile_that_ended_past_the_time_limit_fails_even_when_first_looked_at_after_it_ended():
    # An engine step longer than the time limit (a big batch, a first step) means the compile's
    # outcome is first asked for after the compile has already ended, late: it must still fail.
    from tokenmill.engine.structured.compiler import ConstraintCompiler

    compiler = ConstraintCompiler(_SlowBackend(0.3), timeout_s=0.1)
    entry = compiler.submit(S(regex="[a-z]+"))
    entry.future.result(timeout=10)  # done, 0.3 s after it was submitted, before anyone asked
    outcome = compiler.outcome(entry)
    assert outcome.error is not None and outcome.grammar is None, "a compile past its time limit was used"
    quick = ConstraintCompiler(_SlowBackend(0.0), timeout_s=0.1)
    entry = quick.submit(S(regex="[a-z]+"))
    entry.future.result(timeout=10)
    time.sleep(0.2)  # asked late, but the compile itself ended in time: it is used
    assert quick.outcome(entry).grammar is not None
