"""Incremental detokenisation with stop strings, one generated token at a time.

Decoding the whole output after every token costs O(length) per token. Instead (as vLLM's
``detokenize_incrementally`` does) we keep two offsets into the token list:

    ids[prefix_offset:read_offset]  tokens whose text was already released (context only)
    ids[read_offset:]               tokens whose text is not released yet

and decode only the short window ``ids[prefix_offset:]``. The new text is what that window decodes
to beyond the context. Decoding with a little context keeps tokenizers that treat the first token
of a string specially (SentencePiece's leading space) correct; the context starts with the last
few prompt tokens for the same reason.

Two kinds of text are held back:

- an incomplete UTF-8 character: byte-level tokens split emojis and accented letters, and a partial
  character decodes to a trailing U+FFFD; the window is kept open until the character completes
  (or until flush(), which releases whatever the bytes decode to). Text before the partial
  character is final already and goes on at once;
- a possible stop-string start: text whose tail could still grow into a stop string is not released
  until it cannot. When a stop string appears, the output ends just before it and nothing after it
  is ever released. If several stop strings appear, the one that completes first wins (ties: the
  one that starts first), which is what stopping generation as soon as one appears gives.

Stop strings and ``min_tokens`` (vLLM's rule): ``add(token, check_stop=False)`` for the tokens a
request must generate anyway; from the first ``add`` with ``check_stop=True`` on, a stop string
counts only if it ends in text decoded from that token on, so an occurrence that completed earlier
never ends the request, while one that started earlier and completes now does.

A request whose caller reads only its final text (``deferred``: EngineRequest.final_only) and that
has no stop strings is not decoded token by token at all: ``add`` keeps the id, and ``flush`` (or
reading ``text``) decodes the whole output in one window, the prompt's last tokens as context.

A request without stop strings needs no early release (nothing is checked in its text), so it
decodes through the `tokenizers` library's own incremental decoder (``DecodeStream``, what vLLM v1
uses too) when the tokenizer has a Rust backend: the same window scheme in one Rust call per token,
a third of the Python path's cost per token. Its text only comes a little later around a partial
character; ``flush`` releases a partial character at the end as above.

So the concatenation of everything ``add`` and ``flush`` return is exactly the final text, and it
equals ``tokenizer.decode(output_ids, skip_special_tokens=...)`` cut before the first stop string
(for byte-level BPE tokenizers such as GPT-2/Llama-3/Qwen/SmolLM2; SentencePiece tokenizers may
keep the leading space of the first output token, as vLLM does). No clean-up of tokenisation
spaces is applied, also as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as context for the first output token (vLLM uses 5 plus a read window).
PROMPT_CONTEXT_TOKENS = 6


def rust_backend(tokenizer):
    """The tokenizer's Rust `tokenizers.Tokenizer` (itself, or a fast tokenizer's backend), or None."""
    from tokenizers import Tokenizer as RustTokenizer  # comes with transformers

    backend = (
        tokenizer if isinstance(tokenizer, RustTokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    )
    return backend if isinstance(backend, RustTokenizer) else None


def make_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text, without tokenisation-space clean-up; straight through the Rust `tokenizers`
    backend when the tokenizer has one (much less overhead per call than the Python wrapper)."""
    backend = rust_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def find_first_stop(text: str, stop: Sequence[str], min_end: int = 0) -> int | None:
    """Start of the stop string that completes first in `text` (ties: earliest start), or None.

    Only occurrences that end after position `min_end` count.
    """
    best: tuple[int, int] | None = None  # (end, start): the smallest wins
    for s in stop:
        start = text.find(s, max(0, min_end - len(s) + 1))
        if start >= 0 and (best is None or (start + len(s), start) < best):
            best = (start + len(s), start)
    return None if best is None else best[1]


class StopPrefixes:
    """The prefixes of a request's stop strings, made once: how much of a text's tail to hold back
    (it could still start a stop string) is asked for every token a stop-string request decodes,
    and a tail that ends in a character no prefix ends in, the common case, is answered without a
    loop. A tail is held when it is shorter than the longest stop string and some stop string
    starts with it (a whole shorter stop string included)."""

    def __init__(self, stop: Sequence[str]) -> None:
        longest = max((len(s) for s in stop), default=0)
        self._prefixes = frozenset(s[:k] for s in stop for k in range(1, min(len(s), longest - 1) + 1))
        self._last_chars = frozenset(p[-1] for p in self._prefixes)
        self._longest = longest - 1

    def held_len(self, text: str) -> int:
        """Length of the longest tail of `text`, shorter than the longest stop string, that some
        stop string starts with."""
        if not text or text[-1] not in self._last_chars:
            return 0
        prefixes = self._prefixes
        for k in range(min(len(text), self._longest), 0, -1):
            if text[-k:] in prefixes:
                return k
        return 0


class IncrementalDetokenizer:
    """Turns the output tokens of one request into released text, honouring stop strings."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        skip_special_tokens: bool = True,
        deferred: bool = False,
    ) -> None:
        """deferred: only the final text is read, so without stop strings nothing is decoded
        before flush() (or `text`)."""
        stop = list(stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._stop = stop
        self._stop_prefixes = StopPrefixes(stop)
        self._decode = make_decoder(tokenizer, skip_special_tokens)

        context = [int(t) for t in prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :]]
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes would merge with the output's and
            # shift the offsets, so decode the output on its own.
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self._window_released = 0  # characters of the open window's new text already returned
        self._held = ""  # decoded text that could still start a stop string
        self._released: list[str] = []
        self._released_len = 0  # characters in _released
        # Where stop strings start to count (characters of the whole output text): set by the first
        # add() with check_stop=True; None while no token has asked for stop checks.
        self._stops_count_after: int | None = None
        self._stopped = False
        self._flushed = False
        self._deferred = deferred and not stop
        # Without stop strings: the Rust incremental decoder, primed with the same context. Its
        # window follows the offsets above, which are kept in step for flush().
        self._backend = rust_backend(tokenizer) if not stop and not self._deferred else None
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    @property
    def text(self) -> str:
        """All text released so far (deferred: all text decodable so far, a partial character
        at the end still held)."""
        if self._deferred and not self._flushed:
            self._release_deferred(final=False)
        return "".join(self._released)

    @property
    def stopped(self) -> bool:
        """A stop string was hit (the text ends just before it)."""
        return self._stopped

    def add(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Append one generated token; returns (text released now, a stop string was hit).

        check_stop=False: this token is one of the first `min_tokens`, so no stop string may end the
        output yet (text that could start one is still held back, as it may complete later).
        """
        if self._flushed:
            raise RuntimeError("add() after flush(): the request is already finished")
        if self._stopped:
            return "", True  # nothing after a stop string is ever released
        if self._deferred:
            self._ids.append(int(token_id))  # decoded at flush()
            return "", False
        if self._stream is not None:
            return self._add_streamed(int(token_id)), False
        if check_stop and self._stops_count_after is None:
            self._stops_count_after = self._released_len + len(self._held)
        self._ids.append(int(token_id))
        piece = self._decode_new(final=False)
        if not piece:
            return "", False
        if not self._stop:  # nothing is ever held back for a stop string: the piece goes out as it is
            return self._keep(piece), False
        return self._release(piece)

    def flush(self) -> str:
        """Release the held-back text at finish (an incomplete character or a stop-string start)."""
        if self._flushed or self._stopped:
            self._flushed = True
            return ""
        if self._deferred:
            released = self._release_deferred(final=True)
            self._flushed = True
            return released
        self._flushed = True
        released, _ = self._release(self._decode_new(final=True), final=True)
        return released

    # -- internals -------------------------------------------------------------------------------

    def _keep(self, piece: str) -> str:
        """Record text that goes out as it is (no stop string can hold it back); returns it."""
        if piece:
            self._released.append(piece)
            self._released_len += len(piece)
        return piece

    def _release_deferred(self, final: bool) -> str:
        """Deferred mode: decode the ids added since the last release as one window."""
        return self._keep(self._decode_new(final=final))

    def _add_streamed(self, token_id: int) -> str:
        """add() without stop strings: DecodeStream gives the window's new text, or None while the
        window ends in a partial character (held, as _decode_new holds it, until it completes)."""
        self._ids.append(token_id)
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - e.g. its prefix check on an unusual decoder
            # The offsets match the stream's window, so the Python path takes over from here.
            self._stream = None
            return self._keep(self._decode_new(final=False))
        if piece is None:
            return ""
        # The stream moved its window on: so do the offsets, so that flush() decodes what it holds.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        return self._keep(piece)

    def _decode_new(self, final: bool) -> str:
        """Text of ids[read_offset:] not returned before.

        While the window ends in an incomplete character (trailing U+FFFD), the window stays open
        and only the text before that character is returned; the rest comes once the character
        completes, or at the end (`final`) as whatever the bytes decode to.
        """
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token
        new_text = window_text[len(self._prefix_text) :]
        if final or not new_text.endswith(REPLACEMENT_CHAR):
            piece = new_text[self._window_released :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = None
            self._window_released = 0
            return piece
        # Text before a partial character is final already (a later byte can only complete that
        # character), so it need not wait: a stop string inside it is caught at this token.
        complete = new_text.rstrip(REPLACEMENT_CHAR)
        piece = complete[self._window_released :]
        self._window_released = max(self._window_released, len(complete))
        return piece

    def _release(self, piece: str, final: bool = False) -> tuple[str, bool]:
        text = self._held + piece
        cut = None
        if self._stop and self._stops_count_after is not None:
            cut = find_first_stop(text, self._stop, min_end=self._stops_count_after - self._released_len)
        if cut is not None:
            released, self._held, self._stopped = text[:cut], "", True
        else:
            keep = 0 if final else self._stop_prefixes.held_len(text)
            released, self._held = text[: len(text) - keep], text[len(text) - keep :]
        if released:
            self._released.append(released)
            self._released_len += len(released)
        return released, self._stopped
