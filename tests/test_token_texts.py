"""Token texts for logprob records (engine/token_texts.py): every id's text is the tokenizer's
decode of that id alone, whether the table was made at once (the engine's light tokenizer) or an
id is decoded on first sight (any other tokenizer, ids past the table)."""

from __future__ import annotations

from tokenmill.engine.light_tokenizer import LightTokenizer
from tokenmill.engine.token_texts import TokenTexts
from tokenmill.engine.tokenizer import load_tokenizer


class _Counting:
    """A tokenizer that is not a LightTokenizer, counting its decodes."""

    def __init__(self, inner) -> None:
        self.inner, self.decodes = inner, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decodes += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_every_id_is_its_decode_alone_made_at_once(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    assert type(tok) is LightTokenizer
    texts = TokenTexts(tok)
    ids = list(range(0, len(tok), 97)) + [0, 1, 2, len(tok) - 1]
    assert [texts.text(i) for i in ids] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert texts._table is not None and len(texts._table) == len(tok)
    # An id past the tokenizer's vocabulary (a padded model vocabulary) is decoded alone, as before.
    past = len(tok) + 3
    assert texts.text(past) == tok.decode([past], skip_special_tokens=False)


def test_another_tokenizer_decodes_each_id_once_on_first_sight(tiny_llama_dir):
    tok = _Counting(load_tokenizer(tiny_llama_dir))
    texts = TokenTexts(tok)
    first = [texts.text(i) for i in (5, 17, 5, 17, 300)]
    assert first == [tok.inner.decode([i], skip_special_tokens=False) for i in (5, 17, 5, 17, 300)]
    assert tok.decodes == 3 and texts._table is None
