"""Each token id's text alone, for logprob records (the `token` of a record and of its top-N).

A logprob row names its token and its top-N alternatives: 256 rows a step ask for about 1,500 texts.
Decoding each on first sight cost about 3 us, which, while a random model's rows kept naming ids
never seen before, was the largest part of what a logprob row cost over a plain one
(`bench --workload features`). With the engine's own tokenizer (light_tokenizer.py) every id's text
is decoded at once on the first request, in one batch of the tokenizers library (32,000 ids: about
30 ms); other tokenizers decode an id on first sight and keep it.
"""

from __future__ import annotations

from typing import Any

from tokenmill.engine.light_tokenizer import LightTokenizer


class TokenTexts:
    """token id -> tokenizer.decode([id], skip_special_tokens=False), kept."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._table: list[str] | None = None  # every id's text, made on first use (a light tokenizer)
        self._seen: dict[int, str] = {}  # ids outside the table, or every id for other tokenizers

    def text(self, token_id: int) -> str:
        table = self._table
        if table is None and type(self._tokenizer) is LightTokenizer:
            table = self._table = self._every_text()
        if table is not None and 0 <= token_id < len(table):
            return table[token_id]
        text = self._seen.get(token_id)
        if text is None:
            text = self._seen[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _every_text(self) -> list[str]:
        # LightTokenizer.decode of plain ids is this same call on its backend tokenizer.
        ids = [[i] for i in range(len(self._tokenizer))]
        return self._tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=False)
