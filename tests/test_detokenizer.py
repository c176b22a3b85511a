"""Incremental detokenisation and stop strings, with the tiny models' byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tokenmill.engine.detokenizer import IncrementalDetokenizer, find_first_stop
from tokenmill.tools.tiny_models import cached_tiny_model

TEXTS = [
    "Bonjour! Ça va? hello world",
    "café naïve résumé — Æsir Øre ß",
    "party 🎉🎉 time 👩‍💻 done",
    "日本語のテキスト and 中文",
    "mixed: é🎉x ü 😀😀 end.",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def run(tok, ids, stop=(), prompt=(), skip_special_tokens=True):
    """Feed ids one at a time like the engine does; stop feeding at a hit. Returns pieces, hit, detok."""
    detok = IncrementalDetokenizer(tok, list(prompt), list(stop), skip_special_tokens=skip_special_tokens)
    pieces = []
    hit = False
    for i in ids:
        piece, hit = detok.add(i)
        pieces.append(piece)
        if hit:
            break
    pieces.append(detok.flush())
    return pieces, detok.stopped, detok  # flush() can find a stop string too


def expected_text(tok, ids, stop):
    text = tok.decode(ids, skip_special_tokens=True)
    # The stop string that completes first ends the text (ties: the one that starts first).
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return text[: min(starts)], True
    return text, False


@pytest.mark.parametrize("text", TEXTS)
def test_released_text_equals_full_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    pieces, hit, detok = run(tokenizer, ids, prompt=encode(tokenizer, "Say something:"))
    assert "".join(pieces) == detok.text == tokenizer.decode(ids) == text
    assert not hit and not detok.stopped
    # A partial character is never released: no piece carries a replacement character.
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_characters_are_held_until_complete(tokenizer):
    ids = encode(tokenizer, "a🎉b")
    assert len(ids) >= 4  # the emoji is split over byte tokens
    pieces, _, _ = run(tokenizer, ids)
    emoji_piece = [p for p in pieces if "🎉" in p]
    assert emoji_piece and emoji_piece[0] in ("🎉", "a🎉", "🎉b")
    assert pieces.count("") >= 2  # the emoji's first bytes released nothing


def test_stop_string_spanning_two_and_three_tokens(tokenizer):
    text = "the model writes a batch result offset partition"
    ids = encode(tokenizer, text)
    pieces_of = [tokenizer.decode([i]) for i in ids]
    assert len(pieces_of) >= 6
    starts = [sum(len(p) for p in pieces_of[:k]) for k in range(len(pieces_of) + 1)]
    for span in (2, 3):
        # From the last character of token 1 to the first character of token 1 + span.
        a, b = starts[2] - 1, starts[1 + span] + 1
        stop = text[a:b]
        assert text.find(stop) == a
        pieces, hit, detok = run(tokenizer, ids, stop=[stop])
        assert hit and detok.stopped
        assert "".join(pieces) == detok.text == text[:a]
        # The token that completed the stop string released only what precedes it.
        assert stop not in "".join(pieces)


def test_text_after_a_stop_string_is_never_released(tokenizer):
    text = "hello world. kafka token model"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], ["world"])
    released = []
    hit_at = None
    for k, i in enumerate(ids):  # keep feeding after the hit, as a careless caller might
        piece, hit = detok.add(i)
        released.append(piece)
        if hit and hit_at is None:
            hit_at = k
    released.append(detok.flush())
    assert hit_at is not None
    assert "".join(released) == detok.text == "hello "
    assert all(p == "" for p in released[hit_at + 1 :])


def test_multiple_stop_strings_first_to_complete_wins(tokenizer):
    text = "one two three four five"
    ids = encode(tokenizer, text)
    assert expected_text(tokenizer, ids, ["four", "two", "xyz"])[0] == "one "
    assert "".join(run(tokenizer, ids, stop=["four", "two", "xyz"])[0]) == "one "
    # "two three" starts earlier than "o t" but completes later: "o t" wins.
    assert "".join(run(tokenizer, ids, stop=["two three", "o t"])[0]) == "one tw"
    # Same end: the longer (earlier-starting) one wins.
    assert "".join(run(tokenizer, ids, stop=["ee", "three"])[0]) == "one two "


def test_stop_string_at_the_very_first_token(tokenizer):
    ids = encode(tokenizer, "hello world")
    first = tokenizer.decode(ids[:1])
    pieces, hit, detok = run(tokenizer, ids, stop=[first])
    assert hit and pieces == ["", ""] and detok.text == ""
    # A stop string that is a strict part of the first token: text before it comes out.
    pieces, hit, _ = run(tokenizer, ids, stop=[first[1:]])
    assert hit and "".join(pieces) == first[:1]


def test_possible_stop_start_is_held_then_released_at_flush(tokenizer):
    ids = encode(tokenizer, "hello world")
    detok = IncrementalDetokenizer(tokenizer, [], ["world peace"])
    released = "".join(detok.add(i)[0] for i in ids)
    assert released == "hello "  # "world" could still become "world peace"
    assert detok.flush() == "world"
    assert detok.text == "hello world" and not detok.stopped


def test_stop_string_with_a_character_split_across_byte_tokens(tokenizer):
    text = "un café noir 🎉 fête"
    ids = encode(tokenizer, text)
    for stop, before in (("é n", "un caf"), ("🎉", "un café noir "), ("fê", "un café noir 🎉 ")):
        pieces, hit, _ = run(tokenizer, ids, stop=[stop])
        assert hit and "".join(pieces) == before, stop


def test_special_tokens_are_skipped_by_default(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = encode(tokenizer, "hi") + [im_end] + encode(tokenizer, " there") + [eos]
    assert "".join(run(tokenizer, ids)[0]) == "hi there"
    kept = "".join(run(tokenizer, ids, skip_special_tokens=False)[0])
    assert kept == "hi<|im_end|> there<|endoftext|>"


def test_prompt_ending_inside_a_character_does_not_leak_into_output(tokenizer):
    emoji = encode(tokenizer, "🎉")
    prompt = encode(tokenizer, "start ") + emoji[:2]  # the prompt stops mid-character
    ids = emoji[2:] + encode(tokenizer, " ok")
    pieces, _, _ = run(tokenizer, ids, prompt=prompt)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_decoding_window_stays_small(tokenizer):
    """O(1)-ish per token: each step decodes a few tokens, not the whole output."""
    windows = []

    class Recording:  # a tokenizer without a Rust backend: the detokenizer calls decode()
        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
            assert clean_up_tokenization_spaces is False
            windows.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = encode(tokenizer, " ".join(TEXTS * 8))
    assert len(ids) > 300
    pieces, _, detok = run(Recording(), ids, prompt=encode(tokenizer, "a long prompt " * 20))
    assert detok.text == tokenizer.decode(ids)
    assert max(windows) <= 12
    assert len(windows) <= 2 * len(ids) + 2


def test_bad_stop_strings_and_use_after_flush_are_errors(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, [], ["ok", ""])
    detok = IncrementalDetokenizer(tokenizer, [], [])
    detok.add(encode(tokenizer, "a")[0])
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.add(5)


def test_bare_rust_tokenizer_works_too(tokenizer):
    ids = encode(tokenizer, "café 🎉 ok")
    pieces, _, _ = run(tokenizer.backend_tokenizer, ids, stop=["ok"])
    assert "".join(pieces) == "café 🎉 "


def test_find_first_stop():
    assert find_first_stop("abcdef", ["cd", "bcdef"]) == 2
    assert find_first_stop("abcdef", ["zz"]) is None
    assert find_first_stop("abcabc", ["bc"]) == 1
    assert find_first_stop("abcd", ["bcd", "cd"]) == 1


_TOKENIZER = None


def _tok():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = AutoTokenizer.from_pretrained(cached_tiny_model("test-llama"))
    return _TOKENIZER


@st.composite
def token_case(draw):
    tok = _tok()
    vocab = len(tok)
    # Byte-level ids (the lower part of the vocabulary holds single bytes and short merges) make
    # split characters and invalid sequences common; the rest are whole words.
    token = st.one_of(st.integers(0, 300), st.integers(0, vocab - 1))
    ids = draw(st.lists(token, min_size=0, max_size=40))
    prompt = draw(st.lists(token, min_size=0, max_size=8))
    text = tok.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if text and draw(st.booleans()):
            a = draw(st.integers(0, len(text) - 1))
            b = draw(st.integers(a + 1, min(len(text), a + 6)))
            stops.append(text[a:b])
        else:
            stops.append(draw(st.text(min_size=1, max_size=4)))
    return ids, prompt, stops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_case())
def test_property_released_text_is_decode_cut_at_first_stop(case):
    ids, prompt, stops = case
    tok = _tok()
    pieces, hit, detok = run(tok, ids, stop=stops, prompt=prompt)
    want, want_hit = expected_text(tok, ids, stops)
    assert "".join(pieces) == detok.text == want
    assert hit == want_hit == detok.stopped


# -- a byte-level stand-in whose tokens mix whole and partial characters -------------------------
# Real byte-level BPE vocabularies (GPT-2, Llama 3, Qwen) hold tokens such as " caf\xc3" (text,
# then the first byte of a character); the tiny test vocabulary has none, so this stand-in does.


class ByteTokenizer:
    """Each id is a byte string; decoding is lossy UTF-8, as a byte-level BPE decoder does."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


_EMOJI = "🎉".encode()
BYTE_PIECES = [bytes([b]) for b in range(256)] + [
    b"ab" + _EMOJI[:2],
    _EMOJI[2:] + b"cd",
    b" caf\xc3",
    b"\xa9 ",
    "é".encode(),
    b"x" + _EMOJI[:1],
    _EMOJI[1:],
    b"hello",
    b" world",
    "ü".encode()[:1],
    "ü".encode()[1:] + b"!",
    b"\xe2\x80",
]


def test_text_before_a_partial_character_is_released_and_stop_checked_at_once():
    tok = ByteTokenizer(BYTE_PIECES)
    first, second = 256, 257  # "ab" + half an emoji, then its other half + "cd"
    detok = IncrementalDetokenizer(tok, [], [])
    assert detok.add(first) == ("ab", False)
    assert detok.add(second) == ("🎉cd", False)
    # A stop string in the whole part of a token is found at that token, not one later.
    detok = IncrementalDetokenizer(tok, [], ["b"])
    assert detok.add(first) == ("a", True)
    detok = IncrementalDetokenizer(tok, [], ["ab🎉"])
    assert detok.add(first) == ("", False)
    assert detok.add(second) == ("", True)


@st.composite
def byte_case(draw):
    ids = draw(st.lists(st.integers(0, len(BYTE_PIECES) - 1), max_size=30))
    # Most ids from the mixed tokens and printable ASCII, so text and partial characters interleave.
    favourites = list(range(256, len(BYTE_PIECES))) + [32, 97, 98, 0xC3, 0xA9, 0xF0, 0x9F]
    ids = [i if i >= 256 or draw(st.booleans()) else draw(st.sampled_from(favourites)) for i in ids]
    text = ByteTokenizer(BYTE_PIECES).decode(ids)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):
            a = draw(st.integers(0, len(text) - 1))
            stops.append(text[a : draw(st.integers(a + 1, min(len(text), a + 4)))])
        else:
            stops.append(draw(st.sampled_from(["ab", "🎉", "é ", "\ufffd", "d", "llo w"])))
    return ids, stops


@settings(max_examples=300, deadline=None)
@given(byte_case())
def test_property_byte_tokens_stop_at_the_earliest_certain_token(case):
    ids, stops = case
    tok = ByteTokenizer(BYTE_PIECES)
    detok = IncrementalDetokenizer(tok, [], stops)
    pieces, fed, hit = [], 0, False
    for i in ids:
        fed += 1
        piece, hit = detok.add(i)
        pieces.append(piece)
        if hit:
            break
    pieces.append(detok.flush())
    text = tok.decode(ids)
    want_end = None
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[max(0, end - len(s)) : end] == s]
        if starts:
            want_end = min(starts)
            break
    want = text if want_end is None else text[:want_end]
    assert "".join(pieces) == detok.text == want
    assert detok.stopped == (want_end is not None)
    if hit and fed > 1:
        # One token earlier, no stop string lay in the part of the text that was certain then
        # (everything before a trailing partial character).
        earlier = tok.decode(ids[: fed - 1]).rstrip("\ufffd")
        assert find_first_stop(earlier, stops) is None


# -- a SentencePiece-style tokenizer (Metaspace + byte fallback, Llama 2 decoder) -----------------


@pytest.fixture(scope="module")
def sentencepiece_style_tokenizer():
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # Llama 2's decoder: the first character of the whole text is dropped when it is a space.
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(
        ["hello world this is a test of the model", "the batch worker writes results"] * 40, trainer
    )
    # Byte-fallback tokens are ordinary vocabulary entries, as in Llama 2.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


@pytest.mark.parametrize(
    "prompt, output",
    [("say hello", " world, this is the model"), ("the batch", " café 🎉 worker"), ("🎉", " ü results")],
)
def test_sentencepiece_style_output_keeps_its_leading_space(sentencepiece_style_tokenizer, prompt, output):
    tok = sentencepiece_style_tokenizer
    whole = tok.encode(prompt + output, add_special_tokens=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    assert whole[: len(prompt_ids)] == prompt_ids  # the output starts on a token boundary
    out_ids = whole[len(prompt_ids) :]
    assert tok.decode(out_ids) == output[1:]  # decoding the output alone loses its first space
    pieces, _, detok = run(tok, out_ids, prompt=prompt_ids)
    # With the prompt as context, the text is the true continuation of the prompt (vLLM does so).
    assert "".join(pieces) == detok.text == output
    assert all("\ufffd" not in p for p in pieces)
    pieces, hit, _ = run(tok, out_ids, prompt=prompt_ids, stop=[output[3:6]])
    assert hit and "".join(pieces) == output[:3]


# -- the reference real model's tokenizer (SmolLM2, GPT-2 style byte-level BPE) ------------------

_SMOLLM2 = {}


def _smollm2_tokenizer():
    if "tok" not in _SMOLLM2:
        from tokenmill.tools.smollm2 import cached_smollm2

        tok = AutoTokenizer.from_pretrained(cached_smollm2())
        backend = tok.backend_tokenizer
        # Its vocabulary holds tokens such as " \xe2" (a space, then the first byte of a character).
        mixed = [
            i for i in range(len(tok)) if (t := backend.decode([i])).endswith("\ufffd") and t.rstrip("\ufffd")
        ]
        _SMOLLM2.update(tok=tok, mixed=mixed)
    return _SMOLLM2["tok"], _SMOLLM2["mixed"]


def test_smollm2_real_text_with_stop_strings():
    tok, mixed = _smollm2_tokenizer()
    assert mixed  # the case the partial-character release exists for
    text = "Voilà — «déjà vu» 🎉🎊 naïve café, 日本語 and “quotes”… done."
    ids = encode(tok, text)
    pieces, hit, detok = run(tok, ids, prompt=encode(tok, "Say it:"))
    assert "".join(pieces) == detok.text == text and not hit
    assert all("\ufffd" not in p for p in pieces)
    for stop in ("«déjà", "🎊", "本語 a", "…"):
        pieces, hit, _ = run(tok, ids, stop=["zzz", stop])
        assert hit and "".join(pieces) == text[: text.index(stop)], stop


@st.composite
def smollm2_case(draw):
    tok, mixed = _smollm2_tokenizer()
    byte_like = st.integers(0, 300)  # single bytes and short merges
    token = st.one_of(st.sampled_from(mixed), byte_like, st.integers(0, len(tok) - 1))
    ids = draw(st.lists(token, max_size=30))
    prompt = draw(st.lists(token, max_size=6))
    text = tok.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if text and draw(st.booleans()):
            a = draw(st.integers(0, len(text) - 1))
            stops.append(text[a : draw(st.integers(a + 1, min(len(text), a + 5)))])
        else:
            stops.append(draw(st.text(min_size=1, max_size=3)))
    return ids, prompt, stops


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(smollm2_case())
def test_property_smollm2_released_text_is_decode_cut_at_first_stop(case):
    ids, prompt, stops = case
    tok, _ = _smollm2_tokenizer()
    pieces, hit, detok = run(tok, ids, stop=stops, prompt=prompt)
    want, want_hit = expected_text(tok, ids, stops)
    assert "".join(pieces) == detok.text == want
    assert hit == want_hit


def _first_index_containing(tok, ids, needle, start_char=0):
    """Index of the first token after which the decoded text holds `needle` starting at or after start_char."""
    for i in range(len(ids)):
        if tok.decode(ids[: i + 1]).find(needle, start_char) >= 0:
            return i
    raise AssertionError(f"{needle!r} not in the text")


@pytest.mark.parametrize("stop", ["stop", "op xy"])  # one token's text, and one spanning two tokens
def test_stop_strings_count_only_from_the_first_checked_token(tokenizer, stop):
    text = "abc stop xyz stop xyz end"
    ids = encode(tokenizer, text)
    first = text.index(stop)
    second = text.index(stop, first + 1)
    k = _first_index_containing(tokenizer, ids, stop)  # the token that completes the first occurrence

    def feed(checked_from):
        detok = IncrementalDetokenizer(tokenizer, [], [stop])
        out = []
        for i, t in enumerate(ids):
            piece, hit = detok.add(t, check_stop=i >= checked_from)
            out.append(piece)
            if hit:
                break
        out.append(detok.flush())
        return "".join(out), detok.stopped

    # Checked from the token that completes the first occurrence: it counts (even if it started earlier).
    assert feed(k) == (text[:first], True)
    # Checked only from the token after it: the first occurrence is passed, the second ends the text.
    assert feed(k + 1) == (text[:second], True)
    # Never checked: everything comes out, nothing held back at the end.
    assert feed(len(ids)) == (text, False)


def test_find_first_stop_min_end():
    assert find_first_stop("ab stop cd stop", ["stop"]) == 3
    assert find_first_stop("ab stop cd stop", ["stop"], min_end=7) == 11  # the first ends at 7: not after it
    assert find_first_stop("ab stop cd stop", ["stop"], min_end=6) == 3
    assert find_first_stop("ab stop", ["stop"], min_end=7) is None


# -- requests without stop strings: the Rust incremental decoder (DecodeStream) -------------------


def _python_window(tok, prompt):
    """A detokenizer for `tok` held on the Python window path (what requests with stop strings use)."""
    detok = IncrementalDetokenizer(tok, prompt, [])
    detok._stream = None
    return detok


def _feed(detok, ids):
    pieces = [detok.add(i)[0] for i in ids]
    return pieces, detok.flush()


def test_without_stop_strings_a_rust_tokenizer_decodes_through_decode_stream(tokenizer):
    assert IncrementalDetokenizer(tokenizer, [], [])._stream is not None
    assert IncrementalDetokenizer(tokenizer.backend_tokenizer, [], [])._stream is not None
    assert IncrementalDetokenizer(tokenizer, [], ["stop"])._stream is None  # stop strings: the Python path


def test_decode_stream_flushes_a_trailing_partial_character(tokenizer):
    ids = encode(tokenizer, "ok 🎉")
    cut = ids[:-1]  # the emoji's last byte never comes
    pieces, tail = _feed(IncrementalDetokenizer(tokenizer, [], []), cut)
    assert "".join(pieces) == "ok " and tail == tokenizer.decode(cut)[len("ok "):]
    assert tail and tail.endswith("\ufffd")


def _same_text_both_ways(tok, ids, prompt):
    streamed = IncrementalDetokenizer(tok, prompt, [])
    assert streamed._stream is not None
    pieces, tail = _feed(streamed, ids)
    want_pieces, want_tail = _feed(_python_window(tok, prompt), ids)
    assert "".join(pieces) + tail == "".join(want_pieces) + want_tail == streamed.text
    if not prompt:  # with a prompt, the context may keep a leading space that decode() alone drops
        assert streamed.text == tok.decode(ids, skip_special_tokens=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_case())
def test_property_decode_stream_gives_the_python_paths_text(case):
    ids, prompt, _ = case
    _same_text_both_ways(_tok(), ids, prompt)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(smollm2_case())
def test_property_decode_stream_gives_the_python_paths_text_smollm2(case):
    ids, prompt, _ = case
    tok, _ = _smollm2_tokenizer()
    _same_text_both_ways(tok, ids, prompt)


@pytest.mark.parametrize("prompt, output", [("say hello", " world, this is the model"), ("🎉", " ü results")])
def test_decode_stream_keeps_the_sentencepiece_leading_space(sentencepiece_style_tokenizer, prompt, output):
    tok = sentencepiece_style_tokenizer
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    out_ids = tok.encode(prompt + output, add_special_tokens=False)[len(prompt_ids):]
    detok = IncrementalDetokenizer(tok, prompt_ids, [])
    assert detok._stream is not None
    pieces, tail = _feed(detok, out_ids)
    assert "".join(pieces) + tail == detok.text == output


def test_a_failing_decode_stream_hands_over_to_the_python_path(tokenizer):
    class Failing:
        def step(self, backend, token_id):
            raise RuntimeError("invalid prefix")

    ids = encode(tokenizer, "café 🎉 naïve results")
    prompt = encode(tokenizer, "Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, [])
    first, _ = detok.add(ids[0])
    detok._stream = Failing()
    rest = [detok.add(i)[0] for i in ids[1:]]
    assert first + "".join(rest) + detok.flush() == tokenizer.decode(ids)
    assert detok._stream is None


# -- deferred (final-only requests without stop strings): decoded once, at flush() ----------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_case())
def test_property_deferred_text_is_the_token_by_token_text(case):
    ids, prompt, _ = case
    tok = _tok()
    deferred = IncrementalDetokenizer(tok, prompt, [], deferred=True)
    assert all(deferred.add(i) == ("", False) for i in ids)  # nothing decoded yet
    tail = deferred.flush()
    pieces, want_tail = _feed(_python_window(tok, prompt), ids)
    assert tail == deferred.text == "".join(pieces) + want_tail


def test_deferred_text_read_midway_holds_a_partial_character_until_flush(tokenizer):
    ids = encode(tokenizer, "ok 🎉 done")
    emoji_bytes = [i for i, p in enumerate(ids) if "\ufffd" in tokenizer.decode(ids[: i + 1])]
    assert emoji_bytes
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Say:"), [], deferred=True)
    for i in ids[: emoji_bytes[0] + 1]:  # up to inside the emoji
        detok.add(i)
    assert detok.text == "ok "  # what can be decoded so far, the partial emoji held
    for i in ids[emoji_bytes[0] + 1 :]:
        detok.add(i)
    rest = detok.flush()
    assert detok.text == "ok 🎉 done" and rest == "🎉 done"


def test_deferred_with_stop_strings_decodes_token_by_token(tokenizer):
    ids = encode(tokenizer, "the model writes a batch result")
    detok = IncrementalDetokenizer(tokenizer, [], ["batch"], deferred=True)
    hit = False
    for i in ids:
        _, hit = detok.add(i)
        if hit:
            break
    assert hit and detok.text == "the model writes a "


def test_the_held_tail_is_the_longest_tail_a_stop_string_starts_with():
    """StopPrefixes (made once per request) against the rule written out: the longest tail of the
    text, shorter than the longest stop string, that some stop string starts with; on random texts
    over the stop strings' own characters."""
    import random

    from tokenmill.engine.detokenizer import StopPrefixes

    def rule(text, stop):
        longest = max((len(s) for s in stop), default=0)
        return next((k for k in range(min(len(text), longest - 1), 0, -1)
                     if any(s.startswith(text[-k:]) for s in stop)), 0)

    rng = random.Random(0)
    for stop in (["\n\n\n", "###", "</answer>"], ["ab", "aab", "b"], ["x"], ["#", "##"], ["é", "abé"], []):
        prefixes = StopPrefixes(stop)
        alphabet = "".join(sorted(set("".join(stop)))) + "z "
        for _ in range(3000):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
            assert prefixes.held_len(text) == rule(text, stop), (text, stop)
    assert StopPrefixes(["</answer>"]).held_len("ok </ans") == 5
    assert StopPrefixes(["</answer>"]).held_len("ok </answer") == 8  # (one character short of the whole)
