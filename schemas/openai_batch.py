"""OpenAI Batch API lines in and out.

Input: ``{"custom_id", "method": "POST", "url", "body"}`` with url ``/v1/chat/completions``
(body.messages) or ``/v1/completions`` (body.prompt) -> Job, with custom_id as job_id.
Output: ``openai_batch_output_line(result, url)`` -> the OpenAI Batch output line
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` with a
``chat.completion`` or ``text_completion`` body, so OpenAI Batch tooling reads it unchanged.

Body fields are mapped, accepted as no-ops when they hold their default, ignored when they cannot
change the output (``IGNORED_BODY_FIELDS``), or rejected with a message naming them: a request
must never run differently from what it asked for without saying so.

``response_format`` becomes ``sampling.structured_outputs``: ``json_schema`` -> ``{"json": schema}``,
``json_object`` -> ``{"json_object": true}``, ``text`` -> no constraint. ``strict`` is accepted and
changes nothing: the schema is always enforced on every token (there is no best-effort mode to turn
off), as written (OpenAI's strict-mode rewrites and restrictions are not applied). vLLM's
``structured_outputs`` body field is accepted too, as the Job field.

Scoring: ``/v1/completions`` with ``echo: true`` + ``logprobs: K`` sets ``sampling.prompt_logprobs``
= K as well (``max_tokens: 0`` is then allowed: score only), the line lm-evaluation-harness's
``local-completions`` model sends for a loglikelihood; its output is the prompt echoed with
OpenAI's ``{tokens, token_logprobs, top_logprobs, text_offset}`` over prompt and completion. ``n``
maps to ``sampling.n``, and a Result's ``choices`` become the body's choices.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from tokenmill.schemas.constants import (
    ERROR_CRASHED_WORKER,
    ERROR_INTERNAL,
    ERROR_RESULT_TOO_LARGE,
    STATUS_ERROR,
    STATUS_EXPIRED,
    STATUS_OK,
)
from tokenmill.schemas.errors import JobDecodeError, format_validation_error
from tokenmill.schemas.job import Job
from tokenmill.schemas.json_text import load_json, readable_id
from tokenmill.schemas.records import Choice, PromptLogprob, Result, TokenLogprob

CHAT_COMPLETIONS_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
OPENAI_BATCH_URLS = (CHAT_COMPLETIONS_URL, COMPLETIONS_URL)

LINE_FIELDS = ("custom_id", "method", "url", "body")

# Error codes that are the worker's failure, not the request's: HTTP 500 / server_error.
SERVER_ERROR_CODES = frozenset({ERROR_INTERNAL, ERROR_CRASHED_WORKER, ERROR_RESULT_TOO_LARGE})

# Fields that cannot change what is generated: accepted and ignored.
IGNORED_BODY_FIELDS = frozenset({"user", "store", "metadata", "service_tier"})

CHAT, COMPLETIONS = frozenset({CHAT_COMPLETIONS_URL}), frozenset({COMPLETIONS_URL})
BOTH = CHAT | COMPLETIONS

# Body field -> (the Job path it fills, the endpoints that have it). Every rename between an
# OpenAI body and a Job is in this one table; the few whose value also changes shape are handled
# in _reshape (a stop string becomes a list, token-id prompts go to prompt_token_ids, chat
# logprobs/top_logprobs combine into one count, response_format becomes a constraint). top_k ..
# structured_outputs are vLLM's extensions of the OpenAI request, accepted by vLLM's
# OpenAI-compatible server too (as is response_format on /v1/completions). score_from is
# tokenmill's own (with echo: the first prompt position scored; the head before it is echoed
# with null logprobs, so a client that knows its context length lets the context come from the
# prefix cache).
BODY_TO_JOB: dict[str, tuple[str, frozenset[str]]] = {
    "model": ("model", BOTH),
    "messages": ("messages", CHAT),
    "prompt": ("prompt", COMPLETIONS),
    "max_tokens": ("sampling.max_tokens", BOTH),
    "max_completion_tokens": ("sampling.max_tokens", CHAT),
    "temperature": ("sampling.temperature", BOTH),
    "top_p": ("sampling.top_p", BOTH),
    "presence_penalty": ("sampling.presence_penalty", BOTH),
    "frequency_penalty": ("sampling.frequency_penalty", BOTH),
    "seed": ("sampling.seed", BOTH),
    "stop": ("sampling.stop", BOTH),
    "logprobs": ("sampling.logprobs", BOTH),
    "top_logprobs": ("sampling.logprobs", CHAT),
    "top_k": ("sampling.top_k", BOTH),
    "min_p": ("sampling.min_p", BOTH),
    "repetition_penalty": ("sampling.repetition_penalty", BOTH),
    "min_tokens": ("sampling.min_tokens", BOTH),
    "stop_token_ids": ("sampling.stop_token_ids", BOTH),
    "ignore_eos": ("sampling.ignore_eos", BOTH),
    "structured_outputs": ("sampling.structured_outputs", BOTH),
    "response_format": ("sampling.structured_outputs", BOTH),
    "n": ("sampling.n", BOTH),
    "echo": ("sampling.prompt_logprobs", COMPLETIONS),
    "score_from": ("sampling.score_from", COMPLETIONS),
}

# response_format: the keys each type takes, and those of its json_schema object.
RESPONSE_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")

# Fields that are fine only at their default value (the value OpenAI uses when it is absent),
# with the endpoints that have them.
_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], frozenset[str]]] = {
    "stream": ((False,), BOTH),
    "logit_bias": (({},), BOTH),
    "best_of": ((1,), COMPLETIONS),
    "suffix": (("",), COMPLETIONS),
    "tools": (([],), CHAT),
    "functions": (([],), CHAT),
}


def _endpoints(name: str) -> frozenset[str] | None:
    if name in BODY_TO_JOB:
        return BODY_TO_JOB[name][1]
    if name in _DEFAULT_ONLY:
        return _DEFAULT_ONLY[name][1]
    return None


def _is_default(name: str, value: Any) -> bool:
    # Compared with types, so that true does not pass for 1.
    return any(type(value) is type(d) and value == d for d in _DEFAULT_ONLY[name][0])


def _not_default_reason(name: str, value: Any) -> str:
    if name == "best_of" and type(value) is int and value > 1:
        return "best_of > 1 is not supported; send one line per candidate"
    if name == "stream":
        return "streaming is not part of a batch request (use the Job field stream for token events)"
    if name in ("tools", "functions"):
        return "tool and function calling are not supported"
    if name == "logit_bias":
        return "logit_bias is not supported"
    if name == "suffix":
        return "suffix (insertion) is not supported"
    return f"must be {_DEFAULT_ONLY[name][0][0]!r}"


def _chat_message(msg: Any, index: int, problems: list[str]) -> Any:
    """OpenAI message forms -> Job message form. Other shapes pass through for the Job model
    to report (with their path)."""
    if not isinstance(msg, dict):
        return msg
    out = dict(msg)
    if out.get("role") == "developer":  # OpenAI's newer name for the system role
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                if set(part) - {"type", "text"}:
                    extra = sorted(set(part) - {"type", "text"})
                    problems.append(f"body.messages[{index}].content[{j}]: unknown fields {extra}")
                texts.append(part["text"])
            else:
                problems.append(f"body.messages[{index}].content[{j}]: only text parts are supported")
        # Text parts are joined with newlines (vLLM does the same).
        out["content"] = "\n".join(texts)
    return out


def _completion_prompt(prompt: Any, problems: list[str]) -> tuple[str, Any]:
    """body.prompt -> ("prompt", str) or ("prompt_token_ids", list). One prompt per line."""
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt):
            return "prompt_token_ids", prompt
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return _completion_prompt(prompt[0], problems)
        if all(isinstance(p, (str, list)) for p in prompt):
            problems.append(
                f"body.prompt: holds {len(prompt)} prompts; a batch line carries one (send one line per prompt)"
            )
            return "prompt", None
    if isinstance(prompt, list):  # empty list, or ints mixed with other things
        return "prompt_token_ids", prompt
    return "prompt", prompt


def _response_format(value: Any, problems: list[str]) -> dict[str, Any] | None:
    """body.response_format -> the structured_outputs it asks for (None: plain text, or a problem
    noted)."""
    where = "body.response_format"
    if not isinstance(value, dict):
        problems.append(f"{where}: must be an object")
        return None
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in RESPONSE_FORMAT_KEYS:
        got = "none" if kind is None else repr(kind)
        problems.append(f"{where}.type: must be one of {', '.join(RESPONSE_FORMAT_KEYS)} (got {got})")
        return None
    for extra in sorted(set(value) - RESPONSE_FORMAT_KEYS[kind]):
        problems.append(f"{where}.{extra}: not a field of type {kind}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        problems.append(f"{where}.json_schema: {'required' if spec is None else 'must be an object'}")
        return None
    where += ".json_schema"
    for extra in sorted(set(spec) - set(JSON_SCHEMA_KEYS)):
        problems.append(f"{where}.{extra}: unknown field")
    name, description, strict = spec.get("name"), spec.get("description"), spec.get("strict")
    if not isinstance(name, str) or not name:
        problems.append(f"{where}.name: {'required' if name is None else 'must be a non-empty string'}")
    if description is not None and not isinstance(description, str):
        problems.append(f"{where}.description: must be a string")
    if strict is not None and type(strict) is not bool:
        problems.append(f"{where}.strict: must be true or false")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        problems.append(f"{where}.schema: {'required' if schema is None else 'must be a JSON Schema object'}")
        return None
    return {"json": schema}


def _reshape(name: str, value: Any, problems: list[str]) -> tuple[str, Any]:
    """A body value -> (Job path, value in the Job's shape), after BODY_TO_JOB."""
    path = BODY_TO_JOB[name][0]
    if name == "response_format":
        return path, _response_format(value, problems)
    if name == "stop" and isinstance(value, str):
        return path, [value]
    if name == "messages" and isinstance(value, list):
        return path, [_chat_message(m, i, problems) for i, m in enumerate(value)]
    if name == "prompt":
        return _completion_prompt(value, problems)
    return path, value  # completions logprobs: the top-N count as it is (0 = only the chosen token)


def _put(job: dict[str, Any], sampling: dict[str, Any], path: str, value: Any) -> None:
    if path.startswith("sampling."):
        sampling[path.removeprefix("sampling.")] = value
    else:
        job[path] = value


def job_from_openai_batch_line(line: dict[str, Any] | bytes | bytearray | str) -> Job:
    """One OpenAI Batch input line -> Job. Raises only JobDecodeError (invalid_job), with
    job_id = custom_id when it can be read."""
    obj = line if isinstance(line, dict) else load_json(line)
    if not isinstance(obj, dict):
        raise JobDecodeError.invalid("an OpenAI batch line must be a JSON object")
    job_id = readable_id(obj.get("custom_id"))
    problems: list[str] = []
    for name in LINE_FIELDS:
        if name not in obj:
            problems.append(f"{name}: required")
    for name in sorted(set(obj) - set(LINE_FIELDS)):
        problems.append(f"{name}: unknown field")
    if "method" in obj and obj["method"] != "POST":
        problems.append("method: must be 'POST'")
    url = obj.get("url")
    if "url" in obj and url not in OPENAI_BATCH_URLS:
        problems.append(f"url: must be one of {', '.join(OPENAI_BATCH_URLS)} (got {url!r})")
    body = obj.get("body")
    if "body" in obj and not isinstance(body, dict):
        problems.append("body: must be an object")
    if problems or not isinstance(body, dict):
        raise JobDecodeError.invalid("; ".join(problems), job_id)

    chat = url == CHAT_COMPLETIONS_URL
    job: dict[str, Any] = {"job_id": obj["custom_id"]}
    sampling: dict[str, Any] = {}
    # Job path -> path the producer wrote, so validation messages name the OpenAI fields.
    rename = {"job_id": "custom_id", "model": "body.model"}

    for name, value in body.items():
        if name in IGNORED_BODY_FIELDS:
            continue
        endpoints = _endpoints(name)
        if endpoints is None:
            problems.append(f"body.{name}: not supported")
            continue
        if url not in endpoints:
            problems.append(f"body.{name}: not a field of {url}")
            continue
        if name in _DEFAULT_ONLY:
            if value is not None and not _is_default(name, value):
                problems.append(f"body.{name}: {_not_default_reason(name, value)}")
            continue
        if value is None:
            if name in ("messages", "prompt"):
                problems.append(f"body.{name}: must not be null")
            continue  # OpenAI reads null as "use the default"
        if (chat and name in ("logprobs", "top_logprobs")) or name == "echo":
            continue  # combined below
        path, value = _reshape(name, value, problems)
        if name == "response_format" and value is None:
            continue  # plain text (or a problem already noted)
        if path == "sampling.structured_outputs" and path in rename:
            problems.append(f"{rename[path]}, body.{name}: both given; give one of them")
            continue
        _put(job, sampling, path, value)
        rename[path] = f"body.{name}"
        if name == "response_format":
            rename[f"{path}.json"] = "body.response_format.json_schema.schema"

    if chat:
        if "messages" not in body:
            problems.append("body.messages: required")
        if "max_tokens" in body and "max_completion_tokens" in body:
            a, b = body["max_tokens"], body["max_completion_tokens"]
            if a is not None and b is not None and a != b:
                problems.append(
                    "body.max_tokens, body.max_completion_tokens: both given with different values"
                )
            elif a is not None:
                sampling["max_tokens"] = a
                rename["sampling.max_tokens"] = "body.max_tokens"
        want, top = body.get("logprobs"), body.get("top_logprobs")
        if want is not None and type(want) is not bool:
            problems.append("body.logprobs: must be true or false")
        elif want:
            sampling["logprobs"] = 0 if top is None else top
            rename["sampling.logprobs"] = "body.top_logprobs"
        elif top is not None:
            problems.append("body.top_logprobs: needs logprobs: true")
    else:
        if "prompt" not in body:
            problems.append("body.prompt: required")
        echo, top = body.get("echo"), body.get("logprobs")
        if echo is not None and type(echo) is not bool:
            problems.append("body.echo: must be true or false")
        elif echo and top is None:
            problems.append(
                "body.echo: supported with logprobs only (echo + logprobs: K scores the prompt; "
                "the prompt's text alone is not echoed)"
            )
        elif echo:
            # echo + logprobs: K = the prompt's logprobs with the top K (positions 1 on), and the
            # completion's; max_tokens 0 scores the prompt only (the shape lm-eval sends).
            sampling["prompt_logprobs"] = top
            rename["sampling.prompt_logprobs"] = "body.logprobs"

    if problems:
        raise JobDecodeError.invalid("; ".join(problems), job_id)
    if sampling:
        job["sampling"] = sampling
    try:
        return Job.model_validate(job)
    except ValidationError as exc:
        raise JobDecodeError.invalid(format_validation_error(exc, rename), job_id) from None
    except RecursionError:
        raise JobDecodeError.invalid("nested too deeply", job_id) from None


# ---------------------------------------------------------------------------------------------
# Output


def _digest(result: Result) -> str:
    return hashlib.sha256(f"{result.job_id}\0{result.attempt}".encode()).hexdigest()[:24]


def _usage(result: Result) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


# OpenAI writes -9999.0 for a probability too small to represent; its readers expect a number
# where a Result has null (-infinity).
_MIN_LOGPROB = -9999.0


def _lp(logprob: float | None) -> float:
    return _MIN_LOGPROB if logprob is None else logprob


def _chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float | None) -> dict[str, Any]:
        return {
            "token": token,
            "logprob": _lp(logprob),
            "bytes": list(token.encode("utf-8", errors="replace")),
        }

    content = []
    for t in logprobs:
        item = entry(t.token, t.logprob)
        item["top_logprobs"] = [entry(a.token, a.logprob) for a in t.top_logprobs]
        content.append(item)
    return {"content": content, "refusal": None}


# One position of a completions logprobs object: (token text, logprob, top alternatives); logprob
# and top are None only for the echoed prompt positions that have no logprob (the first).
_Position = tuple[str, float | None, dict[str, float] | None]


def _top(alternatives: Sequence[Any]) -> dict[str, float]:
    # A dict per position, as OpenAI writes it (tokens with the same text collapse).
    return {a.token: _lp(a.logprob) for a in alternatives}


def _completion_logprobs(positions: list[_Position]) -> dict[str, Any]:
    offsets, at = [], 0
    for token, _, _ in positions:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": [token for token, _, _ in positions],
        "token_logprobs": [None if lp is None and top is None else _lp(lp) for _, lp, top in positions],
        "top_logprobs": [top for _, _, top in positions],
        "text_offset": offsets,
    }


def _generated_positions(logprobs: list[TokenLogprob]) -> list[_Position]:
    return [(t.token, t.logprob, _top(t.top_logprobs)) for t in logprobs]


def _echoed_positions(head: Sequence[str], prompt: list[PromptLogprob]) -> list[_Position]:
    """The prompt's positions as OpenAI's echo writes them: the unscored head (its first token has
    no logprob) with nulls, then one per scored position."""
    return [(token, None, None) for token in head] + [
        (p.token, p.logprob, _top(p.top_logprobs)) for p in prompt
    ]


def _samples(result: Result) -> list[Choice]:
    """The Result's samples: its choices for n > 1, else the one sample its own fields hold."""
    if result.choices is not None:
        return result.choices
    assert result.finish_reason is not None  # status ok
    return [
        Choice(
            index=0,
            text=result.text,
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            logprobs=result.logprobs,
            completion_tokens=result.usage.completion_tokens,
        )
    ]


def _echo_prefix(result: Result, echo_head: Sequence[str]) -> tuple[str, list[_Position]]:
    if result.prompt_logprobs is None:
        raise ValueError("echo needs a Result with prompt_logprobs (the job must set sampling.prompt_logprobs)")
    if len(echo_head) + len(result.prompt_logprobs) != result.usage.prompt_tokens:
        raise ValueError(
            f"echo_head ({len(echo_head)} tokens) and prompt_logprobs ({len(result.prompt_logprobs)}) "
            f"must cover the prompt's {result.usage.prompt_tokens} tokens"
        )
    positions = _echoed_positions(echo_head, result.prompt_logprobs)
    return "".join(token for token, _, _ in positions), positions


def _ok_body(result: Result, url: str, created: int, echo_head: Sequence[str] | None) -> dict[str, Any]:
    digest = _digest(result)
    choices: list[dict[str, Any]] = []
    if url == CHAT_COMPLETIONS_URL:
        if echo_head is not None:
            raise ValueError("echo is a /v1/completions field")
        if result.prompt_logprobs is not None:
            raise ValueError(CHAT_PROMPT_LOGPROBS_REFUSAL)
        for c in _samples(result):
            choices.append({
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": _chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            })
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        if result.prompt_logprobs is not None and echo_head is None:
            # OpenAI's only shape for prompt logprobs is echo: without the head they would be lost.
            raise ValueError("a Result with prompt_logprobs is written echoed: pass echo_head")
        echoed, head = ("", []) if echo_head is None else _echo_prefix(result, echo_head)
        for c in _samples(result):
            logprobs = None
            if echo_head is not None and c.logprobs is None and c.token_ids:
                raise ValueError("echo with generated tokens needs their logprobs (sampling.logprobs)")
            if c.logprobs is not None or echo_head is not None:
                logprobs = _completion_logprobs(head + _generated_positions(c.logprobs or []))
            choices.append({
                "text": echoed + c.text,
                "index": c.index,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            })
        obj, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + digest,
        "object": obj,
        "created": created,
        "model": result.model,
        "choices": choices,
        "usage": _usage(result),
        "system_fingerprint": None,
    }


CHAT_PROMPT_LOGPROBS_REFUSAL = (
    "sampling.prompt_logprobs has no place in a chat.completion body (OpenAI writes prompt logprobs only "
    "as /v1/completions echo); use the tokenmill output format, or a /v1/completions line"
)


def openai_output_refusal(job: Job, url: str) -> str | None:
    """Why the Result of ``job`` could not be written as an OpenAI body for ``url`` (None: it can):
    for a runner to refuse the job up front instead of losing what it asked for."""
    if url == CHAT_COMPLETIONS_URL and job.sampling.prompt_logprobs is not None:
        return CHAT_PROMPT_LOGPROBS_REFUSAL
    return None


def openai_batch_output_line(
    result: Result,
    url: str | None,
    *,
    created: int | None = None,
    echo_head: Sequence[str] | None = None,
) -> dict[str, Any]:
    """A Result -> one OpenAI Batch output line (a dict; write it as one JSON line).

    ``url`` is the input line's url; it picks the body shape of successful results (a Result of
    a plain Job line may use ``CHAT_COMPLETIONS_URL`` for messages, ``COMPLETIONS_URL`` otherwise)
    and may be None for failed ones. ``created`` defaults to now (unix seconds).

    ``echo_head`` (``/v1/completions`` only; required for a Result with ``prompt_logprobs``, which
    OpenAI can only write echoed; a chat body cannot carry them at all, see
    ``openai_output_refusal``): the token texts of the
    prompt positions before ``sampling.score_from`` (the first token, for the mapping of ``echo``),
    which have no logprob. The body's text is then the prompt's (its token texts joined) followed by
    the completion, and its ``logprobs`` cover the prompt (null for the head, as OpenAI writes the
    first token) and then the generated tokens: index i of ``token_logprobs`` is prompt position i,
    which is how lm-eval's ``local-completions`` reads a loglikelihood. A Result with ``choices``
    (n > 1) gives one body choice per sample, each echoed alike.

    status ok -> HTTP 200 with the completion body; status error -> HTTP 400 (500 for the
    worker's own failures, SERVER_ERROR_CODES) with an OpenAI error body; status expired -> no response and the error
    ``batch_expired``, as OpenAI reports requests its batch window did not reach.
    """
    digest = _digest(result)
    line: dict[str, Any] = {"id": f"batch_req_{digest}", "custom_id": result.job_id}
    if result.status == STATUS_OK:
        if url not in OPENAI_BATCH_URLS:
            raise ValueError(f"url must be one of {', '.join(OPENAI_BATCH_URLS)}, got {url!r}")
        when = int(time.time()) if created is None else created
        line["response"] = {
            "status_code": 200,
            "request_id": f"req_{digest}",
            "body": _ok_body(result, url, when, echo_head),
        }
        line["error"] = None
    elif result.status == STATUS_ERROR:
        assert result.error is not None  # guaranteed by Result's validation
        internal = result.error.code in SERVER_ERROR_CODES
        line["response"] = {
            "status_code": 500 if internal else 400,
            "request_id": f"req_{digest}",
            "body": {
                "error": {
                    "message": result.error.message,
                    "type": "server_error" if internal else "invalid_request_error",
                    "param": None,
                    "code": result.error.code,
                }
            },
        }
        line["error"] = None
    elif result.status == STATUS_EXPIRED:
        line["response"] = None
        line["error"] = {
            "code": "batch_expired",
            "message": "This request could not be executed before its deadline expired.",
        }
    else:  # pragma: no cover - Result only admits the three statuses
        raise ValueError(f"unknown status {result.status!r}")
    return line
