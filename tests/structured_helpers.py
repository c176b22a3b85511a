"""Shared code of the structured-output tests.

- The reference: transformers `generate` (greedy, fp32) with the llguidance mask applied through a
  `LogitsProcessor` that keeps one `LLMatcher` per row. It builds its grammars itself from the
  constraint (compact JSON: no free whitespace), so it does not lean on the engine's compiler.
- What the engine must give for a reference run: the engine ends a constrained request with
  finish_reason "stop" as soon as the grammar is complete, without the EOS that `generate` samples
  next, so that forced EOS is dropped from the reference.
- Validity checks of an output (JSON Schema with `jsonschema`, choice, regex, grammar) and the
  compact-whitespace check.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tokenmill.engine.types import EngineRequest, FinishReason, SamplingParams, StructuredOutputsParams
from tokenmill.tools.structured_workload import whitespace_runs  # noqa: F401 (the tests import it from here)

# -- model, tokenizers -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=4)
def hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@functools.lru_cache(maxsize=4)
def model_shape(model_dir: str) -> tuple[int, list[int]]:
    """(vocabulary size of the LM head, EOS ids) as the engine reads them."""
    from tokenmill.engine.model_config import load_model_config

    mc = load_model_config(Path(model_dir))
    return mc.vocab_size, list(mc.eos_token_ids)


@functools.lru_cache(maxsize=4)
def ll_tokenizer(model_dir: str):
    """The llguidance tokenizer of a checkpoint, as wide as the model's logits."""
    import llguidance.hf

    vocab, eos = model_shape(model_dir)
    return llguidance.hf.from_tokenizer(hf_tokenizer(model_dir), n_vocab=vocab, eos_token=eos)


def kv_gb_for_blocks(model_dir, num_blocks: int, block_size: int = 16) -> float:
    """A KV cache size in GiB that gives the engine exactly `num_blocks` blocks (fp32)."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.model_runner import ModelRunner

    mc = load_model_config(Path(model_dir), "float32")
    per_block = ModelRunner.kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, block_size)
    return num_blocks * per_block / 1024**3


# -- the reference grammar ---------------------------------------------------------------------------


def reference_grammar(constraint: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint, built here from the constraint alone."""
    from llguidance import LLMatcher

    flexible = {"whitespace_flexible": constraint.whitespace == "flexible"}
    kind = constraint.kind
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(constraint.json, overrides=flexible)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=flexible)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "choice":
        # A Lark string literal takes JSON string syntax.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choice))
    return LLMatcher.grammar_from_lark(constraint.grammar)


def new_matcher(model_dir, constraint: StructuredOutputsParams):
    from llguidance import LLMatcher

    matcher = LLMatcher(ll_tokenizer(str(model_dir)), reference_grammar(constraint), log_level=0)
    if matcher.is_error():
        raise ValueError(f"the reference grammar does not compile: {matcher.get_error()}")
    return matcher


def allowed_ids(matcher, width: int) -> torch.Tensor:
    """Boolean row of `width` ids: True where the matcher allows the token next. Ids past the
    matcher's bitmask (a padded vocabulary) are never allowed."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
    row = torch.zeros(width, dtype=torch.bool)
    n = min(width, bits.numel())
    row[:n] = bits[:n]
    return row


class GrammarMask(LogitsProcessor):
    """A transformers logits processor: one llguidance matcher per row, fed the token the previous
    step chose, the logits of every token it does not allow set to -inf.

    A row whose matcher is stopped (the grammar is complete) is left only the EOS ids, which
    `generate` then samples and stops on.
    """

    def __init__(self, model_dir, constraint: StructuredOutputsParams) -> None:
        self.model_dir = str(model_dir)
        self.constraint = constraint
        self.matchers: list | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.matchers is None:
            self.matchers = [new_matcher(self.model_dir, self.constraint) for _ in range(input_ids.shape[0])]
        else:
            for row, matcher in enumerate(self.matchers):
                if not matcher.is_stopped():
                    token = int(input_ids[row, -1])
                    if not matcher.consume_token(token):
                        raise AssertionError(f"the matcher refused token {token}: {matcher.get_error()}")
        keep = torch.stack([allowed_ids(m, scores.shape[1]) for m in self.matchers])
        return scores.masked_fill(~keep.to(scores.device), float("-inf"))


@dataclass
class Expected:
    """What the engine must give for one constrained greedy request."""

    token_ids: list[int]
    finish_reason: FinishReason


def hf_constrained_greedy(model_dir, prompts: Sequence[Sequence[int]],
                          constraints: Sequence[StructuredOutputsParams | None],
                          max_new: Sequence[int]) -> list[Expected]:
    """transformers `generate` (greedy, fp32), one prompt at a time, under the reference mask
    (a None constraint: plain `generate`, stopping at EOS)."""
    model = hf_model(str(model_dir))
    _, eos = model_shape(str(model_dir))
    out = []
    with torch.inference_mode():
        for prompt, constraint, n in zip(prompts, constraints, max_new, strict=True):
            masks = [] if constraint is None else [GrammarMask(model_dir, constraint)]
            seq = model.generate(
                torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                logits_processor=LogitsProcessorList(masks),
            )
            out.append(expected_from(model_dir, constraint, seq[0, len(prompt):].tolist(), eos))
    return out


def expected_from(model_dir, constraint: StructuredOutputsParams | None, generated: list[int],
                  eos: list[int]) -> Expected:
    """The engine's answer for a reference run: tokens up to the first EOS; the EOS itself dropped
    when the grammar was already complete before it (the engine stops there and emits none)."""
    cut = next((i for i, t in enumerate(generated) if t in eos), None)
    body = generated if cut is None else generated[:cut]
    if constraint is None:
        return Expected(generated[: len(body) + 1], FinishReason.STOP) if cut is not None else Expected(
            body, FinishReason.LENGTH)
    matcher = new_matcher(model_dir, constraint)
    assert matcher.consume_tokens(body), matcher.get_error()
    if matcher.is_stopped():
        return Expected(body, FinishReason.STOP)
    if cut is not None:  # the model chose EOS where the grammar may end: an ordinary EOS stop
        return Expected(body + [generated[cut]], FinishReason.STOP)
    return Expected(body, FinishReason.LENGTH)


# -- engine requests ---------------------------------------------------------------------------------


def constrained_requests(prompts: Sequence[Sequence[int]], constraints: Sequence[StructuredOutputsParams | None],
                         max_new: Sequence[int], prefix: str = "r", **sampling) -> list[EngineRequest]:
    sampling.setdefault("temperature", 0.0)
    return [
        EngineRequest(
            request_id=f"{prefix}{i}", prompt_token_ids=list(p),
            sampling=SamplingParams(max_tokens=n, structured_outputs=c, **sampling),
        )
        for i, (p, c, n) in enumerate(zip(prompts, constraints, max_new, strict=True))
    ]


def chat_prompt_ids(model_dir, user: str, system: str | None = None) -> list[int]:
    """A chat prompt rendered by the checkpoint's template, as token ids."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    ids = hf_tokenizer(str(model_dir)).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


# -- validity of an output ---------------------------------------------------------------------------


def output_problem(constraint: StructuredOutputsParams, text: str, model_dir=None,
                   token_ids: Sequence[int] | None = None) -> str | None:
    """Why a finished ("stop") output breaks its constraint, or None when it keeps it.

    JSON is parsed and validated with `jsonschema`, and must hold no whitespace outside strings
    when compact; a choice must be one of the strings; a regex must match the whole text. A
    grammar (and, given the tokens, every kind) is also replayed on a fresh reference matcher,
    which must accept the tokens and end in an accepting state.
    """
    kind = constraint.kind
    if kind in ("json", "json_object"):
        import jsonschema

        try:
            value = json.loads(text)
        except ValueError as e:
            return f"not JSON ({e}): {text!r}"
        schema = {"type": "object"} if kind == "json_object" else constraint.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            return f"does not validate ({e.message}): {text!r}"
        if constraint.whitespace == "compact" and whitespace_runs(text):
            return f"whitespace outside strings in compact mode: {text!r}"
    elif kind == "choice":
        if text not in constraint.choice:
            return f"{text!r} is not one of {constraint.choice}"
    elif kind == "regex":
        if re.fullmatch(constraint.regex, text) is None:
            return f"{text!r} does not match {constraint.regex!r}"
    if token_ids is not None and model_dir is not None:
        eos = set(model_shape(str(model_dir))[1])
        body = [t for t in token_ids if t not in eos]
        matcher = new_matcher(model_dir, constraint)
        if not matcher.consume_tokens(body):
            return f"the grammar refuses the tokens: {matcher.get_error()}"
        if not matcher.is_accepting():
            return f"the grammar is not complete after the tokens: {text!r}"
    elif kind == "grammar":
        return "a grammar output is checked by its tokens: pass model_dir and token_ids"
    return None
