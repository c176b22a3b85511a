"""Every constrained output is valid: 256 jobs over the 8 schemas of the structured workload, with
choice and regex jobs in the same batch, greedy and seeded sampling mixed.

Every output that finishes "stop" parses and validates against its schema (`jsonschema`), every
choice output is one of the choices, every regex output matches the whole pattern, every output
the grammar completed is accepted by a fresh reference matcher, and no compact output (cut by
max_tokens or not) holds whitespace outside its strings. Flexible whitespace stays within its
bound. On the tiny random Llama of the tests and the 32000-token one, and on SmolLM2-135M with
chat prompts that ask for each schema.
"""

from __future__ import annotations

import random

import pytest

from tests.structured_helpers import (
    chat_prompt_ids,
    hf_tokenizer,
    model_shape,
    output_problem,
    whitespace_runs,
)
from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.structured.llguidance_backend import FLEXIBLE_WHITESPACE_MAX
from tokenmill.engine.types import EngineRequest, FinishReason, SamplingParams, StructuredOutputsParams
from tokenmill.tools.structured_workload import SCHEMAS, structured_workload
from tokenmill.tools.tiny_models import cached_tiny_model

CHOICES = ["positive", "negative", "neutral", "mixed", "not applicable"]
REGEXES = [r"[A-Z]{3}-[0-9]{4}", r"(yes|no)( \(certain\))?", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"-?[0-9]{1,4}"]


def jobs(prompts: list[list[int]], num_json: int, num_choice: int, num_regex: int, num_flexible: int,
         max_tokens: int) -> list[tuple[EngineRequest, StructuredOutputsParams]]:
    """JSON jobs over the 8 schemas (request i: schema i mod 8), then choice, regex and flexible-
    whitespace JSON jobs; every other job is greedy, the rest sampled with a seed."""
    constraints = [StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)].schema) for i in range(num_json)]
    constraints += [StructuredOutputsParams(choice=CHOICES) for _ in range(num_choice)]
    constraints += [StructuredOutputsParams(regex=REGEXES[i % len(REGEXES)]) for i in range(num_regex)]
    constraints += [StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)].schema, whitespace="flexible")
                    for i in range(num_flexible)]
    out = []
    for i, constraint in enumerate(constraints):
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.95, "seed": i}
        out.append((EngineRequest(request_id=f"v{i:04d}", prompt_token_ids=prompts[i % len(prompts)],
                                  sampling=SamplingParams(max_tokens=max_tokens, structured_outputs=constraint,
                                                          **sampling)), constraint))
    return out


def run_and_check(model_dir, engine: Engine, batch) -> dict:
    results = engine.generate([r for r, _ in batch])
    assert len(results) == len(batch)
    problems, counts = [], {"stop": 0, "length": 0}
    for request, constraint in batch:
        d = results[request.request_id]
        where = f"{request.request_id} ({constraint.kind}, {constraint.whitespace})"
        if d.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            problems.append(f"{where}: finished {d.finish_reason.value}: {d.error}")
            continue
        counts[d.finish_reason.value] += 1
        text = d.output_text
        if constraint.kind == "json":
            longest = max(whitespace_runs(text), default=0)
            allowed = 0 if constraint.whitespace == "compact" else FLEXIBLE_WHITESPACE_MAX
            if longest > allowed:
                problems.append(f"{where}: a whitespace run of {longest} outside strings: {text!r}")
        if d.finish_reason is FinishReason.STOP:
            problem = output_problem(constraint, text, model_dir, d.output_token_ids)
            if problem is not None:
                problems.append(f"{where}: {problem}")
    assert not problems, f"{len(problems)} invalid of {len(batch)}:\n" + "\n".join(problems[:20])
    return counts


def random_model_batch(model_dir, num_json=256, num_other=32, max_tokens=192):
    vocab, eos = model_shape(str(model_dir))
    workload = structured_workload(vocab, num_json, seed=1, special={0, 1, 2, *eos}, max_tokens=max_tokens)
    assert [i % len(SCHEMAS) for i in range(num_json)] == workload.schema_index
    return jobs(workload.prompts, num_json, num_other, num_other, num_other // 2, max_tokens)


@pytest.mark.parametrize("preset", ["test-llama", pytest.param("tiny-llama", marks=pytest.mark.slow)])
def test_256_constrained_jobs_over_the_8_schemas_are_all_valid_on_a_random_model(preset):
    model_dir = cached_tiny_model(preset)
    batch = random_model_batch(model_dir)
    engine = Engine(EngineConfig(model=str(model_dir), max_num_seqs=256, max_num_batched_tokens=4096,
                                 kv_cache_gb=0.5))
    counts = run_and_check(model_dir, engine, batch)
    # The schemas are bounded, so most outputs reach the end of their grammar before max_tokens.
    assert counts["stop"] >= 0.8 * len(batch), counts
    assert engine.metrics.constraint_failures == 0
    assert max(engine.metrics.mask_rows) >= 200  # the batch ran together, every row masked


@pytest.mark.slow
def test_constrained_jobs_on_smollm2_are_all_valid():
    from tokenmill.tools.smollm2 import cached_smollm2

    model_dir = cached_smollm2()
    rng = random.Random(0)
    asks = [f"Write one {s.name.replace('_', ' ')} record as a JSON object." for s in SCHEMAS]
    asks += [f"Label the sentiment of: '{t}'" for t in ("Great value!", "It broke after a day.", "It is a chair.")]
    prompts = [chat_prompt_ids(model_dir, a) for a in asks]
    batch = jobs(prompts[: len(SCHEMAS)], 16, 0, 0, 0, max_tokens=160)
    batch += [(EngineRequest(request_id=f"c{i}", prompt_token_ids=p,
                             sampling=SamplingParams(max_tokens=8, temperature=rng.choice([0.0, 1.0]), seed=i,
                                                     structured_outputs=StructuredOutputsParams(choice=CHOICES))),
               StructuredOutputsParams(choice=CHOICES)) for i, p in enumerate(prompts[len(SCHEMAS):])]
    date = StructuredOutputsParams(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")
    batch.append((EngineRequest(request_id="date", prompt_token_ids=chat_prompt_ids(
        model_dir, "What is the date of the first day of 2024? Answer as YYYY-MM-DD."),
        sampling=SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=date)), date))
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gb=0.3))
    counts = run_and_check(model_dir, engine, batch)
    assert counts["stop"] >= len(batch) // 2, counts


def test_the_checks_catch_every_kind_of_invalid_output(tiny_llama_dir):
    person = SCHEMAS[0]
    schema = StructuredOutputsParams(json=person.schema)
    good = '{"name":"Ada","age":36,"email":"ada@example.org","tags":["staff"]}'
    tok = hf_tokenizer(str(tiny_llama_dir))
    assert output_problem(schema, good, tiny_llama_dir, tok.encode(good)) is None
    assert "not JSON" in output_problem(schema, good[:-1])
    assert "does not validate" in output_problem(schema, good.replace("36", "360"))
    assert "whitespace" in output_problem(schema, good.replace(",", ", "))
    assert output_problem(StructuredOutputsParams(json=person.schema, whitespace="flexible"),
                          good.replace(",", ", ")) is None
    assert "not one of" in output_problem(StructuredOutputsParams(choice=CHOICES), "positiv")
    assert "does not match" in output_problem(StructuredOutputsParams(regex=REGEXES[0]), "ABC-123")
    grammar = StructuredOutputsParams(grammar='start: "(" /[0-9]+/ ")"')
    assert output_problem(grammar, "(12)", tiny_llama_dir, tok.encode("(12)")) is None
    assert "refuses" in output_problem(grammar, "(1a)", tiny_llama_dir, tok.encode("(1a)"))
    assert "not complete" in output_problem(grammar, "(12", tiny_llama_dir, tok.encode("(12"))
    assert whitespace_runs('{"a b": 1 ,"c":"x\\"y z"}  ') == [1, 1, 2]
