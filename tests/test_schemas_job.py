"""Every Job rule of the contract, each with a passing and a failing case."""

from __future__ import annotations

import copy
import json

import pytest

from tokenmill.schemas import ERROR_INVALID_JOB, Job, JobDecodeError, Sampling, decode_job

BASE = {"job_id": "row-1", "prompt": "hello"}
MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}}, "required": ["label"]}
SO = "sampling.structured_outputs"


def with_(patch: dict, base: dict = BASE) -> dict:
    job = copy.deepcopy(base)
    for key, value in patch.items():
        if key.startswith("sampling."):
            job.setdefault("sampling", {})[key.split(".", 1)[1]] = value
        elif value is _DROP:
            job.pop(key, None)
        else:
            job[key] = value
    return job


_DROP = object()


def meta_of_size(n: int, char: str = "x") -> dict:
    # compact JSON of {"k": "<chars>"} is 8 bytes plus the string's UTF-8 bytes
    per = len(char.encode())
    assert (n - 8) % per == 0
    return {"k": char * ((n - 8) // per)}


VALID = [
    ("job_id 1 char", {"job_id": "a"}),
    ("job_id 256 chars", {"job_id": "x" * 256}),
    ("job_id 256 non-ascii chars", {"job_id": "é" * 256}),
    ("prompt only", {}),
    ("messages only", {"prompt": _DROP, "messages": MSGS}),
    ("token ids only", {"prompt": _DROP, "prompt_token_ids": [0, 5, 2**31 - 1]}),
    ("null prompt counts as absent", {"prompt": None, "messages": MSGS}),
    ("whitespace prompt is a prompt", {"prompt": " "}),
    (
        "all roles",
        {
            "prompt": _DROP,
            "messages": [
                {"role": "system", "content": ""},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ],
        },
    ),
    ("model", {"model": "tiny-llama"}),
    ("model null", {"model": None}),
    ("empty sampling", {"sampling": {}}),
    ("max_tokens 1", {"sampling.max_tokens": 1}),
    ("min_tokens 0", {"sampling.min_tokens": 0}),
    ("min_tokens == max_tokens", {"sampling.min_tokens": 8, "sampling.max_tokens": 8}),
    ("temperature int 0", {"sampling.temperature": 0}),
    ("temperature 0.0", {"sampling.temperature": 0.0}),
    ("temperature 2.5", {"sampling.temperature": 2.5}),
    ("top_p 1", {"sampling.top_p": 1}),
    ("top_p 0.01", {"sampling.top_p": 0.01}),
    ("top_k 0 (off)", {"sampling.top_k": 0}),
    ("top_k 40", {"sampling.top_k": 40}),
    ("min_p 0", {"sampling.min_p": 0}),
    ("min_p 1", {"sampling.min_p": 1.0}),
    ("repetition_penalty 1.3", {"sampling.repetition_penalty": 1.3}),
    ("repetition_penalty tiny", {"sampling.repetition_penalty": 1e-6}),
    ("presence_penalty -2", {"sampling.presence_penalty": -2}),
    ("presence_penalty 2", {"sampling.presence_penalty": 2.0}),
    ("frequency_penalty -2", {"sampling.frequency_penalty": -2.0}),
    ("frequency_penalty 2", {"sampling.frequency_penalty": 2}),
    ("seed null", {"sampling.seed": None}),
    ("seed 42", {"sampling.seed": 42}),
    ("seed negative", {"sampling.seed": -7}),
    ("stop empty list", {"sampling.stop": []}),
    ("stop 16 strings", {"sampling.stop": [f"s{i}" for i in range(16)]}),
    ("stop_token_ids", {"sampling.stop_token_ids": [0, 2]}),
    ("ignore_eos", {"sampling.ignore_eos": True}),
    ("logprobs null", {"sampling.logprobs": None}),
    ("logprobs 0", {"sampling.logprobs": 0}),
    ("logprobs 20", {"sampling.logprobs": 20}),
    ("structured_outputs null", {"sampling.structured_outputs": None}),
    ("json schema object", {"sampling.structured_outputs": {"json": SCHEMA}}),
    ("json schema text", {"sampling.structured_outputs": {"json": json.dumps(SCHEMA)}}),
    ("json schema that will not compile", {"sampling.structured_outputs": {"json": {"type": "nope"}}}),
    ("json_object", {"sampling.structured_outputs": {"json_object": True}}),
    ("json_object flexible", {"sampling.structured_outputs": {"json_object": True, "whitespace": "flexible"}}),
    ("regex", {"sampling.structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}),
    ("regex that will not compile", {"sampling.structured_outputs": {"regex": "(unclosed"}}),
    ("choice", {"sampling.structured_outputs": {"choice": ["positive", "negative", "neutral"]}}),
    ("choice of one", {"sampling.structured_outputs": {"choice": ["yes"]}}),
    ("grammar", {"sampling.structured_outputs": {"grammar": 'start: "yes" | "no"'}}),
    ("other kinds null", {"sampling.structured_outputs": {"regex": "a+", "json": None, "choice": None}}),
    ("json_object false beside a kind", {"sampling.structured_outputs": {"regex": "a+", "json_object": False}}),
    ("stream true", {"stream": True}),
    ("stream false", {"stream": False}),
    ("priority negative", {"priority": -5}),
    ("priority positive", {"priority": 3}),
    ("deadline_ms", {"deadline_ms": 1_764_460_800_000}),
    ("deadline_ms null", {"deadline_ms": None}),
    ("tenant", {"tenant": "team-a"}),
    ("metadata empty", {"metadata": {}}),
    ("metadata nested", {"metadata": {"a": [1, {"b": None}], "c": 1.5, "d": True}}),
    ("metadata exactly 16 KiB", {"metadata": meta_of_size(16384)}),
    ("metadata exactly 16 KiB in 2-byte chars", {"metadata": meta_of_size(16384, "é")}),
]

# (name, patch, the path the message must name)
INVALID = [
    ("job_id missing", {"job_id": _DROP}, "job_id: required"),
    ("job_id empty", {"job_id": ""}, "job_id: must not be empty"),
    ("job_id 257 chars", {"job_id": "x" * 257}, "job_id: must have at most 256 characters"),
    ("job_id int", {"job_id": 17}, "job_id: must be a string"),
    (
        "no prompt",
        {"prompt": _DROP},
        "exactly one of prompt, messages, prompt_token_ids is required (got none)",
    ),
    ("prompt and messages", {"messages": MSGS}, "(got prompt, messages)"),
    ("prompt and token ids", {"prompt_token_ids": [1]}, "(got prompt, prompt_token_ids)"),
    ("all three", {"messages": MSGS, "prompt_token_ids": [1]}, "(got prompt, messages, prompt_token_ids)"),
    ("empty prompt", {"prompt": ""}, "prompt: must not be empty"),
    ("prompt not a string", {"prompt": ["hello"]}, "prompt: must be a string"),
    ("empty messages", {"prompt": _DROP, "messages": []}, "messages: must not be empty"),
    ("messages not a list", {"prompt": _DROP, "messages": {"role": "user"}}, "messages: must be a list"),
    (
        "message unknown role",
        {"prompt": _DROP, "messages": [{"role": "tool", "content": "x"}]},
        "messages[0].role: must be one of 'system', 'user' or 'assistant'",
    ),
    (
        "message without content",
        {"prompt": _DROP, "messages": [{"role": "user"}]},
        "messages[0].content: required",
    ),
    (
        "message content not a string",
        {"prompt": _DROP, "messages": [{"role": "user", "content": 3}]},
        "messages[0].content: must be a string",
    ),
    (
        "message unknown field",
        {"prompt": _DROP, "messages": [{"role": "user", "content": "x", "name": "bob"}]},
        "messages[0].name: unknown field",
    ),
    ("empty token ids", {"prompt": _DROP, "prompt_token_ids": []}, "prompt_token_ids: must not be empty"),
    (
        "negative token id",
        {"prompt": _DROP, "prompt_token_ids": [1, -1]},
        "prompt_token_ids[1]: must be >= 0",
    ),
    (
        "token id too large",
        {"prompt": _DROP, "prompt_token_ids": [2**31]},
        "prompt_token_ids[0]: must be <= 2147483647",
    ),
    (
        "token id float",
        {"prompt": _DROP, "prompt_token_ids": [1.0]},
        "prompt_token_ids[0]: must be an integer",
    ),
    (
        "token id string",
        {"prompt": _DROP, "prompt_token_ids": ["1"]},
        "prompt_token_ids[0]: must be an integer",
    ),
    (
        "token id bool",
        {"prompt": _DROP, "prompt_token_ids": [True]},
        "prompt_token_ids[0]: must be an integer",
    ),
    ("model empty", {"model": ""}, "model: must not be empty"),
    ("model not a string", {"model": 1}, "model: must be a string"),
    ("sampling not an object", {"sampling": [1]}, "sampling: must be an object"),
    ("sampling unknown field", {"sampling.max_new_tokens": 5}, "sampling.max_new_tokens: unknown field"),
    ("max_tokens 0", {"sampling.max_tokens": 0}, "sampling.max_tokens: must be >= 1 (0, score only, needs prompt_logprobs)"),
    ("max_tokens negative", {"sampling.max_tokens": -3}, "sampling.max_tokens: must be >= 0"),
    ("max_tokens string", {"sampling.max_tokens": "10"}, "sampling.max_tokens: must be an integer"),
    ("max_tokens bool", {"sampling.max_tokens": True}, "sampling.max_tokens: must be an integer"),
    ("max_tokens float", {"sampling.max_tokens": 10.0}, "sampling.max_tokens: must be an integer"),
    ("min_tokens negative", {"sampling.min_tokens": -1}, "sampling.min_tokens: must be >= 0"),
    (
        "min_tokens above max_tokens",
        {"sampling.min_tokens": 9, "sampling.max_tokens": 8},
        "sampling: min_tokens (9) must not exceed max_tokens (8)",
    ),
    ("temperature negative", {"sampling.temperature": -0.1}, "sampling.temperature: must be >= 0"),
    ("temperature string", {"sampling.temperature": "0"}, "sampling.temperature: must be a number"),
    ("temperature bool", {"sampling.temperature": False}, "sampling.temperature: must be a number"),
    ("top_p 0", {"sampling.top_p": 0}, "sampling.top_p: must be > 0"),
    ("top_p above 1", {"sampling.top_p": 1.01}, "sampling.top_p: must be <= 1"),
    ("top_k negative", {"sampling.top_k": -1}, "sampling.top_k: must be >= 0"),
    ("top_k float", {"sampling.top_k": 1.5}, "sampling.top_k: must be an integer"),
    ("min_p above 1", {"sampling.min_p": 1.1}, "sampling.min_p: must be <= 1"),
    ("min_p negative", {"sampling.min_p": -0.1}, "sampling.min_p: must be >= 0"),
    ("repetition_penalty 0", {"sampling.repetition_penalty": 0}, "sampling.repetition_penalty: must be > 0"),
    (
        "presence_penalty above 2",
        {"sampling.presence_penalty": 2.1},
        "sampling.presence_penalty: must be <= 2",
    ),
    (
        "presence_penalty below -2",
        {"sampling.presence_penalty": -2.5},
        "sampling.presence_penalty: must be >= -2",
    ),
    (
        "frequency_penalty above 2",
        {"sampling.frequency_penalty": 3},
        "sampling.frequency_penalty: must be <= 2",
    ),
    (
        "frequency_penalty below -2",
        {"sampling.frequency_penalty": -3},
        "sampling.frequency_penalty: must be >= -2",
    ),
    ("seed string", {"sampling.seed": "42"}, "sampling.seed: must be an integer"),
    ("seed float", {"sampling.seed": 4.2}, "sampling.seed: must be an integer"),
    ("seed beyond 64 bits", {"sampling.seed": 2**63}, "sampling.seed: must be <="),
    (
        "stop 17 strings",
        {"sampling.stop": [f"s{i}" for i in range(17)]},
        "sampling.stop: must have at most 16 items",
    ),
    ("stop empty string", {"sampling.stop": ["ok", ""]}, "sampling.stop[1]: must not be empty"),
    ("stop as a bare string", {"sampling.stop": "END"}, "sampling.stop: must be a list"),
    ("stop non-string", {"sampling.stop": [1]}, "sampling.stop[0]: must be a string"),
    (
        "stop_token_ids negative",
        {"sampling.stop_token_ids": [-1]},
        "sampling.stop_token_ids[0]: must be >= 0",
    ),
    ("ignore_eos int", {"sampling.ignore_eos": 1}, "sampling.ignore_eos: must be true or false"),
    ("ignore_eos string", {"sampling.ignore_eos": "true"}, "sampling.ignore_eos: must be true or false"),
    ("logprobs 21", {"sampling.logprobs": 21}, "sampling.logprobs: must be <= 20"),
    ("logprobs negative", {"sampling.logprobs": -1}, "sampling.logprobs: must be >= 0"),
    ("logprobs bool", {"sampling.logprobs": True}, "sampling.logprobs: must be an integer"),
    ("structured_outputs not an object", {SO: "json"}, "sampling.structured_outputs: must be an object"),
    (
        "structured_outputs with no kind",
        {SO: {}},
        f"{SO}: exactly one of json, json_object, regex, choice, grammar is required (got none)",
    ),
    ("structured_outputs json_object false", {SO: {"json_object": False}}, "is required (got none)"),
    ("structured_outputs two kinds", {SO: {"json": SCHEMA, "regex": "a"}}, "is required (got json, regex)"),
    ("structured_outputs unknown key", {SO: {"regex": "a", "pattern": "b"}}, f"{SO}.pattern: unknown field"),
    ("structured_outputs vLLM-only key", {SO: {"json_object": True, "disable_fallback": True}}, "unknown field"),
    ("json a number", {SO: {"json": 5}}, f"{SO}.json: must be a JSON Schema object or its JSON text"),
    ("json a list", {SO: {"json": [SCHEMA]}}, f"{SO}.json: must be a JSON Schema object or its JSON text"),
    ("json text not JSON", {SO: {"json": "{type: object}"}}, f"{SO}.json: not JSON: Expecting property name"),
    ("json text empty", {SO: {"json": ""}}, f"{SO}.json: not JSON"),
    ("json text not an object", {SO: {"json": "[1, 2]"}}, f"{SO}.json: the JSON text must hold a JSON Schema"),
    ("json text with NaN", {SO: {"json": '{"minimum": NaN}'}}, f"{SO}.json: not JSON: NaN is not a JSON value"),
    ("json text duplicate key", {SO: {"json": '{"a": 1, "a": 2}'}}, f"{SO}.json: not JSON: duplicate key 'a'"),
    ("json_object 1", {SO: {"json_object": 1}}, f"{SO}.json_object: must be true or false"),
    ("regex empty", {SO: {"regex": ""}}, f"{SO}.regex: must not be empty"),
    ("regex not a string", {SO: {"regex": ["a"]}}, f"{SO}.regex: must be a string"),
    ("choice empty", {SO: {"choice": []}}, f"{SO}.choice: must not be empty"),
    ("choice empty string", {SO: {"choice": ["a", ""]}}, f"{SO}.choice[1]: must not be empty"),
    ("choice a string", {SO: {"choice": "a"}}, f"{SO}.choice: must be a list"),
    ("choice not strings", {SO: {"choice": [1]}}, f"{SO}.choice[0]: must be a string"),
    ("grammar empty", {SO: {"grammar": ""}}, f"{SO}.grammar: must not be empty"),
    (
        "whitespace unknown",
        {SO: {"json_object": True, "whitespace": "none"}},
        f"{SO}.whitespace: must be one of 'compact' or 'flexible'",
    ),
    ("stream string", {"stream": "yes"}, "stream: must be true or false"),
    ("stream int", {"stream": 1}, "stream: must be true or false"),
    ("priority float", {"priority": 1.0}, "priority: must be an integer"),
    ("priority string", {"priority": "1"}, "priority: must be an integer"),
    ("deadline_ms negative", {"deadline_ms": -1}, "deadline_ms: must be >= 0"),
    ("deadline_ms string", {"deadline_ms": "soon"}, "deadline_ms: must be an integer"),
    ("deadline_ms float", {"deadline_ms": 1.5}, "deadline_ms: must be an integer"),
    ("tenant empty", {"tenant": ""}, "tenant: must not be empty"),
    ("tenant not a string", {"tenant": 5}, "tenant: must be a string"),
    (
        "metadata one byte over 16 KiB",
        {"metadata": meta_of_size(16385)},
        "metadata: is 16385 bytes as JSON; at most 16384",
    ),
    (
        "metadata over 16 KiB in 2-byte chars",
        {"metadata": meta_of_size(16386, "é")},
        "metadata: is 16386 bytes",
    ),
    ("metadata a list", {"metadata": [1]}, "metadata: must be an object"),
    ("metadata a string", {"metadata": "x"}, "metadata: must be an object"),
    ("unknown top-level field", {"prompts": "typo"}, "prompts: unknown field"),
    ("unknown top-level field max_tokens", {"max_tokens": 5}, "max_tokens: unknown field"),
]


@pytest.mark.parametrize("name,patch", VALID, ids=[v[0] for v in VALID])
def test_valid_job(name, patch):
    raw = json.dumps(with_(patch)).encode()
    job = decode_job(raw)
    assert isinstance(job, Job)
    # Same through the model directly, and what was sent survives a round trip.
    assert Job.model_validate(json.loads(raw)) == job
    assert decode_job(job.to_json_bytes()) == job


@pytest.mark.parametrize("name,patch,expected", INVALID, ids=[v[0] for v in INVALID])
def test_invalid_job(name, patch, expected):
    job = with_(patch)
    with pytest.raises(JobDecodeError) as exc:
        decode_job(json.dumps(job).encode())
    err = exc.value
    assert err.code == ERROR_INVALID_JOB
    assert expected in err.message, err.message
    # The error carries the job id whenever one is readable, so an error Result can be published.
    readable = isinstance(job.get("job_id"), str) and 1 <= len(job["job_id"]) <= 256
    assert err.job_id == (job["job_id"] if readable else None)


def test_defaults_follow_the_contract():
    job = decode_job(b'{"job_id": "a", "prompt": "p"}')
    assert job.stream is False and job.priority == 0 and job.model is None and job.metadata is None
    s = job.sampling
    assert (s.max_tokens, s.min_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (
        256,
        0,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.0, 0.0, 0.0)
    assert s.seed is None and s.stop == [] and s.stop_token_ids == [] and s.ignore_eos is False
    assert s.logprobs is None and s.structured_outputs is None


def test_int_given_for_float_stays_a_float():
    job = decode_job(b'{"job_id": "a", "prompt": "p", "sampling": {"temperature": 0, "top_p": 1}}')
    assert type(job.sampling.temperature) is float and job.sampling.temperature == 0.0
    assert type(job.sampling.top_p) is float


def test_all_problems_in_one_readable_message():
    raw = b'{"job_id": "a", "prompt": "", "sampling": {"max_tokens": 0, "top_p": 2}, "colour": 1}'
    with pytest.raises(JobDecodeError) as exc:
        decode_job(raw)
    assert exc.value.message == (
        "prompt: must not be empty; sampling.max_tokens: must be >= 1 (0, score only, needs prompt_logprobs); "
        "sampling.top_p: must be <= 1; colour: unknown field"
    )
    assert str(exc.value) == "invalid_job: " + exc.value.message


def test_many_bad_items_give_a_bounded_message():
    raw = json.dumps({"job_id": "a", "prompt_token_ids": ["x"] * 10_000}).encode()
    with pytest.raises(JobDecodeError) as exc:
        decode_job(raw)
    assert "prompt_token_ids[0]: must be an integer" in exc.value.message
    assert "and 9990 more problems" in exc.value.message
    assert len(exc.value.message) < 2000


def test_metadata_echo_is_unchanged():
    meta = {"dataset": "eval", "row": 17, "tags": ["a", None], "nested": {"x": 1.5}}
    job = decode_job(json.dumps({"job_id": "a", "prompt": "p", "metadata": meta}).encode())
    assert job.metadata == meta


def test_python_construction_is_strict_too():
    with pytest.raises(ValueError):
        Sampling(max_tokens="10")
    with pytest.raises(ValueError):
        Job(job_id="a", prompt="p", sampling=Sampling(), stream=1)
    assert Job(job_id="a", prompt="p").sampling == Sampling()


def test_a_constraint_keeps_its_form_and_key_order_on_the_wire():
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    for given in (schema, json.dumps(schema)):
        body = {"job_id": "a", "prompt": "p", "sampling": {"structured_outputs": {"json": given}}}
        job = decode_job(json.dumps(body))
        assert job.sampling.structured_outputs.json == given and job.sampling.structured_outputs.kind == "json"
        sent = json.loads(job.to_json_bytes())["sampling"]["structured_outputs"]
        assert sent == {"json": given}  # defaults left implicit, the schema as written
        if isinstance(given, dict):
            assert list(sent["json"]["properties"]) == ["z", "a"]


def test_the_constraint_is_part_of_a_backfill_jobs_identity():
    from tokenmill.tools.backfill.jobs import JobSpec

    def fp(constraint=None, **sampling):
        if constraint is not None:
            sampling["structured_outputs"] = constraint
        return JobSpec(prompt_template="Q: {text}", model="m", sampling=sampling).fingerprint()

    two = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}, "why": {"type": "string"}}}
    reordered = {"type": "object", "properties": {"why": {"type": "string"}, "label": {"enum": ["a", "b"]}}}
    prints = [
        fp(),
        fp({"json": SCHEMA}),
        fp({"json": two}),
        fp({"json": reordered}),  # key order decides the order the output writes keys in
        fp({"json": SCHEMA, "whitespace": "flexible"}),
        fp({"json_object": True}),
        fp({"regex": "[ab]"}),
        fp({"choice": ["a", "b"]}),
        fp({"choice": ["b", "a"]}),
        fp({"grammar": 'start: "a" | "b"'}),
    ]
    assert len(set(prints)) == len(prints)  # jobs differing only in their constraint: other ids
    assert fp() == fp(structured_outputs=None)  # no constraint: the ids of before
    assert fp({"json": SCHEMA}) == fp({"json": SCHEMA, "whitespace": "compact"})  # an explicit default
    assert fp({"json": SCHEMA}) == fp({"json": json.dumps(SCHEMA, indent=2)})  # a schema or its text


# --- scoring and n samples: prompt_logprobs, score_from, n ----------------------------------------


def sampled(**sampling) -> Sampling:
    return Job.model_validate({"job_id": "j", "prompt": "p", "sampling": sampling}).sampling


def sampling_problem(**sampling) -> str:
    raw = json.dumps({"job_id": "j", "prompt": "p", "sampling": sampling}).encode()
    with pytest.raises(JobDecodeError) as exc:
        decode_job(raw)
    return exc.value.message


def test_the_scoring_fields_come_after_structured_outputs_in_this_order():
    assert list(Sampling.model_fields)[-4:] == ["structured_outputs", "prompt_logprobs", "score_from", "n"]


def test_a_job_without_the_scoring_fields_is_unchanged():
    s = sampled()
    assert (s.prompt_logprobs, s.score_from, s.n) == (None, 1, 1)
    job = Job.model_validate({"job_id": "j", "prompt": "p", "sampling": {"max_tokens": 4}})
    assert json.loads(job.to_json_bytes()) == {"job_id": "j", "prompt": "p", "sampling": {"max_tokens": 4}}


@pytest.mark.parametrize("k", [0, 1, 20])
def test_prompt_logprobs_takes_0_to_20(k):
    assert sampled(prompt_logprobs=k).prompt_logprobs == k


@pytest.mark.parametrize(
    "bad,expected",
    [(21, "must be <= 20"), (-1, "must be >= 0"), (True, "must be an integer"), ("1", "must be an integer"),
     (1.0, "must be an integer")],
)
def test_prompt_logprobs_bad_values(bad, expected):
    assert sampling_problem(prompt_logprobs=bad) == f"sampling.prompt_logprobs: {expected}"


def test_max_tokens_0_scores_the_prompt_only():
    s = sampled(max_tokens=0, prompt_logprobs=2)
    assert s.max_tokens == 0 and s.prompt_logprobs == 2


def test_max_tokens_0_without_prompt_logprobs_is_refused_clearly():
    assert sampling_problem(max_tokens=0) == (
        "sampling.max_tokens: must be >= 1 (0, score only, needs prompt_logprobs)"
    )
    assert sampling_problem(max_tokens=0, prompt_logprobs=None) == (
        "sampling.max_tokens: must be >= 1 (0, score only, needs prompt_logprobs)"
    )
    with pytest.raises(ValueError, match="needs prompt_logprobs"):
        Sampling(max_tokens=0)


def test_max_tokens_0_cannot_carry_a_constraint_or_min_tokens():
    assert sampling_problem(max_tokens=0, prompt_logprobs=0, structured_outputs={"regex": "a"}) == (
        "sampling.structured_outputs: needs max_tokens >= 1 (max_tokens 0 generates nothing)"
    )
    assert "must not exceed max_tokens (0)" in sampling_problem(max_tokens=0, prompt_logprobs=0, min_tokens=1)


def test_score_from_defaults_to_1_and_needs_prompt_logprobs():
    assert sampled(prompt_logprobs=0, score_from=37).score_from == 37
    assert sampled(score_from=1).score_from == 1  # the default, given: nothing to refuse
    assert sampling_problem(score_from=2) == (
        "sampling.score_from: needs prompt_logprobs (it says where prompt scoring starts)"
    )


@pytest.mark.parametrize(
    "bad,expected",
    [(0, "must be >= 1"), (-5, "must be >= 1"), (2**31, "must be <= 2147483647"), ("3", "must be an integer")],
)
def test_score_from_bad_values(bad, expected):
    assert sampling_problem(prompt_logprobs=0, score_from=bad) == f"sampling.score_from: {expected}"


@pytest.mark.parametrize("n", [1, 2, 64])
def test_n_takes_1_to_64(n):
    assert sampled(n=n, seed=5).n == n


@pytest.mark.parametrize(
    "bad,expected",
    [(0, "must be >= 1"), (65, "must be <= 64"), (True, "must be an integer"), (2.0, "must be an integer")],
)
def test_n_bad_values(bad, expected):
    assert sampling_problem(n=bad) == f"sampling.n: {expected}"


def test_the_seeds_of_n_samples_must_fit_int64():
    top = 2**63 - 1
    assert sampled(n=1, seed=top).seed == top
    assert sampled(n=4, seed=top - 3).n == 4
    assert sampling_problem(n=4, seed=top - 2) == (
        f"sampling.n: seed + n - 1 must fit a signed 64-bit integer (seed {top - 2}, n 4)"
    )


def test_rules_between_fields_are_listed_with_the_fields_own_problems():
    assert sampling_problem(max_tokens=0, top_p=2, score_from=3, n=99) == (
        "sampling.max_tokens: must be >= 1 (0, score only, needs prompt_logprobs); sampling.top_p: must be <= 1; "
        "sampling.score_from: needs prompt_logprobs (it says where prompt scoring starts); sampling.n: must be <= 64"
    )
