"""TokenEvent and Result: the contract's rules, each with a passing and a failing case."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tokenmill.schemas import (
    DEAD_LETTER_HEADERS,
    ERROR_CODES,
    Result,
    TokenEvent,
    dead_letter_headers,
    format_validation_error,
)

EVENT = {
    "job_id": "row-000017",
    "attempt": "w3-7f2c",
    "index": 0,
    "token_ids": [1012, 318],
    "text": "Bon",
    "finished": False,
}
RESULT = {
    "job_id": "row-000017",
    "status": "ok",
    "text": "Bonjour",
    "token_ids": [1012, 318, 29889],
    "finish_reason": "stop",
    "model": "tiny-llama",
    "worker": "w3",
    "attempt": "w3-7f2c",
    "usage": {"prompt_tokens": 9, "completion_tokens": 3, "cached_prompt_tokens": 0},
    "timing": {"queue_ms": 12.0, "ttft_ms": 40.1, "decode_ms": 22.9, "total_ms": 75.0},
    "source": {"topic": "tokenmill.jobs", "partition": 2, "offset": 1881},
    "metadata": {"dataset": "eval-2026-11"},
}


def problems(model, obj) -> str:
    with pytest.raises(ValidationError) as exc:
        model.model_validate(obj)
    return format_validation_error(exc.value)


def test_contract_examples_parse_and_serialize_unchanged():
    assert json.loads(TokenEvent.model_validate(EVENT).to_json_bytes()) == EVENT
    assert json.loads(Result.model_validate(RESULT).to_json_bytes()) == RESULT


@pytest.mark.parametrize(
    "patch,ok,expected",
    [
        ({"index": 5}, True, None),
        ({"index": -1}, False, "index: must be >= 0"),
        ({"index": "1"}, False, "index: must be an integer"),
        ({"attempt": ""}, False, "attempt: must not be empty"),
        ({"job_id": ""}, False, "job_id: must not be empty"),
        ({"token_ids": []}, True, None),
        ({"token_ids": [-1]}, False, "token_ids[0]: must be >= 0"),
        ({"finished": True}, True, None),
        ({"finished": "yes"}, False, "finished: must be true or false"),
        ({"text": None}, False, "text: must be a string"),
    ],
)
def test_token_event_rules(patch, ok, expected):
    obj = {**EVENT, **patch}
    if ok:
        assert TokenEvent.model_validate(obj).model_dump() == obj
    else:
        assert expected in problems(TokenEvent, obj)


def error_result(**patch):
    base = {k: v for k, v in RESULT.items() if k not in ("text", "token_ids", "finish_reason")}
    return {
        **base,
        "status": "error",
        "error": {"code": "prompt_too_long", "message": "9000 tokens > 4096"},
        **patch,
    }


@pytest.mark.parametrize(
    "obj,ok,expected",
    [
        (RESULT, True, None),
        ({**RESULT, "finish_reason": "length"}, True, None),
        ({**RESULT, "finish_reason": "eos"}, False, "finish_reason: must be one of 'stop' or 'length'"),
        ({**RESULT, "finish_reason": None}, False, "status ok needs a finish_reason"),
        ({**RESULT, "status": "done"}, False, "status: must be one of 'ok', 'error' or 'expired'"),
        (error_result(), True, None),
        *[(error_result(error={"code": c, "message": "m"}), True, None) for c in ERROR_CODES],
        (error_result(error={"code": "oops", "message": "m"}), False, "error.code: must be one of"),
        (error_result(error={"code": "internal", "message": ""}), False, "error.message: must not be empty"),
        (error_result(error=None), False, "status error needs an error"),
        (error_result(finish_reason="stop"), False, "status error has no finish_reason"),
        (
            {**RESULT, "error": {"code": "internal", "message": "m"}},
            False,
            "status ok must not carry an error",
        ),
        (error_result(status="expired", error=None), True, None),
        (error_result(status="expired"), False, "status expired must not carry an error"),
        ({**RESULT, "usage": {"prompt_tokens": -1}}, False, "usage.prompt_tokens: must be >= 0"),
        ({**RESULT, "timing": {"ttft_ms": -0.5}}, False, "timing.ttft_ms: must be >= 0"),
        (
            {**RESULT, "source": {"topic": "t", "partition": -1, "offset": 0}},
            False,
            "source.partition: must be >= 0",
        ),
        ({**RESULT, "source": None}, True, None),
        (
            {
                **RESULT,
                "logprobs": [
                    {
                        "token_id": 1,
                        "token": "a",
                        "logprob": -0.1,
                        "top_logprobs": [{"token_id": 2, "token": "b", "logprob": None}],
                    }
                ],
            },
            True,
            None,
        ),
        ({**RESULT, "logprobs": [{"token_id": 1, "token": "a"}]}, False, "logprobs[0].logprob: required"),
    ],
)
def test_result_rules(obj, ok, expected):
    if ok:
        Result.model_validate(obj)
    else:
        assert expected in problems(Result, obj)


def test_absent_parts_are_left_out_and_finish_reason_stays():
    r = Result.model_validate(error_result(source=None, metadata=None))
    data = json.loads(r.to_json_bytes())
    assert "source" not in data and "metadata" not in data and "logprobs" not in data
    assert data["finish_reason"] is None and data["error"]["code"] == "prompt_too_long"
    ok = json.loads(Result.model_validate(RESULT).to_json_bytes())
    assert "error" not in ok and "logprobs" not in ok


def test_readers_ignore_fields_added_by_newer_workers():
    assert Result.model_validate({**RESULT, "added_in_v2": 1}) == Result.model_validate(RESULT)
    assert TokenEvent.model_validate({**EVENT, "added_in_v2": 1}) == TokenEvent.model_validate(EVENT)


def test_dead_letter_headers():
    assert DEAD_LETTER_HEADERS == (
        "tokenmill.error.code",
        "tokenmill.error.message",
        "tokenmill.source.topic",
        "tokenmill.source.partition",
        "tokenmill.source.offset",
    )
    headers = dead_letter_headers(
        "invalid_job", "prompt: must not be empty", topic="tokenmill.jobs", partition=3, offset=42
    )
    assert headers == [
        ("tokenmill.error.code", b"invalid_job"),
        ("tokenmill.error.message", b"prompt: must not be empty"),
        ("tokenmill.source.topic", b"tokenmill.jobs"),
        ("tokenmill.source.partition", b"3"),
        ("tokenmill.source.offset", b"42"),
    ]
    with pytest.raises(ValueError, match="unknown error code"):
        dead_letter_headers("bad_json", "x", topic="t", partition=0, offset=0)


# --- scoring and n samples ----------------------------------------------------------------------

PROMPT_LOGPROBS = [
    {"token_id": 12, "token": " the", "logprob": -1.5, "rank": 2,
     "top_logprobs": [{"token_id": 7, "token": " a", "logprob": -0.5}, {"token_id": 12, "token": " the", "logprob": -1.5}]},
    {"token_id": 40, "token": " cat", "logprob": -0.25, "rank": 1, "top_logprobs": []},
]
SCORED = {**RESULT, "prompt_logprobs": PROMPT_LOGPROBS, "prompt_logprob_sum": -1.75, "is_greedy": False}
CHOICES = [
    {"index": 0, "text": "Bonjour", "token_ids": [1012, 318, 29889], "finish_reason": "stop", "completion_tokens": 3},
    {"index": 1, "text": "Salut", "token_ids": [77], "finish_reason": "length", "completion_tokens": 1,
     "logprobs": [{"token_id": 77, "token": "Salut", "logprob": -0.1, "top_logprobs": []}]},
]


def test_an_old_result_still_parses_and_gains_no_fields():
    old = json.dumps(RESULT).encode()  # a Result written before the scoring fields existed
    r = Result.model_validate_json(old)
    assert (r.prompt_logprobs, r.prompt_logprob_sum, r.is_greedy, r.choices) == (None, None, None, None)
    assert json.loads(r.to_json_bytes()) == RESULT


def test_an_old_token_event_is_unchanged():
    e = TokenEvent.model_validate(EVENT)
    assert e.choice is None and json.loads(e.to_json_bytes()) == EVENT


def test_a_token_event_of_an_n_job_carries_its_choice():
    e = TokenEvent.model_validate({**EVENT, "choice": 3})
    assert json.loads(e.to_json_bytes()) == {**EVENT, "choice": 3}
    assert "choice: must be >= 0" in problems(TokenEvent, {**EVENT, "choice": -1})
    assert "choice: must be an integer" in problems(TokenEvent, {**EVENT, "choice": "1"})


def test_a_scored_result_round_trips():
    r = Result.model_validate(SCORED)
    assert r.prompt_logprobs[0].rank == 2 and r.prompt_logprobs[0].top_logprobs[0].token == " a"
    assert r.prompt_logprob_sum == -1.75 and r.is_greedy is False
    assert json.loads(r.to_json_bytes()) == SCORED


def test_a_scored_position_may_be_minus_infinity():
    entry = {"token_id": 3, "token": "x", "logprob": None, "rank": 2048, "top_logprobs": []}
    r = Result.model_validate({**RESULT, "prompt_logprobs": [entry], "is_greedy": False})
    assert r.prompt_logprobs[0].logprob is None and r.prompt_logprob_sum is None
    assert "prompt_logprob_sum" not in json.loads(r.to_json_bytes())


@pytest.mark.parametrize(
    "patch,expected",
    [
        ({"prompt_logprobs": [{**PROMPT_LOGPROBS[1], "rank": 0}]}, "prompt_logprobs[0].rank: must be >= 1"),
        ({"prompt_logprobs": [{**PROMPT_LOGPROBS[1], "logprob": "x"}]}, "prompt_logprobs[0].logprob"),
        ({"is_greedy": None}, "needs is_greedy"),
        ({"prompt_logprobs": None}, "come only with prompt_logprobs"),
        ({"status": "expired", "finish_reason": None}, "status expired has no prompt_logprobs"),
    ],
)
def test_scored_result_rules(patch, expected):
    assert expected in problems(Result, {**SCORED, **patch})


def test_a_result_with_choices_round_trips_and_omits_absent_logprobs():
    obj = {**RESULT, "choices": CHOICES, "usage": {**RESULT["usage"], "completion_tokens": 4}}
    r = Result.model_validate(obj)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[1].logprobs[0].token == "Salut"
    out = json.loads(r.to_json_bytes())
    assert out == obj and "logprobs" not in out["choices"][0]


@pytest.mark.parametrize(
    "choices,expected",
    [
        ([CHOICES[1], CHOICES[0]], "indexed 0..n-1 in order"),
        ([CHOICES[0]], "n >= 2"),
        ([CHOICES[0], {**CHOICES[1], "index": 2}], "indexed 0..n-1"),
        ([CHOICES[0], {**CHOICES[1], "finish_reason": None}], "choices[1].finish_reason"),
        ([CHOICES[0], {**CHOICES[1], "completion_tokens": -1}], "choices[1].completion_tokens: must be >= 0"),
    ],
)
def test_choices_rules(choices, expected):
    assert expected in problems(Result, {**RESULT, "choices": choices})


def test_an_error_result_has_no_choices():
    err = {**RESULT, "status": "error", "finish_reason": None, "error": {"code": "internal", "message": "x"}}
    assert "status error has no choices" in problems(Result, {**err, "choices": CHOICES})
