"""The stop rule alone, with hand-built inputs (no model, no tokenizer)."""

import pytest

from tokenmill.engine.stop_rule import check_stop, is_stop_token, stop_strings_count
from tokenmill.engine.types import FinishReason, SamplingParams

EOS = frozenset({2})
MAX_LEN = 100


def rule(token, n_out, params, *, n_prompt=10, stop_string=False, eos=EOS, max_len=MAX_LEN):
    """The engine's use of the rule for one new token: (reason, whether the token reaches the detokenizer)."""
    stop_token = is_stop_token(token, n_out, params, eos)
    reason = check_stop(n_out, n_prompt, params, max_len, stop_token=stop_token, stop_string=stop_string)
    return reason, not stop_token


def test_eos_stops_and_adds_no_text():
    assert rule(2, 1, SamplingParams()) == (FinishReason.STOP, False)
    assert rule(5, 1, SamplingParams()) == (None, True)


def test_eos_is_an_ordinary_token_with_ignore_eos():
    assert rule(2, 1, SamplingParams(ignore_eos=True)) == (None, True)
    # ... but a stop token id still stops, also when it is the EOS id.
    assert rule(2, 1, SamplingParams(ignore_eos=True, stop_token_ids=[2])) == (FinishReason.STOP, False)


def test_stop_token_ids_stop_and_add_no_text():
    params = SamplingParams(stop_token_ids=[7, 9])
    assert rule(9, 3, params) == (FinishReason.STOP, False)
    assert rule(8, 3, params) == (None, True)


@pytest.mark.parametrize("token", [2, 7])
def test_min_tokens_guards_eos_and_stop_token_ids(token):
    params = SamplingParams(min_tokens=3, stop_token_ids=[7])
    assert rule(token, 2, params) == (None, True)  # the 2nd token: too early, an ordinary token
    assert rule(token, 3, params) == (FinishReason.STOP, False)  # the 3rd: min_tokens are out


def test_stop_strings_count_only_after_min_tokens():
    params = SamplingParams(min_tokens=3)
    assert [stop_strings_count(n, params) for n in (1, 2, 3, 4)] == [False, False, False, True]
    assert stop_strings_count(1, SamplingParams())


def test_a_stop_string_stops():
    assert rule(5, 4, SamplingParams(), stop_string=True) == (FinishReason.STOP, True)


def test_max_tokens_then_max_model_len():
    params = SamplingParams(max_tokens=4)
    assert rule(5, 3, params) == (None, True)
    assert rule(5, 4, params) == (FinishReason.LENGTH, True)
    # The sequence reaches the engine's max_model_len before max_tokens.
    assert rule(5, 3, SamplingParams(max_tokens=50), n_prompt=96) == (None, True)
    assert rule(5, 4, SamplingParams(max_tokens=50), n_prompt=96) == (FinishReason.LENGTH, True)
    assert rule(5, 4, SamplingParams(max_tokens=50), n_prompt=96, max_len=101) == (None, True)


def test_order_stop_token_then_stop_string_then_length():
    params = SamplingParams(max_tokens=4)
    # At the last allowed token: an EOS or a stop string is a STOP, not a LENGTH.
    assert rule(2, 4, params) == (FinishReason.STOP, False)
    assert rule(5, 4, params, stop_string=True) == (FinishReason.STOP, True)
    assert rule(5, 4, params, n_prompt=MAX_LEN, stop_string=True) == (FinishReason.STOP, True)
    # A stop token at max_model_len is a STOP too.
    assert rule(7, 2, SamplingParams(stop_token_ids=[7]), n_prompt=MAX_LEN) == (FinishReason.STOP, False)


def test_check_stop_reads_only_its_arguments():
    params = SamplingParams(max_tokens=10)
    for stop_token, stop_string, expected in [
        (False, False, None), (True, False, FinishReason.STOP), (False, True, FinishReason.STOP),
        (True, True, FinishReason.STOP),
    ]:
        assert check_stop(1, 1, params, MAX_LEN, stop_token=stop_token, stop_string=stop_string) is expected
