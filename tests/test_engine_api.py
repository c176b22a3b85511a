"""Engine API behaviour: seeds, deltas, errors, aborts, deadlines, priorities, tenants, stop rules."""

import time

import pytest

from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.types import EngineRequest, ErrorKind, FinishReason, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return Engine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", kv_cache_gb=0.01, max_model_len=256))


def req(rid, prompt_ids=None, **sampling):
    sampling.setdefault("max_tokens", 8)
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=prompt_ids or [5, 7, 9, 11, 13],
        sampling=SamplingParams(**sampling),
    )


def run_all(engine):
    deltas = []
    while engine.has_work():
        deltas.extend(engine.step())
    return deltas


def test_seeded_request_is_the_same_alone_and_in_a_batch_of_32(engine):
    prompt = list(range(100, 140))
    seeded = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = engine.generate([req("alone", prompt, **seeded)])["alone"].output_token_ids
    batch = [req("in-batch", prompt, **seeded)]
    for i in range(31):
        other = dict(temperature=1.0, max_tokens=5 + i % 13, ignore_eos=True)
        if i % 3 == 0:
            other["seed"] = i
        batch.append(req(f"other{i}", [3 + i] * (1 + 3 * i), **other))
    got = engine.generate(batch)
    assert len(got) == 32
    assert got["in-batch"].output_token_ids == alone
    assert len(alone) == 16
    # A different seed gives a different sequence (the seed is actually used).
    other_seed = engine.generate([req("s2", prompt, **{**seeded, "seed": 99})])["s2"].output_token_ids
    assert other_seed != alone


def test_deltas_concatenate_to_the_final_output(engine):
    engine.add(req("d1", max_tokens=10, temperature=0.0, ignore_eos=True))
    deltas = [d for d in run_all(engine) if d.request_id == "d1"]
    final = deltas[-1]
    assert final.finished and not any(d.finished for d in deltas[:-1])
    assert sum((d.new_token_ids for d in deltas), []) == final.output_token_ids
    assert "".join(d.text_delta for d in deltas) == final.output_text
    assert final.usage.prompt_tokens == 5 and final.usage.completion_tokens == 10
    t = final.timing
    assert t.total_ms >= t.ttft_ms >= t.queue_ms >= 0 and t.decode_ms >= 0


def test_duplicate_ids_and_bad_prompts_raise(engine):
    engine.add(req("dup"))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add(req("dup"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add(req("oob", [1, 2, 10**9]))
    engine.abort("dup")
    run_all(engine)


def test_prompt_too_long_finishes_with_error_at_next_step(engine):
    engine.add(req("long", list(range(3, 300))))
    deltas = engine.step()
    (d,) = [d for d in deltas if d.request_id == "long"]
    assert d.finished and d.finish_reason is FinishReason.ERROR
    assert d.error_kind is ErrorKind.PROMPT_TOO_LONG and "297 tokens" in d.error
    assert engine.count_prompt_tokens(req("x", list(range(3, 300)))) == 297


def test_abort_finishes_running_request_and_frees_blocks(engine):
    engine.add(req("ab", max_tokens=100, ignore_eos=True))
    engine.step()
    engine.abort("ab")
    deltas = engine.step()
    (d,) = [d for d in deltas if d.request_id == "ab"]
    assert d.finish_reason is FinishReason.ABORTED and d.finished
    run_all(engine)
    assert engine.block_manager.num_used_blocks == 0


def test_deadline_passed_before_start_expires(engine):
    r = req("late")
    r.deadline_ms = time.time() * 1000 - 1
    engine.add(r)
    (d,) = [d for d in run_all(engine) if d.request_id == "late"]
    assert d.finish_reason is FinishReason.EXPIRED and d.output_token_ids == []


def test_stop_token_ids_and_min_tokens(engine):
    base = engine.generate([req("probe", max_tokens=12, temperature=0.0, ignore_eos=True)])["probe"]
    stop_tok = base.output_token_ids[3]
    first = base.output_token_ids.index(stop_tok)
    got = engine.generate([req("st", max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok])])["st"]
    assert got.finish_reason is FinishReason.STOP
    assert got.output_token_ids == base.output_token_ids[: first + 1]
    # With min_tokens past that point the stop token cannot end the request early.
    late = engine.generate([req("st2", max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok],
                                min_tokens=first + 3)])["st2"]
    assert len(late.output_token_ids) >= first + 3
    assert stop_tok not in late.output_token_ids[: first + 2]


def test_stop_string_cuts_text(engine):
    base = engine.generate([req("probe2", max_tokens=12, temperature=0.0, ignore_eos=True)])["probe2"]
    text = base.output_text
    assert len(text) > 4
    stop = text[2:4]
    got = engine.generate([req("ss", max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])])["ss"]
    assert got.finish_reason is FinishReason.STOP
    assert got.output_text == text[: text.index(stop)]


def test_stop_string_does_not_end_a_request_before_min_tokens(engine):
    # vLLM's rule: a stop string counts only if it ends in text of a token after the first min_tokens.
    base = engine.generate([req("probe3", max_tokens=16, temperature=0.0, ignore_eos=True)])["probe3"]
    tok = engine.tokenizer
    ids = base.output_token_ids
    stop = base.output_text[1:3]
    assert len(stop) == 2
    early = engine.generate([req("ss-early", max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])])["ss-early"]
    assert early.output_text == base.output_text[: base.output_text.index(stop)]
    min_tokens = 6
    boundary = len(tok.decode(ids[:min_tokens], skip_special_tokens=True))  # text of the first 6 tokens
    later = base.output_text.find(stop, boundary - len(stop) + 1)  # first occurrence ending after it
    got = engine.generate([req("ss-min", max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop],
                               min_tokens=min_tokens)])["ss-min"]
    assert len(got.output_token_ids) > min_tokens or later < 0
    if later < 0:
        assert got.finish_reason is FinishReason.LENGTH and got.output_text == base.output_text
    else:
        assert got.finish_reason is FinishReason.STOP and got.output_text == base.output_text[:later]
    assert len(got.output_text) >= len(early.output_text) + len(stop)  # the early occurrence was passed


def test_logprobs_are_reported_per_token(engine):
    got = engine.generate([req("lp", max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)])
    deltas_lp = got["lp"].logprobs
    assert deltas_lp is not None and len(deltas_lp) == 1
    top = deltas_lp[0].top_logprobs
    assert len(top) == 2 and deltas_lp[0].logprob <= 0


def test_priority_runs_first_when_capacity_is_short(tiny_qwen2_dir):
    eng = Engine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", kv_cache_gb=0.01, max_num_seqs=1))
    eng.add(req("low", max_tokens=3, ignore_eos=True))
    r = req("high", max_tokens=3, ignore_eos=True)
    r.priority = -5
    eng.add(r)
    order = [d.request_id for d in run_all(eng) if d.finished]
    assert order == ["high", "low"]


def test_tenants_never_share_cached_blocks(engine):
    prompt = list(range(500, 560))
    a = req("ta", prompt, max_tokens=2)
    a.tenant = "alice"
    engine.generate([a])
    b = req("tb", prompt, max_tokens=2)
    b.tenant = "bob"
    assert engine.generate([b])["tb"].usage.cached_prompt_tokens == 0
    c = req("tc", prompt, max_tokens=2)
    c.tenant = "alice"
    assert engine.generate([c])["tc"].usage.cached_prompt_tokens == 48


def test_messages_and_text_prompts_are_tokenized(engine):
    r1 = EngineRequest(request_id="m", messages=[{"role": "user", "content": "hello world"}],
                       sampling=SamplingParams(max_tokens=2))
    r2 = EngineRequest(request_id="p", prompt="hello world", sampling=SamplingParams(max_tokens=2))
    got = engine.generate([r1, r2])
    assert got["m"].usage.prompt_tokens > got["p"].usage.prompt_tokens > 0


def test_steps_past_prefill_compute_the_last_layer_only_for_sampling_rows(tiny_qwen2_dir):
    """A step with prompt tokens hands the model OutputRows (the last token of each sampling row);
    a pure decode step does not need them."""
    engine = Engine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", kv_cache_gb=0.01,
                                 max_num_batched_tokens=32))
    seen = []
    forward = engine.model.forward

    def spy(input_ids, positions, meta, kv_caches, output_rows=None):
        hidden = forward(input_ids, positions, meta, kv_caches, output_rows)
        rows = None if output_rows is None else output_rows.index.tolist()
        seen.append((input_ids.shape[0], rows, hidden.shape[0]))
        return hidden

    engine.model.forward = spy
    # 20 + 30 prompt tokens under a 32-token budget: the second prompt is chunked over two steps.
    engine.generate([req("a", list(range(10, 30)), max_tokens=3, ignore_eos=True),
                     req("b", list(range(40, 70)), max_tokens=3, ignore_eos=True)])
    assert seen[0] == (32, [19], 1)  # a's whole prompt samples; b's first 12 tokens do not
    assert seen[1][1] == [0, 18] and seen[1][2] == 2  # a decodes; b's last 18 prompt tokens end there
    assert all(rows is None and tokens == out for tokens, rows, out in seen[2:])  # decode only


# -- final-only requests (EngineRequest.final_only) ----------------------------------------------


def _deltas_of(engine, request):
    engine.add(request)
    return [d for d in run_all(engine) if d.request_id == request.request_id]


@pytest.mark.parametrize("stop", [(), ("e",)])
def test_a_final_only_request_gets_its_final_delta_alone_with_the_same_output(engine, stop):
    from dataclasses import replace

    sampling = dict(max_tokens=24, temperature=0.0, stop=list(stop))
    streamed = _deltas_of(engine, req("streamed", list(range(40, 52)), **sampling))
    final = _deltas_of(engine, replace(req("final", list(range(40, 52)), **sampling), final_only=True))
    assert len(streamed) > 1 and len(final) == 1 and final[0].finished
    want, got = streamed[-1], final[0]
    assert got.output_token_ids == want.output_token_ids and got.finish_reason == want.finish_reason
    assert got.output_text == want.output_text == "".join(d.text_delta for d in streamed)
    # The last token's delta, as for any request; without stop strings the text was decoded at
    # the end, in one piece.
    assert got.new_token_ids == want.new_token_ids == want.output_token_ids[-1:]
    assert got.text_delta == (got.output_text if not stop else want.text_delta)
    assert got.usage == want.usage


def test_a_final_only_request_with_a_stop_string_stops_where_a_streamed_one_does(engine):
    from dataclasses import replace

    probe = engine.generate([req("probe", list(range(60, 70)), max_tokens=24, temperature=0.0)])["probe"]
    stop = probe.output_text[5:8]
    assert stop.strip()
    sampling = dict(max_tokens=24, temperature=0.0, stop=[stop])
    want = _deltas_of(engine, req("s", list(range(60, 70)), **sampling))[-1]
    got = _deltas_of(engine, replace(req("f", list(range(60, 70)), **sampling), final_only=True))
    assert len(got) == 1 and want.finish_reason is FinishReason.STOP
    assert got[0].output_text == want.output_text == probe.output_text[: probe.output_text.index(stop)]
    assert got[0].output_token_ids == want.output_token_ids


def test_an_aborted_final_only_request_keeps_the_text_decoded_so_far(engine):
    from dataclasses import replace

    engine.add(replace(req("ab", list(range(80, 90)), max_tokens=50, temperature=0.0, ignore_eos=True),
                       final_only=True))
    for _ in range(6):
        assert all(not d.new_token_ids for d in engine.step())  # no token deltas
    engine.abort("ab")
    final = [d for d in run_all(engine) if d.request_id == "ab"]
    assert len(final) == 1 and final[0].finish_reason is FinishReason.ABORTED
    ids = final[0].output_token_ids
    assert ids and final[0].output_text == engine.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def test_generate_reads_final_deltas_only_and_leaves_the_callers_requests_alone(engine):
    r = req("g", max_tokens=12, temperature=0.0, ignore_eos=True)
    got = engine.generate([r])["g"]
    assert not r.final_only  # generate marked its own copy
    streamed = _deltas_of(engine, req("g2", max_tokens=12, temperature=0.0, ignore_eos=True))
    assert got.output_token_ids == streamed[-1].output_token_ids
    assert got.output_text == "".join(d.text_delta for d in streamed)
    assert engine.stats().generated_tokens_total >= 24  # final-only tokens are counted too
