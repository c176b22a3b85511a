"""Greedy constrained output of the engine equals transformers `generate` under the same llguidance
mask (a logits processor, tests/structured_helpers.py), token for token, fp32 on the CPU.

One batch mixes every constraint kind (JSON Schema, any JSON object, regex, choice, a Lark grammar)
with a few unconstrained rows, of prompt lengths that cross block boundaries and max_tokens that cut
some outputs short. The same batch is compared with the reference as it is, with the overlapped
(async) step mode forced on, under preemption (a KV cache too small for the batch), with chunked
prefill (a 7-token step budget), on a second pass served from the prefix cache, and with a prefix
shared with an earlier request. SmolLM2-135M runs chat prompts that ask for JSON, a date, a label,
an expression and short answers its own EOS ends. Seeded sampling with a
temperature keeps every output valid, and the same seeds give the same outputs.
"""

from __future__ import annotations

import random

import pytest

from tests.structured_helpers import (
    chat_prompt_ids,
    constrained_requests,
    hf_constrained_greedy,
    kv_gb_for_blocks,
    model_shape,
    new_matcher,
    output_problem,
)
from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.types import FinishReason, StructuredOutputsParams
from tokenmill.tools.tiny_models import cached_tiny_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tag": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    },
    "required": ["name", "age", "tag"],
    "additionalProperties": False,
}
LIST_GRAMMAR = 'start: "(" list ")"\nlist: NUM | NUM "," list\nNUM: /[0-9]{1,3}/'
EXPR_GRAMMAR = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: " + " | " * "\nNUM: /[1-9][0-9]?/'
SENTIMENTS = ["positive", "negative", "neutral"]

KINDS = [
    StructuredOutputsParams(json=PERSON),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{3}"),
    StructuredOutputsParams(choice=SENTIMENTS),
    StructuredOutputsParams(grammar=LIST_GRAMMAR),
    None,  # an unconstrained row in the same batch
]
PER_KIND = 4
BLOCK = 16


def random_case(model_dir, seed: int = 0, max_len: int = 70, max_new: tuple[int, int] = (10, 40)) -> dict:
    vocab, _ = model_shape(str(model_dir))
    rng = random.Random(seed)
    constraints = [c for c in KINDS for _ in range(PER_KIND)]
    lengths = [1, 15, 16, 17, 31, 32, 33, 64] + [rng.randint(2, max_len) for _ in range(len(constraints) - 8)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    new = [rng.randint(*max_new) for _ in constraints]
    return {"dir": model_dir, "prompts": prompts, "constraints": constraints, "max_new": new}


def smollm2_case() -> dict:
    from tokenmill.tools.smollm2 import cached_smollm2

    model_dir = cached_smollm2()
    asks = [
        (StructuredOutputsParams(json={
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                           "city": {"type": "string", "maxLength": 24}},
            "required": ["name", "age", "city"], "additionalProperties": False,
        }), "Extract the person as JSON with keys name, age and city: John Smith is 42 and lives in Paris."),
        (StructuredOutputsParams(json_object=True), "Describe a cat as a JSON object with its name and colour."),
        (StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
         "On what date did the Second World War end in Europe? Answer as YYYY-MM-DD."),
        (StructuredOutputsParams(choice=SENTIMENTS), "Sentiment of this review: 'I loved this movie, it was great!'"),
        (StructuredOutputsParams(grammar=EXPR_GRAMMAR), "Write an arithmetic expression that equals 10."),
        # Grammars that may end or go on: the model's own EOS ends them (and is part of the output).
        (StructuredOutputsParams(regex=r"[A-Za-z ,.]{1,60}"), "What is the capital of France? Answer in a few words."),
        (StructuredOutputsParams(choice=["yes", "yes, it is", "no"]), "Is Paris in France? Answer yes or no."),
    ]
    prompts = [chat_prompt_ids(model_dir, text) for _, text in asks]
    return {"dir": model_dir, "prompts": prompts, "constraints": [c for c, _ in asks], "max_new": [32] * len(asks)}


def with_reference(case: dict) -> dict:
    case["ref"] = hf_constrained_greedy(case["dir"], case["prompts"], case["constraints"], case["max_new"])
    return case


@pytest.fixture(scope="module", params=["test-llama", "tiny-llama", pytest.param("smollm2", marks=pytest.mark.slow)])
def case(request):
    if request.param == "smollm2":
        return with_reference(smollm2_case())
    return with_reference(random_case(cached_tiny_model(request.param)))


def make_engine(case, num_blocks: int = 400, **options) -> Engine:
    return Engine(EngineConfig(model=str(case["dir"]), dtype="float32",
                               kv_cache_gb=kv_gb_for_blocks(case["dir"], num_blocks), **options))


def requests(case, prefix="r"):
    return constrained_requests(case["prompts"], case["constraints"], case["max_new"], prefix=prefix)


def assert_matches_reference(case, results, prefix="r"):
    """Every request's tokens and finish reason equal the reference's; the mismatches are listed."""
    wrong = []
    for i, (expected, constraint) in enumerate(zip(case["ref"], case["constraints"], strict=True)):
        got = results[f"{prefix}{i}"]
        if got.output_token_ids != expected.token_ids or got.finish_reason is not expected.finish_reason:
            kind = constraint.kind if constraint else "none"
            wrong.append(f"{prefix}{i} ({kind}, prompt {len(case['prompts'][i])} tokens, max_tokens "
                         f"{case['max_new'][i]}): expected {expected.finish_reason.value} {expected.token_ids}, "
                         f"got {got.finish_reason.value} {got.output_token_ids} ({got.error})")
    assert not wrong, "\n".join(wrong)


def assert_reference_is_meaningful(case):
    """The batch holds outputs the grammar completes (on the random models, max_tokens cuts others)."""
    finishes = {(c.kind if c else None, e.finish_reason) for c, e in zip(case["constraints"], case["ref"], strict=True)}
    assert any(kind and f is FinishReason.STOP for kind, f in finishes)
    if case["dir"].name.startswith("smollm2"):  # and the model's own EOS where the grammar may end
        _, eos = model_shape(str(case["dir"]))
        assert any(e.token_ids and e.token_ids[-1] in eos for c, e in zip(case["constraints"], case["ref"],
                                                                          strict=True) if c)


@pytest.mark.slow
def test_greedy_constrained_output_equals_transformers_and_again_from_the_prefix_cache(case):
    assert_reference_is_meaningful(case)
    engine = make_engine(case)
    first = engine.generate(requests(case, "a"))
    assert_matches_reference(case, first, "a")
    for i, constraint in enumerate(case["constraints"]):
        d = first[f"a{i}"]
        if constraint is not None and d.finish_reason is FinishReason.STOP:
            assert output_problem(constraint, d.output_text, case["dir"], d.output_token_ids) is None
    assert engine.metrics.mask_rows and max(engine.metrics.mask_rows) > 1  # rows masked together in a step
    # The same prompts again: their full blocks come from the prefix cache; the output is unchanged.
    second = engine.generate(requests(case, "b"))
    assert_matches_reference(case, second, "b")
    cached = [second[f"b{i}"].usage.cached_prompt_tokens for i in range(len(case["prompts"]))]
    assert sum(cached) > 0
    for p, c in zip(case["prompts"], cached, strict=True):
        assert c == (len(p) - 1) // BLOCK * BLOCK


def test_a_prefix_cache_hit_on_a_shared_prefix_keeps_the_constrained_output(case):
    # Each long request shares its first two blocks with a warm-up request that ran before it.
    picked = [i for i, p in enumerate(case["prompts"]) if len(p) > 2 * BLOCK]
    assert picked
    sub = {"dir": case["dir"], **{key: [case[key][i] for i in picked]
                                  for key in ("prompts", "constraints", "max_new", "ref")}}
    engine = make_engine(case)
    warm = [p[: 2 * BLOCK] + [5] for p in sub["prompts"]]
    engine.generate(constrained_requests(warm, [None] * len(warm), [1] * len(warm), prefix="warm"))
    results = engine.generate(requests(sub))
    assert_matches_reference(sub, results)
    assert all(results[f"r{i}"].usage.cached_prompt_tokens >= 2 * BLOCK for i in range(len(picked)))


def test_greedy_constrained_output_equals_transformers_under_preemption(case):
    # Room for the longest request and one block more: the batch cannot all run at once, so
    # requests are preempted and recomputed, their matchers carried over. No prefix cache, so
    # shared prompt blocks do not make room.
    longest = max(-(-(len(p) + n) // BLOCK) for p, n in zip(case["prompts"], case["max_new"], strict=True))
    engine = make_engine(case, num_blocks=longest + 1, enable_prefix_caching=False)
    results = engine.generate(requests(case))
    assert engine.metrics.num_preemptions > 0
    assert_matches_reference(case, results)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_greedy_constrained_output_equals_transformers_with_chunked_prefill(case):
    engine = make_engine(case, max_num_batched_tokens=7, enable_prefix_caching=False)
    for r in requests(case):
        engine.add(r)
    results, partial_steps = {}, 0
    while engine.has_work():
        for d in engine.step():
            if d.finished:
                results[d.request_id] = d
        assert engine.metrics.last_step["tokens"] <= 7
        if any(0 < r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
            partial_steps += 1
    assert partial_steps > 0
    assert_matches_reference(case, results)


def test_greedy_constrained_output_equals_transformers_with_async_scheduling_forced_on():
    case = with_reference(random_case(cached_tiny_model("test-llama"), seed=3))
    engine = make_engine(case, async_scheduling="on")
    assert engine.async_scheduling
    assert_matches_reference(case, engine.generate(requests(case)))


def test_seeded_sampling_under_a_constraint_stays_valid_and_repeats_with_the_same_seeds():
    model_dir = cached_tiny_model("tiny-llama")
    case = random_case(model_dir, seed=7)
    engine = make_engine(case)

    def run(prefix):
        reqs = constrained_requests(case["prompts"], case["constraints"], case["max_new"], prefix=prefix,
                                    temperature=0.9, top_p=0.95, top_k=200, repetition_penalty=1.1,
                                    presence_penalty=0.3, logprobs=2)
        for i, r in enumerate(reqs):
            r.sampling.seed = 1000 + i
        return engine.generate(reqs)

    first, second = run("s"), run("t")
    stops = 0
    for i, constraint in enumerate(case["constraints"]):
        d = first[f"s{i}"]
        assert second[f"t{i}"].output_token_ids == d.output_token_ids  # the same seed, the same output
        assert d.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (d.finish_reason, d.error)
        assert len(d.output_logprobs) == len(d.output_token_ids)
        if constraint is None:
            continue
        if d.finish_reason is FinishReason.STOP:
            stops += 1
            assert output_problem(constraint, d.output_text, model_dir, d.output_token_ids) is None
        else:  # cut by max_tokens: a prefix the grammar still accepts
            matcher = new_matcher(model_dir, constraint)
            assert matcher.consume_tokens(d.output_token_ids), (f"s{i}", matcher.get_error())
    assert stops > 0
