"""OpenAI Batch lines -> Jobs, and Results -> OpenAI Batch output lines."""

from __future__ import annotations

import json

import pytest

from tokenmill.schemas import (
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    ERROR_INVALID_JOB,
    Job,
    JobDecodeError,
    Result,
    job_from_openai_batch_line,
    openai_batch_output_line,
    parse_input_line,
)

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def line(body: dict, url: str = CHAT, **extra) -> dict:
    return {"custom_id": "req-1", "method": "POST", "url": url, "body": body, **extra}


def chat(**body) -> dict:
    return line({"model": "tiny-llama", "messages": HI, **body})


def comp(**body) -> dict:
    return line({"model": "tiny-llama", "prompt": "Once upon", **body}, url=COMP)


def schema_format(**spec) -> dict:
    return chat(response_format={"type": "json_schema", "json_schema": spec})


def rejected(obj) -> JobDecodeError:
    with pytest.raises(JobDecodeError) as exc:
        job_from_openai_batch_line(obj)
    assert exc.value.code == ERROR_INVALID_JOB
    return exc.value


# --- input ---------------------------------------------------------------------------------------


def test_chat_line_maps_every_supported_field():
    job = job_from_openai_batch_line(
        chat(
            max_tokens=32,
            temperature=0.7,
            top_p=0.9,
            stop="END",
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logprobs=True,
            top_logprobs=3,
        )
    )
    assert job.job_id == "req-1" and job.model == "tiny-llama"
    assert [m.model_dump() for m in job.messages] == HI
    s = job.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.stop, s.seed) == (32, 0.7, 0.9, ["END"], 7)
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs) == (0.5, -0.5, 3)
    assert job.prompt is None and job.prompt_token_ids is None and job.stream is False


def test_completions_line_maps_prompt_and_logprobs():
    job = job_from_openai_batch_line(comp(max_tokens=16, stop=["\n", "."], logprobs=2))
    assert job.prompt == "Once upon" and job.messages is None
    assert job.sampling.max_tokens == 16 and job.sampling.stop == ["\n", "."] and job.sampling.logprobs == 2


@pytest.mark.parametrize(
    "prompt,field,value",
    [
        ("text", "prompt", "text"),
        (["text"], "prompt", "text"),
        ([1, 2, 3], "prompt_token_ids", [1, 2, 3]),
        ([[4, 5]], "prompt_token_ids", [4, 5]),
    ],
)
def test_completions_prompt_forms(prompt, field, value):
    job = job_from_openai_batch_line(comp(prompt=prompt))
    assert getattr(job, field) == value


def test_bytes_and_str_lines_are_accepted():
    raw = json.dumps(chat(max_tokens=3))
    assert (
        job_from_openai_batch_line(raw)
        == job_from_openai_batch_line(raw.encode())
        == parse_input_line(raw.encode())
    )


def test_max_completion_tokens():
    assert job_from_openai_batch_line(chat(max_completion_tokens=12)).sampling.max_tokens == 12
    assert job_from_openai_batch_line(chat(max_completion_tokens=12, max_tokens=12)).sampling.max_tokens == 12
    assert job_from_openai_batch_line(chat(max_completion_tokens=None, max_tokens=9)).sampling.max_tokens == 9
    assert (
        "both given with different values" in rejected(chat(max_completion_tokens=12, max_tokens=10)).message
    )


def test_absent_max_tokens_uses_the_tokenmill_default():
    assert job_from_openai_batch_line(chat()).sampling.max_tokens == 256
    assert job_from_openai_batch_line(comp()).sampling.max_tokens == 256


def test_chat_logprobs():
    assert job_from_openai_batch_line(chat(logprobs=True)).sampling.logprobs == 0
    assert job_from_openai_batch_line(chat(logprobs=False)).sampling.logprobs is None
    assert job_from_openai_batch_line(chat(logprobs=True, top_logprobs=20)).sampling.logprobs == 20
    assert "body.top_logprobs: needs logprobs: true" in rejected(chat(top_logprobs=2)).message
    assert "body.logprobs: must be true or false" in rejected(chat(logprobs=1)).message
    assert "body.top_logprobs: must be <= 20" in rejected(chat(logprobs=True, top_logprobs=21)).message


def test_nulls_mean_defaults():
    job = job_from_openai_batch_line(
        chat(temperature=None, stop=None, seed=None, n=None, stream=None, model=None)
    )
    assert job.sampling.temperature == 1.0 and job.sampling.stop == [] and job.model is None


def test_vllm_extensions():
    job = job_from_openai_batch_line(
        chat(top_k=20, min_p=0.05, repetition_penalty=1.1, min_tokens=2, stop_token_ids=[7], ignore_eos=True)
    )
    s = job.sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.min_tokens, s.stop_token_ids, s.ignore_eos) == (
        20,
        0.05,
        1.1,
        2,
        [7],
        True,
    )


def test_developer_role_and_text_parts():
    job = job_from_openai_batch_line(
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        )
    )
    assert [(m.role, m.content) for m in job.messages] == [("system", "be brief"), ("user", "a\nb")]


def test_harmless_fields_are_ignored():
    base = job_from_openai_batch_line(chat())
    assert (
        job_from_openai_batch_line(chat(user="u1", store=False, metadata={"k": "v"}, service_tier="auto"))
        == base
    )


@pytest.mark.parametrize(
    "obj,expected",
    [
        (chat(n=65), "body.n: must be <= 64"),
        (chat(n=0), "body.n: must be >= 1"),
        (chat(n=True), "body.n: must be an integer"),
        (chat(n=1.0), "body.n: must be an integer"),
        (chat(n=2, seed=2**63 - 1), "body.n: seed + n - 1 must fit"),
        (comp(best_of=3), "body.best_of: best_of > 1 is not supported"),
        (chat(stream=True), "body.stream: streaming is not part of a batch request"),
        (chat(tools=[{"type": "function"}]), "body.tools: tool and function calling are not supported"),
        (chat(response_format="json"), "body.response_format: must be an object"),
        (chat(response_format={"type": "xml"}), "body.response_format.type: must be one of text, json_object"),
        (chat(response_format={}), "body.response_format.type: must be one of text, json_object, json_schema"),
        (chat(response_format={"type": "json_schema"}), "body.response_format.json_schema: required"),
        (schema_format(name="x"), "body.response_format.json_schema.schema: required"),
        (schema_format(name="x", schema="{}"), "body.response_format.json_schema.schema: must be a JSON Schema"),
        (schema_format(schema={}), "body.response_format.json_schema.name: required"),
        (schema_format(name="x", schema={}, strict=1), "body.response_format.json_schema.strict: must be true or"),
        (schema_format(name="x", schema={}, x=1), "body.response_format.json_schema.x: unknown field"),
        (
            chat(response_format={"type": "json_object", "json_schema": {"name": "x", "schema": {}}}),
            "body.response_format.json_schema: not a field of type json_object",
        ),
        (chat(response_format={"type": "text", "strict": True}), "body.response_format.strict: not a field of"),
        (
            chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
            "body.response_format, body.structured_outputs: both given",
        ),
        (chat(structured_outputs={"regex": ""}), "body.structured_outputs.regex: must not be empty"),
        (chat(structured_outputs={"structural_tag": "{}"}), "body.structured_outputs.structural_tag: unknown"),
        (chat(structured_outputs={"json": "{"}), "body.structured_outputs.json: not JSON"),
        (chat(logit_bias={"50256": -100}), "body.logit_bias: logit_bias is not supported"),
        (comp(echo=True), "body.echo: supported with logprobs only"),
        (comp(echo=1, logprobs=1), "body.echo: must be true or false"),
        (comp(echo=True, logprobs=21), "body.logprobs: must be <= 20"),
        (chat(echo=True), "body.echo: not a field of /v1/chat/completions"),
        (comp(score_from=3), "body.score_from: needs prompt_logprobs"),
        (comp(score_from=0, echo=True, logprobs=0), "body.score_from: must be >= 1"),
        (comp(max_tokens=0, logprobs=1), "body.max_tokens: must be >= 1 (0, score only, needs prompt_logprobs)"),
        (comp(suffix="end"), "body.suffix: suffix (insertion) is not supported"),
        (chat(frobnicate=1), "body.frobnicate: not supported"),
        (chat(prompt="x"), f"body.prompt: not a field of {CHAT}"),
        (comp(messages=HI), f"body.messages: not a field of {COMP}"),
        (comp(top_logprobs=2), f"body.top_logprobs: not a field of {COMP}"),
        (line({"model": "m"}), "body.messages: required"),
        (line({"model": "m"}, url=COMP), "body.prompt: required"),
        (comp(prompt=None), "body.prompt: must not be null"),
        (comp(prompt=["a", "b"]), "body.prompt: holds 2 prompts"),
        (comp(prompt=""), "body.prompt: must not be empty"),
        (comp(prompt=[]), "body.prompt: must not be empty"),
        (comp(prompt=[1, -2]), "body.prompt[1]: must be >= 0"),
        (
            chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "t"}]),
            "body.messages[0].role: must be one of",
        ),
        (
            chat(messages=[{"role": "user", "content": "x", "name": "bob"}]),
            "body.messages[0].name: unknown field",
        ),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "body.messages[0].content[0]: only text parts are supported",
        ),
        (chat(max_tokens=0), "body.max_tokens: must be >= 1"),
        (chat(max_completion_tokens="10"), "body.max_completion_tokens: must be an integer"),
        (chat(temperature=-1), "body.temperature: must be >= 0"),
        (chat(stop=[""]), "body.stop[0]: must not be empty"),
        (chat(seed=1.5), "body.seed: must be an integer"),
        (chat(model=""), "body.model: must not be empty"),
        (line({"messages": HI}, method="GET"), "method: must be 'POST'"),
        (
            line({"input": "x"}, url="/v1/embeddings"),
            "url: must be one of /v1/chat/completions, /v1/completions",
        ),
        (line({"messages": HI}, extra_field=1), "extra_field: unknown field"),
        ({"custom_id": "req-1", "method": "POST", "url": CHAT, "body": "x"}, "body: must be an object"),
        ({"custom_id": "req-1", "body": {"messages": HI}}, "method: required; url: required"),
    ],
)
def test_rejected_lines_name_the_openai_field(obj, expected):
    err = rejected(obj)
    assert expected in err.message, err.message
    assert err.job_id == "req-1"


def test_bad_custom_id():
    err = rejected({**chat(), "custom_id": ""})
    assert "custom_id: must not be empty" in err.message and err.job_id is None
    err = rejected({k: v for k, v in chat().items() if k != "custom_id"})
    assert "custom_id: required" in err.message and err.job_id is None


# --- output --------------------------------------------------------------------------------------


def result(**patch) -> Result:
    base = {
        "job_id": "req-1",
        "status": "ok",
        "text": "Bonjour",
        "token_ids": [5, 6],
        "finish_reason": "length",
        "model": "tiny-llama",
        "worker": "w1",
        "attempt": "w1-abc",
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "cached_prompt_tokens": 4},
        "timing": {"queue_ms": 1.0, "ttft_ms": 2.0, "decode_ms": 3.0, "total_ms": 5.0},
    }
    return Result.model_validate({**base, **patch})


LOGPROBS = [
    {
        "token_id": 5,
        "token": "Bon",
        "logprob": -0.5,
        "top_logprobs": [
            {"token_id": 5, "token": "Bon", "logprob": -0.5},
            {"token_id": 9, "token": "Sa", "logprob": None},
        ],
    },
    {"token_id": 6, "token": "jour", "logprob": -0.25, "top_logprobs": []},
]


def test_chat_output_line():
    out = openai_batch_output_line(result(), CHAT_COMPLETIONS_URL, created=1_700_000_000)
    json.dumps(out)  # one JSON line
    assert out["custom_id"] == "req-1" and out["id"].startswith("batch_req_") and out["error"] is None
    resp = out["response"]
    assert resp["status_code"] == 200 and resp["request_id"].startswith("req_")
    body = resp["body"]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["created"] == 1_700_000_000 and body["model"] == "tiny-llama"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Bonjour", "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_completions_output_line():
    out = openai_batch_output_line(result(finish_reason="stop"), COMPLETIONS_URL, created=1)
    body = out["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"text": "Bonjour", "index": 0, "logprobs": None, "finish_reason": "stop"}]


def test_output_logprobs_in_both_shapes():
    r = result(logprobs=LOGPROBS)
    chat_lp = openai_batch_output_line(r, CHAT, created=1)["response"]["body"]["choices"][0]["logprobs"]
    assert chat_lp["content"][0] == {
        "token": "Bon",
        "logprob": -0.5,
        "bytes": [66, 111, 110],
        "top_logprobs": [
            {"token": "Bon", "logprob": -0.5, "bytes": [66, 111, 110]},
            {"token": "Sa", "logprob": -9999.0, "bytes": [83, 97]},
        ],
    }
    assert chat_lp["content"][1]["top_logprobs"] == [] and chat_lp["refusal"] is None
    comp_lp = openai_batch_output_line(r, COMP, created=1)["response"]["body"]["choices"][0]["logprobs"]
    assert comp_lp == {
        "tokens": ["Bon", "jour"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Bon": -0.5, "Sa": -9999.0}, {}],
        "text_offset": [0, 3],
    }


@pytest.mark.parametrize(
    "code,status,kind",
    [
        ("invalid_job", 400, "invalid_request_error"),
        ("prompt_too_long", 400, "invalid_request_error"),
        ("model_mismatch", 400, "invalid_request_error"),
        ("internal", 500, "server_error"),
    ],
)
def test_error_output_line(code, status, kind):
    r = result(
        status="error", text="", token_ids=[], finish_reason=None, error={"code": code, "message": "why"}
    )
    out = openai_batch_output_line(r, None)
    assert out["error"] is None
    assert out["response"]["status_code"] == status
    assert out["response"]["body"] == {"error": {"message": "why", "type": kind, "param": None, "code": code}}


def test_expired_output_line():
    out = openai_batch_output_line(result(status="expired", text="", token_ids=[], finish_reason=None), CHAT)
    assert out["response"] is None and out["error"]["code"] == "batch_expired"


def test_output_ids_are_stable_per_attempt():
    a = openai_batch_output_line(result(), CHAT, created=1)
    assert a == openai_batch_output_line(result(), CHAT, created=1)
    assert a["id"] != openai_batch_output_line(result(attempt="w1-other"), CHAT, created=1)["id"]


def test_ok_output_needs_a_known_url():
    with pytest.raises(ValueError, match="url must be one of"):
        openai_batch_output_line(result(), "/v1/embeddings")


# --- response_format -> sampling.structured_outputs -----------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}


@pytest.mark.parametrize("strict", [True, False, None, "absent"])
@pytest.mark.parametrize("make", [chat, comp])
def test_json_schema_response_format_becomes_a_json_constraint(strict, make):
    spec = {"name": "person", "description": "a person", "schema": SCHEMA}
    if strict != "absent":
        spec["strict"] = strict
    job = job_from_openai_batch_line(make(response_format={"type": "json_schema", "json_schema": spec}))
    so = job.sampling.structured_outputs
    # strict changes nothing: the schema is enforced on every token either way.
    assert so.model_dump(exclude_defaults=True) == {"json": SCHEMA} and so.whitespace == "compact"


def test_json_object_response_format():
    so = job_from_openai_batch_line(chat(response_format={"type": "json_object"})).sampling.structured_outputs
    assert so.model_dump(exclude_defaults=True) == {"json_object": True}


@pytest.mark.parametrize("value", [{"type": "text"}, None])
def test_text_response_format_is_no_constraint(value):
    job = job_from_openai_batch_line(chat(response_format=value))
    assert job.sampling.structured_outputs is None and job == job_from_openai_batch_line(chat())


def test_vllm_structured_outputs_field():
    job = job_from_openai_batch_line(comp(structured_outputs={"choice": ["yes", "no"]}))
    assert job.sampling.structured_outputs.choice == ["yes", "no"]


def test_a_mapped_constraint_keeps_its_wire_form():
    from tokenmill.schemas import decode_job

    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    job = job_from_openai_batch_line(chat(response_format=rf))
    assert json.loads(job.to_json_bytes())["sampling"] == {"structured_outputs": {"json": SCHEMA}}
    assert decode_job(job.to_json_bytes()) == job  # what `produce` sends decodes to the same job


# --- the rename table ----------------------------------------------------------------------------

# A value each sampling path takes, to send under every body name that maps to it.
_SAMPLE_VALUES = {
    "max_tokens": 7, "temperature": 0.25, "top_p": 0.5, "presence_penalty": 0.5, "frequency_penalty": -0.5,
    "seed": 11, "stop": ["x"], "logprobs": 3, "top_k": 4, "min_p": 0.2, "repetition_penalty": 1.3,
    "min_tokens": 2, "stop_token_ids": [9], "ignore_eos": True, "structured_outputs": {"regex": "[a-z]+"},
    "n": 3, "score_from": 1,
}
# Body fields whose value changes shape on the way (tested on their own above).
_RESHAPED = ("logprobs", "top_logprobs", "response_format", "echo")


def _as_sent(value):
    return value.model_dump(exclude_defaults=True) if hasattr(value, "model_dump") else value


def test_every_sampling_rename_comes_from_the_one_table():
    from tokenmill.schemas.openai_batch import BODY_TO_JOB, COMPLETIONS

    for body_name, (path, endpoints) in BODY_TO_JOB.items():
        if not path.startswith("sampling.") or body_name in _RESHAPED:
            continue
        target = path.removeprefix("sampling.")
        value = _SAMPLE_VALUES[target]
        make = comp if endpoints == COMPLETIONS else chat
        job = job_from_openai_batch_line(make(**{body_name: value}))
        assert _as_sent(getattr(job.sampling, target)) == value, body_name
        # A bad value is reported under the OpenAI name, not the Job's.
        bad = 5 if target == "stop" else "bad"  # a stop string alone is a valid stop
        assert f"body.{body_name}" in rejected(make(**{body_name: bad})).message
    # Every Sampling field an OpenAI body can set is in the table.
    from tokenmill.schemas.job import Sampling

    assert {p.removeprefix("sampling.") for p, _ in BODY_TO_JOB.values() if p.startswith("sampling.")} == set(
        Sampling.model_fields
    )


# --- n, echo + logprobs: scoring through OpenAI lines ---------------------------------------------


@pytest.mark.parametrize("make", [chat, comp])
def test_n_maps_to_sampling_n(make):
    assert job_from_openai_batch_line(make(n=4, seed=9)).sampling.n == 4
    assert job_from_openai_batch_line(make(n=None)).sampling.n == 1
    assert job_from_openai_batch_line(make()).sampling.n == 1


def test_chat_top_logprobs_become_the_sampling_logprobs_count():
    job = job_from_openai_batch_line(chat(logprobs=True, top_logprobs=5, n=2))
    assert job.sampling.logprobs == 5 and job.sampling.prompt_logprobs is None and job.sampling.n == 2


def test_the_loglikelihood_line_lm_eval_sends():
    # local-completions: token ids of context + continuation, one token generated greedily, echo,
    # logprobs 1 (the top-1 tells whether each token was the greedy one).
    body = {"prompt": [101, 7, 8, 9, 10], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    job = job_from_openai_batch_line(line({"model": "tiny-llama", **body}, url=COMP))
    assert job.prompt_token_ids == [101, 7, 8, 9, 10]
    s = job.sampling
    assert (s.prompt_logprobs, s.score_from, s.logprobs, s.max_tokens, s.temperature) == (1, 1, 1, 1, 0.0)


def test_echo_with_max_tokens_0_scores_the_prompt_only():
    job = job_from_openai_batch_line(comp(echo=True, logprobs=0, max_tokens=0))
    assert (job.sampling.max_tokens, job.sampling.prompt_logprobs) == (0, 0)


def test_echo_false_scores_nothing_and_score_from_is_a_completions_extension():
    assert job_from_openai_batch_line(comp(echo=False, logprobs=2)).sampling.prompt_logprobs is None
    job = job_from_openai_batch_line(comp(echo=True, logprobs=2, score_from=4))
    assert (job.sampling.prompt_logprobs, job.sampling.score_from) == (2, 4)
    assert "body.score_from: not a field of /v1/chat/completions" in rejected(chat(score_from=2)).message


def entry(token_id, token, logprob, rank, top=()):
    return {"token_id": token_id, "token": token, "logprob": logprob, "rank": rank,
            "top_logprobs": [{"token_id": i, "token": t, "logprob": lp} for i, t, lp in top]}


# A 4-token prompt "The cat sat" + ".": positions 1..3 scored with the top-1.
SCORED_PROMPT = [
    entry(11, " cat", -2.0, 3, [(50, " dog", -0.5)]),
    entry(12, " sat", -0.75, 1, [(12, " sat", -0.75)]),
    entry(13, ".", None, 900, [(14, "!", -0.1)]),
]


def scored_result(**patch) -> Result:
    base = {"text": "", "token_ids": [], "usage": {"prompt_tokens": 4, "completion_tokens": 0, "cached_prompt_tokens": 0},
            "prompt_logprobs": SCORED_PROMPT, "is_greedy": False}
    return result(**{**base, **patch})


def test_echo_output_gives_the_prompt_logprobs_in_openai_shape():
    out = openai_batch_output_line(scored_result(), COMPLETIONS_URL, created=1, echo_head=["The"])
    (choice,) = out["response"]["body"]["choices"]
    assert choice["text"] == "The cat sat." and choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["The", " cat", " sat", "."],
        "token_logprobs": [None, -2.0, -0.75, -9999.0],  # the first token has none; -inf as OpenAI writes it
        "top_logprobs": [None, {" dog": -0.5}, {" sat": -0.75}, {"!": -0.1}],
        "text_offset": [0, 3, 7, 11],
    }
    json.dumps(out)


def lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """How lm-eval's local-completions model reads an echo response: the logprobs of the positions
    from ctxlen to the last prompt one (the generated token dropped), greedy when each equals the
    best of its top alternatives."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))


def test_lm_eval_reads_the_continuations_loglikelihood_from_the_echo_output():
    generated = [{"token_id": 14, "token": "!", "logprob": -0.1, "top_logprobs": [{"token_id": 14, "token": "!", "logprob": -0.1}]}]
    r = scored_result(
        text="!", token_ids=[14], logprobs=generated,
        usage={"prompt_tokens": 4, "completion_tokens": 1, "cached_prompt_tokens": 0},
    )
    (choice,) = openai_batch_output_line(r, COMPLETIONS_URL, created=1, echo_head=["The"])["response"]["body"]["choices"]
    assert choice["text"] == "The cat sat.!" and choice["logprobs"]["tokens"][-1] == "!"
    assert choice["logprobs"]["text_offset"][-1] == len("The cat sat.")
    assert lm_eval_loglikelihood(choice, ctxlen=2) == (-0.75 + -9999.0, False)  # " sat" "." continuation
    assert lm_eval_loglikelihood(choice, ctxlen=1)[0] == -2.0 - 0.75 - 9999.0
    single = dict(choice, logprobs={k: v[:3] + v[-1:] for k, v in choice["logprobs"].items()})
    assert lm_eval_loglikelihood(single, ctxlen=2) == (-0.75, True)


def test_echo_with_a_later_score_from_echoes_the_unscored_head_with_nulls():
    r = scored_result(prompt_logprobs=SCORED_PROMPT[1:], usage={"prompt_tokens": 4, "completion_tokens": 0})
    lp = openai_batch_output_line(r, COMPLETIONS_URL, created=1, echo_head=["The", " cat"])[
        "response"]["body"]["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [None, None, -0.75, -9999.0] and lp["top_logprobs"][:2] == [None, None]


@pytest.mark.parametrize(
    "make_result,head,url,expected",
    [
        (lambda: result(), ["The"], COMPLETIONS_URL, "echo needs a Result with prompt_logprobs"),
        (lambda: scored_result(), [], COMPLETIONS_URL, "must cover the prompt's 4 tokens"),
        (lambda: scored_result(), ["The", "x"], COMPLETIONS_URL, "must cover the prompt's 4 tokens"),
        (lambda: scored_result(), ["The"], CHAT_COMPLETIONS_URL, "echo is a /v1/completions field"),
        (lambda: scored_result(text="!", token_ids=[14]), ["The"], COMPLETIONS_URL, "needs their logprobs"),
    ],
)
def test_echo_output_refuses_what_it_cannot_write_faithfully(make_result, head, url, expected):
    with pytest.raises(ValueError, match=expected):
        openai_batch_output_line(make_result(), url, created=1, echo_head=head)


def test_prompt_logprobs_are_never_dropped_from_an_openai_body():
    with pytest.raises(ValueError, match="written echoed: pass echo_head"):
        openai_batch_output_line(scored_result(), COMPLETIONS_URL, created=1)
    with pytest.raises(ValueError, match="no place in a chat.completion body"):
        openai_batch_output_line(scored_result(), CHAT_COMPLETIONS_URL, created=1)


def test_a_runner_can_refuse_up_front_what_an_openai_body_cannot_hold():
    from tokenmill.schemas.openai_batch import openai_output_refusal

    scored_chat = Job.model_validate({"job_id": "a", "messages": HI, "sampling": {"prompt_logprobs": 1}})
    assert "no place in a chat.completion body" in openai_output_refusal(scored_chat, CHAT_COMPLETIONS_URL)
    assert openai_output_refusal(scored_chat, COMPLETIONS_URL) is None
    assert openai_output_refusal(job_from_openai_batch_line(chat(n=3)), CHAT_COMPLETIONS_URL) is None
    assert openai_output_refusal(job_from_openai_batch_line(comp(echo=True, logprobs=1)), COMPLETIONS_URL) is None


N_CHOICES = [
    {"index": 0, "text": "Bon", "token_ids": [5], "finish_reason": "length", "completion_tokens": 1,
     "logprobs": [{"token_id": 5, "token": "Bon", "logprob": -0.5, "top_logprobs": []}]},
    {"index": 1, "text": "Salut", "token_ids": [8], "finish_reason": "stop", "completion_tokens": 1,
     "logprobs": [{"token_id": 8, "token": "Salut", "logprob": -1.0, "top_logprobs": []}]},
]


def n_result() -> Result:
    return result(text="Bon", token_ids=[5], choices=N_CHOICES, logprobs=N_CHOICES[0]["logprobs"])


def test_n_choices_in_the_chat_output():
    body = openai_batch_output_line(n_result(), CHAT_COMPLETIONS_URL, created=1)["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["Bon", "Salut"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["choices"][1]["logprobs"]["content"][0]["logprob"] == -1.0
    assert body["usage"]["completion_tokens"] == 2


def test_n_choices_in_the_completions_output_each_echoed():
    r = result(
        text="Bon", token_ids=[5], choices=N_CHOICES, usage={"prompt_tokens": 4, "completion_tokens": 2},
        prompt_logprobs=SCORED_PROMPT, is_greedy=False,
    )
    choices = openai_batch_output_line(r, COMPLETIONS_URL, created=1, echo_head=["The"])["response"]["body"]["choices"]
    assert [c["text"] for c in choices] == ["The cat sat.Bon", "The cat sat.Salut"]
    assert [c["logprobs"]["token_logprobs"][-1] for c in choices] == [-0.5, -1.0]
    assert all(c["logprobs"]["token_logprobs"][:4] == [None, -2.0, -0.75, -9999.0] for c in choices)
    plain = openai_batch_output_line(n_result(), COMPLETIONS_URL, created=1)["response"]["body"]["choices"]
    assert [(c["index"], c["text"], c["logprobs"]["tokens"]) for c in plain] == [(0, "Bon", ["Bon"]), (1, "Salut", ["Salut"])]
