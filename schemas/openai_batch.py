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
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from pydantic import ValidationError

from schemas.constants import (
    ERROR_CRASHED_WORKER,
    ERROR_INTERNAL,
    ERROR_RESULT_TOO_LARGE,
    STATUS_ERROR,
    STATUS_EXPIRED,
    STATUS_OK,
)
from schemas.decode import load_json, readable_id
from schemas.errors import JobDecodeError, format_validation_error
from schemas.job import Job
from schemas.records import Result, TokenLogprob

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
# OpenAI-compatible server too (as is response_format on /v1/completions).
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
}

# response_format: the keys each type takes, and those of its json_schema object.
RESPONSE_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")

# Fields that are fine only at their default value (the value OpenAI uses when it is absent),
# with the endpoints that have them.
_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], frozenset[str]]] = {
    "n": ((1,), BOTH),
    "stream": ((False,), BOTH),
    "logit_bias": (({},), BOTH),
    "echo": ((False,), COMPLETIONS),
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
    if name == "n" and type(value) is int and value > 1:
        return (
            "n > 1 is not supported; send one line per sample (with different seeds to get different samples)"
        )
    if name == "best_of" and type(value) is int and value > 1:
        return "best_of > 1 is not supported; send one line per candidate"
    if name == "stream":
        return "streaming is not part of a batch request (use the Job field stream for token events)"
    if name in ("tools", "functions"):
        return "tool and function calling are not supported"
    if name == "logit_bias":
        return "logit_bias is not supported"
    if name == "echo":
        return "echo is not supported"
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
        if chat and name in ("logprobs", "top_logprobs"):
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
    elif "prompt" not in body:
        problems.append("body.prompt: required")

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


def _completion_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    offsets, at = [], 0
    for t in logprobs:
        offsets.append(at)
        at += len(t.token)
    return {
        "tokens": [t.token for t in logprobs],
        "token_logprobs": [_lp(t.logprob) for t in logprobs],
        # A dict per position, as OpenAI writes it (tokens with the same text collapse).
        "top_logprobs": [{a.token: _lp(a.logprob) for a in t.top_logprobs} for t in logprobs],
        "text_offset": offsets,
    }


def _ok_body(result: Result, url: str, created: int) -> dict[str, Any]:
    digest = _digest(result)
    if url == CHAT_COMPLETIONS_URL:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text, "refusal": None},
            "logprobs": _chat_logprobs(result.logprobs) if result.logprobs is not None else None,
            "finish_reason": result.finish_reason,
        }
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {
            "text": result.text,
            "index": 0,
            "logprobs": _completion_logprobs(result.logprobs) if result.logprobs is not None else None,
            "finish_reason": result.finish_reason,
        }
        obj, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + digest,
        "object": obj,
        "created": created,
        "model": result.model,
        "choices": [choice],
        "usage": _usage(result),
        "system_fingerprint": None,
    }


def openai_batch_output_line(
    result: Result, url: str | None, *, created: int | None = None
) -> dict[str, Any]:
    """A Result -> one OpenAI Batch output line (a dict; write it as one JSON line).

    ``url`` is the input line's url; it picks the body shape of successful results (a Result of
    a plain Job line may use ``CHAT_COMPLETIONS_URL`` for messages, ``COMPLETIONS_URL`` otherwise)
    and may be None for failed ones. ``created`` defaults to now (unix seconds).

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
            "body": _ok_body(result, url, when),
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
