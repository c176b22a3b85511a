"""An EngineRequest as vLLM takes it: the prompt, the SamplingParams, the priority, or the refusal.

The mapping, field by field (docs/vllm.md has it as a table):

- the prompt: encoded by the adapter with the model folder's tokenizer, exactly as tokenmill's own
  engine encodes it (prompt, chat template for messages, token ids checked), and handed over as
  ``prompt_token_ids``; ``tenant`` becomes vLLM's ``cache_salt`` (no prefix-cache hits across
  tenants);
- sampling: temperature, top_p, top_k, min_p, the three penalties, seed, stop, stop_token_ids,
  ignore_eos, min_tokens, max_tokens, logprobs, prompt_logprobs and n have vLLM's own names and
  meanings (tokenmill took them from there); ``max_tokens: 0`` (score only) asks vLLM for one token,
  which the adapter drops; ``score_from`` cuts the scored positions from vLLM's whole-prompt
  logprobs (vLLM computes such a prompt without its prefix cache, so the result is the same and
  only the cost differs);
- structured_outputs: vLLM's StructuredOutputsParams of the same kind; the whitespace mode is
  engine-wide in vLLM, so a request may ask only for the engine's own (compact unless
  ``--vllm-arg structured_outputs_config=...`` says otherwise);
- priority: vLLM's priority scheduling (lower first), the adapter's default policy;
- deadline_ms and arrival_time stay with the adapter (it expires requests not started in time).

What vLLM cannot honour is refused here, each with the field and the backend named, so the job ends
with ``invalid_job`` saying why, never with the field quietly dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.engine.types import EngineRequest, SamplingParams

BACKEND_NAME = "the vllm backend"
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more


@dataclass(frozen=True)
class Capabilities:
    """What the running vLLM engine serves, read once at start."""

    whitespace: str  # the engine-wide JSON whitespace of structured outputs: compact or flexible
    priority_scheduling: bool  # scheduling_policy == "priority"
    max_logprobs: int  # vLLM's max_logprobs (top-N per token and per prompt position)


def refusals(request: EngineRequest, caps: Capabilities) -> list[str]:
    """Every field of `request` the vllm backend cannot honour, as one message each (empty: serve it)."""
    s = request.sampling
    found = []
    if s.temperature > MAX_TEMPERATURE:
        found.append(f"sampling.temperature {s.temperature:g}: {BACKEND_NAME} allows at most {MAX_TEMPERATURE:g}")
    if s.n > 1 and s.temperature == 0:
        found.append(f"sampling.n {s.n} with temperature 0: {BACKEND_NAME} samples n > 1 only with temperature > 0 "
                     "(greedy choices would all be the same)")
    if s.n > 1 and s.max_tokens == 0:
        found.append("sampling.n > 1 needs max_tokens >= 1: a score-only request (max_tokens 0) has one answer")
    if s.seed == -1:
        found.append(f"sampling.seed -1: {BACKEND_NAME} reads seed -1 as no seed; choose another seed")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(s, name)
        if value is not None and value > caps.max_logprobs:
            found.append(f"sampling.{name} {value}: {BACKEND_NAME} was started with max_logprobs {caps.max_logprobs}")
    so = s.structured_outputs
    if so is not None and so.kind in ("json", "json_object") and so.whitespace != caps.whitespace:
        found.append(
            f"sampling.structured_outputs.whitespace {so.whitespace}: {BACKEND_NAME} sets JSON whitespace for the "
            f"whole engine, and this one writes {caps.whitespace} JSON"
        )
    if request.priority != 0 and not caps.priority_scheduling:
        found.append(f"priority {request.priority}: {BACKEND_NAME} was started without priority scheduling "
                     "(scheduling_policy is not priority)")
    return found


def vllm_prompt(ids: list[int], tenant: str | None) -> dict[str, Any]:
    """The prompt vLLM takes: our token ids, and the tenant as the prefix cache's salt."""
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if tenant is not None:
        prompt["cache_salt"] = tenant
    return prompt


def vllm_sampling(s: SamplingParams, *, every_token: bool):
    """vLLM's SamplingParams for ours. every_token: outputs after every step (DELTA), else only the
    final one (FINAL_ONLY)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        max_tokens=max(1, s.max_tokens),  # score only: one token, dropped (outputs.py)
        min_tokens=s.min_tokens,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        structured_outputs=_structured(s),
        output_kind=RequestOutputKind.DELTA if every_token else RequestOutputKind.FINAL_ONLY,
    )


def _structured(s: SamplingParams):
    so = s.structured_outputs
    if so is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    kind = so.kind
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(**{kind: getattr(so, kind)})
