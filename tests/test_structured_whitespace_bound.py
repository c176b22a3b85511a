"""Flexible JSON whitespace is bounded on every llguidance version the project allows.

llguidance before 1.8 lets its whitespace skip lexeme follow itself, so a bound written in the
grammar does not hold there (whitespace_bound.py); the engine keeps the bound as a mask of its
own. These tests hold it on whichever version is installed: the scan on a hand-made vocabulary,
the packed masks against the scan for every state and token of a real one, the backend's masks
at the bound, and an engine batch of flexible jobs whose runs reach the bound and never pass it.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.structured_helpers import hf_tokenizer, model_shape, output_problem, whitespace_runs
from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.structured.llguidance_backend import FLEXIBLE_WHITESPACE_MAX, LLGuidanceBackend
from tokenmill.engine.structured.whitespace_bound import BROKEN, BoundedMatcher, WhitespaceBound
from tokenmill.engine.types import EngineRequest, FinishReason, SamplingParams, StructuredOutputsParams
from tokenmill.tools.structured_workload import SCHEMAS, structured_workload

NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 64}}, "required": ["text"]}


def allowed_tokens(bound: WhitespaceBound, state: int, vocab: int) -> set[int]:
    words = bound.allowed[state]
    bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return set(bits.nonzero().flatten().tolist())


def test_the_scan_counts_whitespace_runs_outside_strings_only():
    vocab = [b" ", b"  ", b'"', b"\\", b"a", b'" ', b"\n\t", b"  x   ", b"", b'\\"', b"x    ", b'"    ']
    bound = WhitespaceBound(vocab, max_run=3)
    (space, two, quote, backslash, a, quote_space, newline_tab, mixed, empty, escaped_quote, pad,
     quote_pad) = range(len(vocab))

    def run(tokens: list[int], state: int = 0) -> int:
        for t in tokens:
            state = bound.next_state(state, t)
            if state == BROKEN:
                return BROKEN
        return state

    assert run([space, two]) == 3
    assert run([space, two, space]) == BROKEN
    assert run([two, a, two]) == 2  # a byte outside strings ends the run
    assert run([two, newline_tab]) == BROKEN
    assert run([quote, two, two, two]) == bound.in_string  # inside a string nothing is counted
    assert run([quote, backslash, quote, two, two]) == bound.in_string  # an escaped quote stays inside
    assert run([quote, escaped_quote, quote_space]) == 1
    assert run([mixed]) == 3
    assert run([two, mixed]) == BROKEN  # the token's leading run adds to the open one
    assert run([quote, mixed]) == bound.in_string
    assert run([pad]) == BROKEN  # a run inside one token
    assert run([quote_pad]) == bound.in_string  # opens a string: its spaces are text
    assert run([quote, quote_pad]) == BROKEN  # closes one: its spaces are a run of 4
    assert run([quote, backslash, quote_pad]) == bound.in_string  # its quote is escaped
    assert run([quote, backslash, empty, a]) == bound.in_string  # no bytes: the escape is still pending
    # The masks say the same: at a run of 2 one more space fits, two do not.
    every = set(range(len(vocab)))
    assert allowed_tokens(bound, 2, len(vocab)) == {space, quote, backslash, a, quote_space, empty, escaped_quote,
                                                    quote_pad}
    assert allowed_tokens(bound, 3, len(vocab)) == {quote, backslash, a, quote_space, empty, escaped_quote, quote_pad}
    assert allowed_tokens(bound, bound.in_string, len(vocab)) == every - {quote_pad}
    assert allowed_tokens(bound, bound.escape, len(vocab)) == every


def test_the_masks_equal_the_scan_for_every_state_and_token_of_a_real_vocabulary(tiny_llama_dir):
    vocab, eos = model_shape(str(tiny_llama_dir))
    backend = LLGuidanceBackend(hf_tokenizer(str(tiny_llama_dir)), vocab, eos)
    bound = backend.whitespace_bound()
    token_bytes = [backend._llg_tokenizer().decode_bytes([t]) for t in range(vocab)]
    # The vocabulary has every kind of token the scan tells apart.
    assert {b" ", b"\n", b"\t"} <= set(token_bytes)
    assert sum(1 for b in token_bytes if b[:1] == b" " and b.strip()) >= 100
    assert any(b'"' in b for b in token_bytes) and any(b"\\" in b for b in token_bytes)
    for state in range(bound.escape + 1):
        direct = {t for t, data in enumerate(token_bytes) if bound.scan(state, data) != BROKEN}
        assert allowed_tokens(bound, state, vocab) == direct, state
        for t in range(vocab):
            assert bound.next_state(state, t) == bound.scan(state, token_bytes[t]), (state, t)


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    vocab, eos = model_shape(str(tiny_llama_dir))
    return LLGuidanceBackend(hf_tokenizer(str(tiny_llama_dir)), vocab, eos)


def take(backend: LLGuidanceBackend, matcher, text: str) -> None:
    for t in backend._llg_tokenizer().tokenize_str(text):
        assert backend.accept(matcher, t), backend.error(matcher)


def mask_of(backend: LLGuidanceBackend, matcher) -> set[bytes]:
    """The bytes of every token the backend allows next."""
    bitmask = torch.zeros((1, (backend.vocab_size + 31) // 32), dtype=torch.int32)
    backend.fill_bitmask([(matcher, 0)], bitmask)
    bits = ((bitmask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: backend.vocab_size]
    tokenizer = backend._llg_tokenizer()
    return {tokenizer.decode_bytes([t]) for t in bits.nonzero().flatten().tolist()}


def test_the_backend_allows_runs_up_to_the_bound_between_json_tokens_and_none_past_it(backend):
    grammar = backend.compile(StructuredOutputsParams(json=json.dumps(NOTE), whitespace="flexible"))
    assert isinstance(grammar, BoundedMatcher)
    matcher = backend.new_matcher(grammar)
    take(backend, matcher, "{" + " " * (FLEXIBLE_WHITESPACE_MAX - 1))
    allowed = mask_of(backend, matcher)
    assert b" " in allowed and b"  " not in allowed and b'"' in allowed
    take(backend, matcher, "\n")
    allowed = mask_of(backend, matcher)
    assert allowed and not any(b[:1] in (b" ", b"\n", b"\t", b"\r") for b in allowed), allowed
    # One token past the bound is refused with the reason, not taken in.
    space = backend._llg_tokenizer().tokenize_str(" ")
    refused = backend.copy_matcher(matcher)
    assert not backend.accept(refused, space[0])
    assert "whitespace run" in backend.error(refused)
    # Inside a string whitespace is text: no bound; the count starts again after the string.
    take(backend, matcher, '"text"' + " " * FLEXIBLE_WHITESPACE_MAX + ':"' + " " * 40)
    assert b" " in mask_of(backend, matcher)
    take(backend, matcher, '"' + " " * FLEXIBLE_WHITESPACE_MAX)
    assert b" " not in mask_of(backend, matcher)
    take(backend, matcher, "}")
    assert backend.is_finished(matcher)


def test_compact_json_and_other_kinds_keep_a_plain_matcher(backend):
    for params in (StructuredOutputsParams(json=json.dumps(NOTE)), StructuredOutputsParams(regex="[a-z ]+"),
                   StructuredOutputsParams(choice=["a", "b"])):
        assert not isinstance(backend.compile(params), BoundedMatcher), params


def test_flexible_jobs_on_a_random_model_reach_the_bound_and_never_pass_it(tiny_llama_dir):
    """A random model pads JSON with whitespace when it may (runs of ~200 were seen without the
    bound): every run stays within it, some reach it, and every finished output validates."""
    vocab, eos = model_shape(str(tiny_llama_dir))
    workload = structured_workload(vocab, 48, seed=3, special={0, 1, 2, *eos}, max_tokens=160)
    constraints = [StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)].schema, whitespace="flexible")
                   for i in range(48)]
    requests = [EngineRequest(request_id=f"w{i:02d}", prompt_token_ids=workload.prompts[i],
                              sampling=SamplingParams(max_tokens=160, structured_outputs=c,
                                                      **({"temperature": 0.0} if i % 2 == 0 else
                                                         {"temperature": 1.0, "seed": i})))
                for i, c in enumerate(constraints)]
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_num_seqs=48, kv_cache_gb=0.2))
    results = engine.generate(requests)
    longest = []
    for request, constraint in zip(requests, constraints, strict=True):
        d = results[request.request_id]
        assert d.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (request.request_id, d.error)
        longest.append(max(whitespace_runs(d.output_text), default=0))
        if d.finish_reason is FinishReason.STOP:
            assert output_problem(constraint, d.output_text) is None, d.output_text
    assert max(longest) == FLEXIBLE_WHITESPACE_MAX, longest
    assert engine.metrics.constraint_failures == 0
