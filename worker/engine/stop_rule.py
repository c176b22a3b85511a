"""The stop rule: after each new token, does the request end, and why. Pure functions, no I/O.

The rules, in this order (the first that holds wins):

1. a stop token: EOS (unless ignore_eos) or one of stop_token_ids, once min_tokens tokens are out
   -> STOP. The token stays in output_token_ids but adds no text: it never reaches the detokenizer.
2. a stop string, found by the detokenizer -> STOP; the text ends just before it. Stop strings
   count only from the token after the first min_tokens on (vLLM's rule): one that completed in
   the text of the first min_tokens tokens never ends the request.
3. max_tokens tokens are out -> LENGTH.
4. prompt + output reached the engine's max_model_len -> LENGTH.

The engine asks `is_stop_token` first (a stop token must not be detokenized), hands any other
token to the detokenizer with `stop_strings_count` as its stop check, and `check_stop` gives the
reason from both answers. Every argument is a plain number, a token id or the request's
SamplingParams, so the rule is tested alone with hand-built inputs.
"""

from __future__ import annotations

from collections.abc import Container

from tokenmill.engine.types import FinishReason, SamplingParams


def is_stop_token(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: Container[int]
) -> bool:
    """Rule 1: the new token (the num_output_tokens-th of the output) is a stop token that counts."""
    return num_output_tokens >= params.min_tokens and (
        (token_id in eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids
    )


def stop_strings_count(num_output_tokens: int, params: SamplingParams) -> bool:
    """Rule 2's guard: may a stop string end the request at its num_output_tokens-th token?"""
    return num_output_tokens > params.min_tokens


def check_stop(
    num_output_tokens: int,
    num_prompt_tokens: int,
    params: SamplingParams,
    max_model_len: int,
    *,
    stop_token: bool,
    stop_string: bool,
) -> FinishReason | None:
    """Why the request ends at this token, or None. `stop_token`: is_stop_token's answer;
    `stop_string`: whether the detokenizer found a stop string in this token's text."""
    if stop_token or stop_string:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens or num_output_tokens + num_prompt_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
