"""The llguidance backend: grammars compiled by llguidance, masks filled by its thread pool.

llguidance compiles JSON Schema (its widest-coverage part), regexes, Lark and GBNF grammars into
a lazy lexer + Earley parser over the tokenizer's token trie; it says what it cannot do in an
error rather than loosening the constraint, which is what we need at millions of rows. A compile
is one LLMatcher built at the grammar's start; each request gets a deep copy of it (microseconds).

Whitespace of JSON kinds: "compact" allows none between JSON tokens (separators are exactly
"," and ":"), so a model cannot pad an object until max_tokens; "flexible" allows runs of at
most FLEXIBLE_WHITESPACE_MAX spaces, tabs or newlines (pretty-printing, never unbounded padding).
The grammar of "flexible" allows any run and whitespace_bound.py cuts it at the bound, the same
way on every llguidance version (a bound written in the grammar holds only from llguidance 1.8).
A flexible JSON compile gives a BoundedMatcher (the matcher and its whitespace state) instead.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.engine.structured.backend import ConstraintError
from tokenmill.engine.structured.whitespace_bound import BROKEN, BoundedMatcher, WhitespaceBound
from tokenmill.engine.types import StructuredOutputsParams

FLEXIBLE_WHITESPACE_MAX = 16
# The longest library reason kept in an error (a verbose parser error can hold the whole schema).
MAX_REASON_CHARS = 2000


def _reason(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_REASON_CHARS else message[: MAX_REASON_CHARS - 3] + "..."


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer = None  # built on the first compile (~0.2 s): engines without constraints skip it
        self._whitespace: WhitespaceBound | None = None  # built on the first flexible JSON compile
        self._executor = None

    # -- compile ------------------------------------------------------------------------------
    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                from tokenmill.engine.light_tokenizer import rust_tokenizer_json

                try:  # as llguidance.hf.from_tokenizer, without its import of transformers
                    self._tokenizer = LLTokenizer(
                        rust_tokenizer_json(self._hf_tokenizer), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                    )
                except Exception as exc:  # a tokenizer llguidance cannot read fails every constraint
                    raise ConstraintError(f"the model's tokenizer cannot be used for constraints: {exc}") from exc
            return self._tokenizer

    def whitespace_bound(self) -> WhitespaceBound:
        """The whitespace scan of this vocabulary (each token's bytes scanned once, on a compile thread)."""
        tokenizer = self._llg_tokenizer()
        with self._lock:
            if self._whitespace is None:
                self._whitespace = WhitespaceBound(
                    [tokenizer.decode_bytes([t]) for t in range(self.vocab_size)], FLEXIBLE_WHITESPACE_MAX)
            return self._whitespace

    def compile(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher

        grammar = grammar_text(params)
        tokenizer = self._llg_tokenizer()
        try:
            matcher = LLMatcher(tokenizer, grammar, log_level=0)
        except Exception as exc:  # raised for API-level misuse; grammar errors set is_error
            raise ConstraintError(_reason(f"invalid {params.kind} constraint: {exc}")) from exc
        if matcher.is_error():
            raise ConstraintError(_reason(f"invalid {params.kind} constraint: {matcher.get_error()}"))
        if params.kind in ("json", "json_object") and params.whitespace == "flexible":
            self.whitespace_bound()
            return BoundedMatcher(matcher)
        return matcher

    # -- per request and per step ---------------------------------------------------------------
    def new_matcher(self, grammar: Any):
        return grammar.deep_copy()

    def copy_matcher(self, matcher: Any):
        return matcher.deep_copy()

    def fill_bitmask(self, matchers: Sequence[tuple[Any, int]], bitmask: torch.Tensor) -> None:
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        # The executor fills the rows on its own threads with the GIL released. (Called directly:
        # llguidance.torch's wrapper module runs torch.compile at import, seconds in a first step.)
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        rows, words = bitmask.shape
        plain = [(m.matcher if isinstance(m, BoundedMatcher) else m, row) for m, row in matchers]
        self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, rows)
        bounded = [(row, m.state) for m, row in matchers if isinstance(m, BoundedMatcher)]
        if bounded:
            self._whitespace.restrict(bitmask, [row for row, _ in bounded], [state for _, state in bounded])

    def accept(self, matcher: Any, token_id: int) -> bool:
        if not isinstance(matcher, BoundedMatcher):
            return bool(matcher.consume_token(token_id))
        state = self._whitespace.next_state(matcher.state, token_id)
        if state == BROKEN:
            matcher.broken = True
            return False
        matcher.state = state
        return bool(matcher.matcher.consume_token(token_id))

    def is_finished(self, matcher: Any) -> bool:
        if isinstance(matcher, BoundedMatcher):
            matcher = matcher.matcher
        return bool(matcher.is_stopped())

    def error(self, matcher: Any) -> str:
        if isinstance(matcher, BoundedMatcher):
            if matcher.broken:
                return f"a whitespace run outside strings longer than {FLEXIBLE_WHITESPACE_MAX}"
            matcher = matcher.matcher
        return _reason(matcher.get_error() or "the token is not allowed by the constraint")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; raises ConstraintError for malformed input."""
    from llguidance import LLMatcher, grammar_from

    kind, text, whitespace = params.key
    try:
        if kind in ("json", "json_object"):
            schema = text if kind == "json" else '{"type": "object"}'
            return LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(whitespace))
        if kind == "regex":
            return LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        return grammar_from("grammar", text)  # Lark, or GBNF/EBNF converted to Lark
    except ValueError as exc:
        raise ConstraintError(_reason(f"invalid {kind} constraint: {exc}")) from exc


def check_without_tokenizer(params: StructuredOutputsParams) -> None:
    """Raise ConstraintError for what fails whatever the model (syntax, unsupported features):
    a tool's check before it sends any job. The tokenizer and the time limit can fail more."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_text(params), None)
    if is_error:
        raise ConstraintError(_reason(f"invalid {params.kind} constraint: {' '.join(messages) or 'no reason given'}"))


def _json_options(whitespace: str) -> dict:
    """The JSON compile options, as overrides (a schema's own x-guidance cannot change them).
    Flexible whitespace is any run of JSON whitespace here; its bound is whitespace_bound.py's."""
    if whitespace == "compact":
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": True}
