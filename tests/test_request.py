"""A request's own token bookkeeping: known tokens, placeholders of overlapped steps, errors."""

import pytest

from tokenmill.engine.request import PENDING_TOKEN, Request
from tokenmill.engine.sampler import num_generated
from tokenmill.engine.types import EngineRequest, ErrorKind, SamplingParams


def make(prompt=(1, 2, 3), **sampling):
    er = EngineRequest(request_id="r", prompt_token_ids=list(prompt), sampling=SamplingParams(**sampling))
    return Request(er, list(prompt), eos_token_ids=[0])


def test_a_known_token_joins_the_output_and_the_kv_token_list():
    r = make()
    r.append_output(7, now=5.0)
    r.append_output(8, now=6.0)
    assert r.output_token_ids == [7, 8] and r.kv.token_ids == [1, 2, 3, 7, 8]
    assert r.num_tokens == 5 and r.first_token_time == 5.0
    assert num_generated(r.sampling_inputs) == 2 and r.sampling_inputs.eos_token_ids == [0]


def test_placeholders_count_as_tokens_until_their_ids_arrive_in_order():
    r = make()
    r.add_pending()
    r.add_pending()  # two overlapped steps launched before the first one's id is in
    assert r.num_tokens == 5 and r.kv.token_ids[-2:] == [PENDING_TOKEN, PENDING_TOKEN]
    assert r.output_token_ids == [] and num_generated(r.sampling_inputs) == 2
    assert r.has_pending_token
    r.resolve_pending(7, now=3.0)
    assert r.kv.token_ids == [1, 2, 3, 7, PENDING_TOKEN] and r.output_token_ids == [7]
    assert num_generated(r.sampling_inputs) == 2 and r.has_pending_token and r.first_token_time == 3.0
    r.resolve_pending(8, now=4.0)
    assert r.kv.token_ids == [1, 2, 3, 7, 8] and r.output_token_ids == [7, 8]
    assert num_generated(r.sampling_inputs) == 2 and not r.has_pending_token and r.first_token_time == 3.0


def test_resolving_without_a_placeholder_is_an_error():
    r = make()
    r.append_output(7)
    with pytest.raises(RuntimeError, match="no pending token"):
        r.resolve_pending(8)


def test_logprobs_and_errors_are_kept_for_the_final_delta():
    assert make().output_logprobs is None
    r = make(logprobs=1)
    r.add_logprobs(["first"])
    r.add_logprobs(["second"])
    assert r.output_logprobs == ["first", "second"]
    r.set_error(ErrorKind.PROMPT_TOO_LONG, "too long")
    assert (r.error_kind, r.error) == (ErrorKind.PROMPT_TOO_LONG, "too long")
