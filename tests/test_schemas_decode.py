"""decode_job / parse_input_line: any input gives a Job or one JobDecodeError, never anything else."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.schemas import (
    ERROR_CODES,
    ERROR_INVALID_JOB,
    Job,
    JobDecodeError,
    decode_job,
    parse_input_line,
    read_input_line,
)

# --- fixed cases --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,reason,job_id",
    [
        (b"\xff\xfe{}", "not UTF-8", None),
        (b'{"job_id": "a", "prompt": "caf\xe9"}', "not UTF-8", None),
        (b"", "not JSON", None),
        (b"{job_id: 1}", "not JSON", None),
        (b'{"job_id": "a", "prompt": "p"} trailing', "not JSON", None),
        (b'\xef\xbb\xbf{"job_id": "a", "prompt": "p"}', "not JSON", None),  # UTF-8 BOM
        (
            b'{"job_id": "a", "prompt": "p", "sampling": {"temperature": NaN}}',
            "NaN is not a JSON value",
            "a",
        ),
        (
            b'{"job_id": "a", "prompt": "p", "sampling": {"top_p": Infinity}}',
            "Infinity is not a JSON value",
            "a",
        ),
        (b'{"job_id": "a", "prompt": "p", "prompt": "q"}', "duplicate key 'prompt'", "a"),
        (b'{"job_id": "a", "prompt": "\\ud800"}', "lone UTF-16 surrogate", "a"),
        (b'{"job_id": "a", "prompt": "p", "priority": 1' + b"0" * 5000 + b"}", "not JSON", "a"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON", None),
        (b"[]", "must be a JSON object, got an array", None),
        (b'"job"', "must be a JSON object, got a string", None),
        (b"17", "must be a JSON object, got a number", None),
        (b"null", "must be a JSON object, got null", None),
        (b"true", "must be a JSON object, got a boolean", None),
        (b'{"job_id": "row-9", "prompt": ""}', "prompt: must not be empty", "row-9"),
        (b'{"job_id": "' + b"x" * 300 + b'", "prompt": "p"}', "job_id: must have at most 256", None),
        (b'{"job_id": 5, "prompt": "p"}', "job_id: must be a string", None),
    ],
)
def test_bad_input_is_one_error_type(raw, reason, job_id):
    with pytest.raises(JobDecodeError) as exc:
        decode_job(raw)
    assert exc.value.code == ERROR_INVALID_JOB
    assert reason in exc.value.message
    assert exc.value.job_id == job_id


@pytest.mark.parametrize(
    "raw,job_id",
    [
        # The strict rules refuse these, the id is read all the same (the contract's error Result).
        (b'{"job_id": "j-7", "prompt": "a \\udc00 lone low surrogate"}', "j-7"),
        (b'{"prompt": "\\ud83d", "metadata": {"job_id": "inner"}, "job_id": "last-key"}', "last-key"),
        (b'{"job_id": "j-8", "messages": [{"role": "user", "content": "\\ud800"}], "sampling": {"seed": NaN}}',
         "j-8"),
        # No id can be read: the id itself is unusable, given twice, or not there at all.
        (b'{"job_id": "bad \\ud800 id", "prompt": "p"}', None),
        (b'{"job_id": "a", "job_id": "b", "prompt": "\\ud800"}', None),
        (b'{"prompt": "\\ud800", "metadata": {"job_id": "inner"}}', None),
        (b'{"job_id": "a", "prompt": "\\ud800", "sampling": {"max_tokens": 1, }', None),  # not JSON at all
    ],
)
def test_the_job_id_is_read_first_even_when_another_field_cannot_be_decoded(raw, job_id):
    with pytest.raises(JobDecodeError) as exc:
        decode_job(raw)
    assert exc.value.code == ERROR_INVALID_JOB and exc.value.job_id == job_id
    with pytest.raises(JobDecodeError) as exc:
        parse_input_line(raw)
    assert exc.value.job_id == job_id  # run-batch reads lines with the same decoder


def test_an_openai_batch_line_that_cannot_be_decoded_is_answered_under_its_custom_id():
    raw = (b'{"custom_id": "c9", "method": "POST", "url": "/v1/completions", '
           b'"body": {"prompt": "\\ud800", "max_tokens": 2}}')
    with pytest.raises(JobDecodeError) as exc:
        parse_input_line(raw)
    assert exc.value.job_id == "c9" and "surrogate" in exc.value.message
    # On the jobs topic only a Job's own job_id counts (a batch line is not a Job there).
    with pytest.raises(JobDecodeError) as exc:
        decode_job(raw)
    assert exc.value.job_id is None


def test_valid_surrogate_pair_escape_is_fine():
    job = decode_job(b'{"job_id": "a", "prompt": "smile \\ud83d\\ude00"}')
    assert job.prompt == "smile \U0001f600"


def test_accepts_str_bytearray_and_memoryview():
    raw = b'{"job_id": "a", "prompt": "p"}'
    assert (
        decode_job(raw)
        == decode_job(raw.decode())
        == decode_job(bytearray(raw))
        == decode_job(memoryview(raw))
    )


def test_parse_input_line_tells_the_formats_apart():
    job_line = b'{"job_id": "j1", "messages": [{"role": "user", "content": "hi"}]}'
    batch_line = json.dumps(
        {
            "custom_id": "c1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        }
    ).encode()
    assert parse_input_line(job_line).job_id == "j1"
    assert read_input_line(job_line).openai_url is None
    parsed = read_input_line(batch_line)
    assert parsed.job.job_id == "c1" and parsed.job.sampling.max_tokens == 5
    assert parsed.openai_url == "/v1/chat/completions"
    # A line with custom_id but no body is a (bad) Job line, reported as such.
    with pytest.raises(JobDecodeError) as exc:
        parse_input_line(b'{"custom_id": "c2", "job_id": "j2", "prompt": "p"}')
    assert "custom_id: unknown field" in exc.value.message and exc.value.job_id == "j2"
    # A bad OpenAI line reports its custom_id as job_id.
    with pytest.raises(JobDecodeError) as exc:
        parse_input_line(
            b'{"custom_id": "c3", "method": "POST", "url": "/v1/completions", "body": {"n": 65, "prompt": "p"}}'
        )
    assert exc.value.job_id == "c3" and "body.n: must be <= 64" in exc.value.message


# --- properties ---------------------------------------------------------------------------------


def assert_job_or_decode_error(fn, raw) -> None:
    try:
        result = fn(raw)
    except JobDecodeError as exc:
        assert exc.code in ERROR_CODES
        assert isinstance(exc.message, str) and exc.message
        assert exc.job_id is None or (isinstance(exc.job_id, str) and 1 <= len(exc.job_id) <= 256)
        if exc.job_id is not None:
            exc.job_id.encode("utf-8")  # usable as a Kafka key and in a Result
        return
    assert isinstance(result, Job)
    # A decoded job can always be written back out and reads the same.
    assert decode_job(result.to_json_bytes()) == result


json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)
JOB_KEYS = [
    "job_id",
    "prompt",
    "messages",
    "prompt_token_ids",
    "model",
    "sampling",
    "stream",
    "priority",
    "deadline_ms",
    "tenant",
    "metadata",
    "custom_id",
    "body",
    "url",
    "method",
]
SAMPLING_KEYS = [
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "score_from",
    "n",
]
sampling_like = st.dictionaries(st.sampled_from(SAMPLING_KEYS), json_values | st.integers(-3, 30), max_size=6)
message_like = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", ""]),
        "content": st.text(max_size=5) | json_values,
    }
)
value_for_key = {
    "job_id": st.text(max_size=300),
    "prompt": st.text(max_size=10) | json_values,
    "messages": st.lists(message_like, max_size=3) | json_values,
    "prompt_token_ids": st.lists(st.integers(-2, 2**32), max_size=4) | json_values,
    "sampling": sampling_like | json_values,
    "body": st.dictionaries(
        st.sampled_from(SAMPLING_KEYS + ["messages", "prompt", "n", "model"]), json_values, max_size=4
    ),
    "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/x"]),
    "method": st.sampled_from(["POST", "GET"]),
}
job_like = st.lists(st.sampled_from(JOB_KEYS), unique=True, max_size=7).flatmap(
    lambda keys: st.fixed_dictionaries({k: value_for_key.get(k, json_values) for k in keys})
)

SETTINGS = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes(raw):
    assert_job_or_decode_error(decode_job, raw)
    assert_job_or_decode_error(parse_input_line, raw)


@SETTINGS
@given(json_values)
def test_arbitrary_json(value):
    raw = json.dumps(value).encode()
    assert_job_or_decode_error(decode_job, raw)
    assert_job_or_decode_error(parse_input_line, raw)


@SETTINGS
@given(job_like)
def test_arbitrary_job_shaped_objects(obj):
    raw = json.dumps(obj).encode()
    assert_job_or_decode_error(decode_job, raw)
    assert_job_or_decode_error(parse_input_line, raw)


valid_jobs = st.fixed_dictionaries(
    {"job_id": st.text(min_size=1, max_size=40)},
    optional={
        "sampling": st.fixed_dictionaries(
            {},
            optional={
                "max_tokens": st.integers(1, 4096),
                "temperature": st.floats(0, 2),
                "top_p": st.floats(0.01, 1),
                "seed": st.integers(0, 2**40) | st.none(),
                "stop": st.lists(st.text(min_size=1, max_size=4), max_size=16),
                "logprobs": st.integers(0, 20) | st.none(),
                "n": st.integers(1, 64),
            },
        ),
        "stream": st.booleans(),
        "priority": st.integers(-100, 100),
        "tenant": st.text(min_size=1, max_size=10),
        "metadata": st.dictionaries(st.text(max_size=5), json_values, max_size=4),
    },
).flatmap(
    lambda base: st.one_of(
        st.text(min_size=1, max_size=20).map(lambda p: {**base, "prompt": p}),
        st.lists(st.integers(0, 50_000), min_size=1, max_size=8).map(
            lambda t: {**base, "prompt_token_ids": t}
        ),
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=8)}
            ),
            min_size=1,
            max_size=3,
        ).map(lambda m: {**base, "messages": m}),
    )
)


@SETTINGS
@given(valid_jobs)
def test_valid_jobs_decode_and_round_trip(obj):
    raw = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    job = decode_job(raw)
    assert job.job_id == obj["job_id"]
    assert job == Job.model_validate(obj)
    assert decode_job(job.to_json_bytes()) == job
