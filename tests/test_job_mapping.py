"""Job -> EngineRequest and final RequestDelta -> Result."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenmill.engine.types import (
    ErrorKind,
    FinishReason,
    RequestDelta,
    SamplingParams,
    Timing,
    TokenLogprob,
    Usage,
)
from tokenmill.job_mapping import (
    ENGINE_ERROR_CODES,
    build_result,
    error_result,
    job_to_engine_request,
    new_attempt_id,
)
from tokenmill.schemas import ERROR_CODES, Job, Result, Source, decode_job

SAMPLING = {
    "max_tokens": 12,
    "min_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.3,
    "frequency_penalty": -0.2,
    "seed": 9,
    "stop": ["\n"],
    "stop_token_ids": [7],
    "ignore_eos": True,
    "logprobs": 2,
}


def job(**fields) -> Job:
    return Job.model_validate({"job_id": "j1", "prompt": "hello", **fields})


def final(reason=FinishReason.STOP, **fields) -> RequestDelta:
    base = dict(
        request_id="j1",
        new_token_ids=[6],
        text_delta="jour",
        finished=True,
        finish_reason=reason,
        usage=Usage(prompt_tokens=9, completion_tokens=2, cached_prompt_tokens=4),
        timing=Timing(queue_ms=1.5, ttft_ms=4.0, decode_ms=2.0, total_ms=6.0),
        output_token_ids=[5, 6],
        output_text="Bonjour",
    )
    base.update(fields)
    return RequestDelta(**base)


WHO = dict(model="tiny-llama", worker="w3", attempt="w3-abc")


def test_every_sampling_field_reaches_the_engine():
    req = job_to_engine_request(
        job(sampling=SAMPLING, priority=-2, deadline_ms=1_700_000_000_000, tenant="t1"), arrival_time=123.0
    )
    assert (
        req.request_id == "j1"
        and req.prompt == "hello"
        and req.messages is None
        and req.prompt_token_ids is None
    )
    assert req.sampling == SamplingParams(**SAMPLING)
    assert (req.priority, req.deadline_ms, req.tenant, req.arrival_time) == (
        -2,
        1_700_000_000_000.0,
        "t1",
        123.0,
    )


def test_defaults_match_the_engine_defaults():
    assert job_to_engine_request(job()).sampling == SamplingParams()


def test_prompt_forms():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    req = job_to_engine_request(Job.model_validate({"job_id": "a", "messages": msgs}))
    assert req.messages == msgs and req.prompt is None
    req = job_to_engine_request(Job.model_validate({"job_id": "a", "prompt_token_ids": [1, 2, 3]}))
    assert req.prompt_token_ids == [1, 2, 3] and req.prompt is None


def test_request_id_and_arrival_time():
    import time

    before = time.time()
    req = job_to_engine_request(job(), request_id="j1#w3-abc")
    assert req.request_id == "j1#w3-abc" and before <= req.arrival_time <= time.time()


def test_only_a_streaming_job_asks_the_engine_for_token_deltas():
    assert job_to_engine_request(Job.model_validate({"job_id": "a", "prompt": "hi"})).final_only
    streaming = Job.model_validate({"job_id": "a", "prompt": "hi", "stream": True})
    assert not job_to_engine_request(streaming).final_only


def test_ok_result():
    src = Source(topic="tokenmill.jobs", partition=2, offset=1881)
    r = build_result(job(metadata={"row": 1}), final(), source=src, **WHO)
    assert r.status == "ok" and r.finish_reason == "stop" and r.error is None
    assert (r.text, r.token_ids) == ("Bonjour", [5, 6])
    assert (r.model, r.worker, r.attempt, r.job_id) == ("tiny-llama", "w3", "w3-abc", "j1")
    assert r.usage.model_dump() == {"prompt_tokens": 9, "completion_tokens": 2, "cached_prompt_tokens": 4}
    assert r.timing.model_dump() == {"queue_ms": 1.5, "ttft_ms": 4.0, "decode_ms": 2.0, "total_ms": 6.0}
    assert r.source == src and r.metadata == {"row": 1} and r.logprobs is None
    # What goes on the wire is a valid contract Result.
    assert Result.model_validate(json.loads(r.to_json_bytes())) == r


def test_length_result():
    assert build_result(job(), final(FinishReason.LENGTH), **WHO).finish_reason == "length"


def test_expired_result():
    r = build_result(job(), final(FinishReason.EXPIRED, output_token_ids=[], output_text=""), **WHO)
    assert r.status == "expired" and r.finish_reason is None and r.error is None and r.text == ""


@pytest.mark.parametrize(
    "kind,engine_error,code,message",
    [
        (
            ErrorKind.PROMPT_TOO_LONG,
            "prompt has 5000 tokens, the model allows 4096",
            "prompt_too_long",
            "prompt has 5000 tokens, the model allows 4096",
        ),
        (ErrorKind.INVALID_REQUEST, "token id 99999 out of range", "invalid_job", "token id 99999 out of range"),
        (ErrorKind.INTERNAL, "CUDA error: out of memory", "internal", "CUDA error: out of memory"),
        (
            ErrorKind.INVALID_CONSTRAINT,
            "regex: unbalanced parenthesis at 3",
            "invalid_constraint",
            "regex: unbalanced parenthesis at 3",
        ),
        (None, None, "internal", "the engine failed without a message"),
    ],
)
def test_error_result_codes(kind, engine_error, code, message):
    r = build_result(
        job(),
        final(FinishReason.ERROR, error_kind=kind, error=engine_error, output_token_ids=None, output_text=None),
        **WHO,
    )
    assert r.status == "error" and r.error.code == code and r.error.message == message
    assert r.text == "" and r.token_ids == [] and r.finish_reason is None


def test_every_engine_error_kind_maps_to_a_contract_code():
    assert set(ENGINE_ERROR_CODES) == set(ErrorKind)
    assert set(ENGINE_ERROR_CODES.values()) <= set(ERROR_CODES)


def test_a_constraint_reaches_the_engine():
    req = job_to_engine_request(job(sampling={"max_tokens": 5, "structured_outputs": {"regex": "[0-9]+"}}))
    assert req.sampling.structured_outputs.kind == "regex" and req.sampling.structured_outputs.regex == "[0-9]+"
    assert req.sampling == SamplingParams(max_tokens=5, structured_outputs={"regex": "[0-9]+"})


# -- invalid_constraint on the worker's path: a job that cannot run, like prompt_too_long -------------

_BAD_CONSTRAINT = {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}}


def _bad_constraint_delta(request_id: str) -> RequestDelta:
    return final(FinishReason.ERROR, request_id=request_id, error_kind=ErrorKind.INVALID_CONSTRAINT,
                 error="unknown type 'nope'", output_token_ids=None, output_text=None)


def test_an_invalid_constraint_is_dead_lettered_and_gets_its_error_result():
    from tests.test_worker_steps import _ctx, _job
    from tokenmill.kafka import answers

    job_ = _job(sampling=_BAD_CONSTRAINT)
    ans = answers.finished(job_, _bad_constraint_delta(job_.request_id), _ctx())
    dead, result = ans.records
    assert dead.topic == "dlq" and dead.value == job_.fetched.value  # the input, unchanged
    assert dict(dead.headers)["tokenmill.error.code"] == b"invalid_constraint"
    assert json.loads(result.value)["error"] == {"code": "invalid_constraint", "message": "unknown type 'nope'"}
    assert (ans.outcome, ans.code) == ("error", "invalid_constraint")


async def test_an_invalid_constraint_counts_as_bad_input_for_the_guard():
    import asyncio

    from tests.test_worker_steps import FakeTokens, _ctx, _inflight, _job
    from tokenmill.kafka.engine_output import EngineOutput
    from tokenmill.kafka.offsets import OffsetTracker
    from tokenmill.metrics import WorkerMetrics

    inflight, thread, _ = _inflight(cap=0)
    job_ = _job(sampling=_BAD_CONSTRAINT)
    recorded, delivered, tasks = [], [], []

    async def deliver(answer) -> None:
        delivered.append(answer)

    output = EngineOutput(inflight, FakeTokens(), OffsetTracker(10), _ctx(), WorkerMetrics(),
                          record_input=recorded.append, deliver=deliver,
                          spawn=lambda coro, name: tasks.append(asyncio.ensure_future(coro)))
    inflight.admit(job_)
    assert thread.submitted == [job_.attempt]  # the job's constraint mapped onto an engine request
    output.take([_bad_constraint_delta(job_.request_id)])
    await asyncio.gather(*tasks)
    assert recorded == ["invalid_constraint"] and [a.code for a in delivered] == ["invalid_constraint"]


def test_a_code_written_into_the_message_is_not_parsed_back():
    r = build_result(job(), final(FinishReason.ERROR, error_kind=ErrorKind.INTERNAL,
                                  error="prompt_too_long: looks like a code", output_token_ids=None,
                                  output_text=None), **WHO)
    assert r.error.code == "internal" and r.error.message == "prompt_too_long: looks like a code"


def test_aborted_is_an_internal_error():
    r = build_result(job(), final(FinishReason.ABORTED), **WHO)
    assert r.status == "error" and r.error.code == "internal" and "aborted" in r.error.message


def test_build_result_needs_the_final_delta():
    with pytest.raises(ValueError, match="final delta"):
        build_result(job(), final(finished=False, finish_reason=None), **WHO)
    with pytest.raises(ValueError, match="lacks output"):
        build_result(job(), final(output_text=None), **WHO)


def lp(tid: int, text: str, value: float, top=()) -> TokenLogprob:
    return TokenLogprob(token_id=tid, token=text, logprob=value, top_logprobs=list(top))


def test_logprobs_map_from_token_logprobs():
    gathered = [lp(5, "Bon", -0.5, [(5, "Bon", -0.5), (9, "Sa", float("-inf"))]), lp(6, "jour", -0.25)]
    r = build_result(job(sampling={"logprobs": 1}), final(output_logprobs=gathered), **WHO)
    assert [x.model_dump() for x in r.logprobs] == [
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
    json.loads(r.to_json_bytes())  # -inf became null: still strict JSON


def test_logprobs_from_the_final_delta_when_it_covers_the_output():
    r = build_result(
        job(sampling={"logprobs": 0}), final(output_logprobs=[lp(5, "Bon", -1.0), lp(6, "jour", -2.0)]), **WHO
    )
    assert [x.logprob for x in r.logprobs] == [-1.0, -2.0]


def test_partial_logprobs_are_refused():
    with pytest.raises(ValueError, match="has 1 for 2 tokens"):
        build_result(job(sampling={"logprobs": 0}), final(output_logprobs=[lp(6, "jour", -2.0)]), **WHO)
    with pytest.raises(ValueError, match="has 0 for 2 tokens"):
        build_result(job(sampling={"logprobs": 0}), final(), **WHO)


def test_logprobs_left_out_when_not_asked():
    assert (
        build_result(job(), final(output_logprobs=[lp(5, "Bon", -1.0), lp(6, "jour", -2.0)]), **WHO).logprobs
        is None
    )


def test_error_result_for_jobs_that_did_not_run():
    src = Source(topic="tokenmill.jobs", partition=0, offset=7)
    r = error_result(
        "row-9", "invalid_job", "prompt: must not be empty", source=src, metadata={"a": 1}, **WHO
    )
    assert (
        r.status == "error" and r.error.code == "invalid_job" and r.source == src and r.metadata == {"a": 1}
    )
    data = json.loads(r.to_json_bytes())
    assert data["error"] == {"code": "invalid_job", "message": "prompt: must not be empty"}
    with pytest.raises(ValueError, match="unknown error code"):
        error_result("row-9", "bad", "x", **WHO)


def test_decode_error_to_error_result():
    try:
        decode_job(b'{"job_id": "row-3", "prompt": "p", "sampling": {"max_tokens": 0}}')
    except ValueError as exc:
        r = error_result(exc.job_id, exc.code, exc.message, **WHO)
    assert r.job_id == "row-3" and r.error.message == (
        "sampling.max_tokens: must be >= 1 (0, score only, needs prompt_logprobs)"
    )


def test_attempt_ids_are_unique_and_name_the_worker():
    ids = {new_attempt_id("w3") for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("w3-") for i in ids)
    with pytest.raises(ValueError):
        new_attempt_id("")


def test_imports_no_torch():
    code = "import sys, tokenmill.job_mapping; print('torch' in sys.modules, 'aiokafka' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
