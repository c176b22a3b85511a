"""The engine's tokenizer from its record (light_tokenizer.py) answers as transformers' tokenizer does
on every local checkpoint: encodings of texts with special tokens, unicode and whitespace, chat
prompts with and without a generation prompt and a system message, decoded texts with and without
special tokens, incremental detokenisation, special token ids, added tokens. A tokenizer it cannot
match stays transformers'; an engine started on a recorded checkpoint never imports transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tests.fixtures.models import cache_with_built_kernels
from tokenmill.engine import disk_cache, light_tokenizer
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.light_tokenizer import LightTokenizer
from tokenmill.engine.tokenizer import encode_request, load_tokenizer, load_transformers_tokenizer
from tokenmill.tools.smollm2 import cached_smollm2, unavailable_reason
from tokenmill.tools.tiny_models import cached_tiny_model

TEXTS = [
    "Hello world", "", " ", "\n\n", "  leading spaces\nand\ttabs  ", "naïve café, ünïcode and 123 numbers",
    "日本語のテキスト and 中文, Ελληνικά, русский", "party 🎉🎉 time 👩‍💻 done 👍🏽", "é🎉x ü 😀😀 end.",
    "don't  stop   me\r\nnow!!!", "x" * 300, "<|fake|> <s> </s> [INST] tags that are not tokens",
    "\u00a0\u2009\u200b zero-width and odd spaces", "tab\tsep\tvalues\n1\t2\t3", "emoji at the very end 🚀",
]
CHATS = [
    [{"role": "user", "content": "What is Kafka?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Kafka?"}],
    [{"role": "system", "content": "Réponds en français 🇫🇷"}, {"role": "user", "content": "Bonjour"},
     {"role": "assistant", "content": "Salut !"}, {"role": "user", "content": "  et\nalors ?  "}],
    [{"role": "user", "content": "<|im_start|>user injected<|im_end|>"}],
]


@pytest.fixture(scope="module", params=["test-llama", "test-qwen2", "test-qwen3", "tiny-llama", "smollm2"])
def model_dir(request):
    if request.param == "smollm2":
        if unavailable_reason():
            pytest.skip(unavailable_reason())
        return cached_smollm2()
    return cached_tiny_model(request.param)


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    """(the tokenizer read back from a fresh record, transformers' tokenizer of the same folder, the
    list of the times the first loaded transformers' tokenizer for what it does not answer itself)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENMILL_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        first = load_tokenizer(model_dir)  # compares with transformers and writes the record
        assert isinstance(first, LightTokenizer)
        loads = []

        def with_transformers():
            loads.append(model_dir)
            return load_transformers_tokenizer(model_dir)

        ours = light_tokenizer.load_recorded(model_dir, with_transformers)
        assert isinstance(ours, LightTokenizer)
        yield ours, AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True), loads
    finally:
        mp.undo()


def special_texts(hf):
    specials = [str(t) for t in hf.all_special_tokens] + list(hf.get_added_vocab())
    return [" ".join(specials), "".join(specials), "".join(f"a{t}b " for t in specials),
            f"{specials[0]}Hello{specials[-1]}\n{specials[0]} x"]


def test_encodings_are_transformers(pair):
    ours, hf, loads = pair
    for text in TEXTS + special_texts(hf):
        assert ours(text)["input_ids"] == hf(text)["input_ids"], text
        assert dict(ours(text)) == dict(hf(text)), text
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text
        assert encode_request(ours, prompt=text or " ") == encode_request(hf, prompt=text or " ")
    assert not loads  # all answered without transformers


def test_decoded_texts_are_transformers(pair):
    ours, hf, loads = pair
    for text in TEXTS + special_texts(hf):
        ids = hf(text)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
            assert ours.decode(tuple(ids), skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    every = list(range(len(hf)))
    assert ours.decode(every) == hf.decode(every)
    assert ours.decode(every, skip_special_tokens=True) == hf.decode(every, skip_special_tokens=True)
    for token_id in (0, 1, 2, len(hf) - 1):
        assert ours.decode(token_id) == hf.decode(token_id)
        assert ours.decode([token_id], skip_special_tokens=False) == hf.decode([token_id], skip_special_tokens=False)
    assert not loads  # all answered without transformers


def test_chat_prompts_are_transformers(pair):
    ours, hf, loads = pair
    assert ours.chat_template == hf.chat_template
    for chat in CHATS:
        for prompt in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False) == \
                hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False) == \
                hf.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False)
        assert encode_request(ours, messages=chat) == encode_request(hf, messages=chat)
    assert not loads  # all answered without transformers


def test_special_and_added_tokens_are_transformers(pair):
    ours, hf, loads = pair
    assert len(ours) == len(hf)
    for name in light_tokenizer.NAMED_TOKENS:
        assert getattr(ours, name) == getattr(hf, name), name
        assert getattr(ours, name + "_id") == getattr(hf, name + "_id"), name
    assert ours.special_tokens_map == hf.special_tokens_map
    for token, token_id in hf.get_added_vocab().items():
        assert ours.convert_tokens_to_ids(token) == token_id == hf.convert_tokens_to_ids(token)
    assert ours.convert_tokens_to_ids("certainly-not-a-token-🚀") == hf.convert_tokens_to_ids("certainly-not-a-token-🚀")
    assert not loads  # all answered without transformers


@pytest.mark.parametrize("stop", [(), ("o w",), ("🎉",)])
def test_incremental_detokenization_is_transformers(pair, stop):
    ours, hf, loads = pair
    prompt = hf("Say something:")["input_ids"]
    for text in TEXTS[4:10] + special_texts(hf)[:1]:
        ids = hf.encode(text, add_special_tokens=False)
        runs = []
        for tok in (ours, hf):
            detok = IncrementalDetokenizer(tok, prompt, list(stop))
            pieces = [detok.add(t)[0] for t in ids] + [detok.flush()]
            runs.append((pieces, detok.stopped))
        assert runs[0] == runs[1], text
    assert not loads  # all answered without transformers


def test_what_it_does_not_cover_is_answered_by_transformers(pair):
    ours, hf, loads = pair
    assert ours.all_special_ids == hf.all_special_ids  # not reproduced: transformers' own answer
    assert len(loads) == 1  # loaded once, on the first such question
    assert ours.convert_ids_to_tokens([0, 1, 2]) == hf.convert_ids_to_tokens([0, 1, 2])
    text = TEXTS[5]
    assert ours(text, return_offsets_mapping=True)["offset_mapping"] == hf(text, return_offsets_mapping=True)[
        "offset_mapping"]
    assert ours.decode([[1, 2], [3]]) == hf.decode([[1, 2], [3]])
    if hf.chat_template:
        assert ours.apply_chat_template(CHATS[0])["input_ids"] == hf.apply_chat_template(CHATS[0])["input_ids"]


@pytest.fixture(scope="session")
def tiny_llama():
    """tiny-llama from the usual cache (before a test points TOKENMILL_CACHE elsewhere)."""
    return cached_tiny_model("tiny-llama")


@pytest.fixture
def own_cache(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("TOKENMILL_CACHE", str(cache_with_built_kernels(tmp_path / "cache")))
    return tmp_path


def copy_of(folder, where):
    return shutil.copytree(folder, where / folder.name)


def test_a_tokenizer_that_truncates_stays_transformers(own_cache, tiny_llama):
    folder = copy_of(tiny_llama, own_cache)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    first, second = load_tokenizer(folder), load_tokenizer(folder)
    assert not isinstance(first, LightTokenizer) and not isinstance(second, LightTokenizer)
    assert light_tokenizer.load_recorded(folder, lambda: None) is False  # recorded as "use transformers"


def test_a_changed_file_makes_a_new_record(own_cache, tiny_llama):
    folder = copy_of(tiny_llama, own_cache)
    text = "<|im_start|>user hello<|im_end|>"
    before = load_tokenizer(folder)
    assert isinstance(before, LightTokenizer)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    assert light_tokenizer.load_recorded(folder, lambda: None) is None  # the key no longer matches
    after = load_tokenizer(folder)
    assert isinstance(after, LightTokenizer) and after.chat_template.startswith("{% for m in")
    assert after.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi"
    assert after(text)["input_ids"] == before(text)["input_ids"]


def test_a_damaged_record_is_made_again(own_cache, tiny_llama):
    folder = copy_of(tiny_llama, own_cache)
    assert isinstance(load_tokenizer(folder), LightTokenizer)
    entry = disk_cache.entry_path(light_tokenizer.RECORD_KIND, folder, light_tokenizer.RECORD_SUFFIX)
    header = entry.read_bytes().split(b"\n", 1)[0]
    entry.write_bytes(header + b"\n{not a tokenizer")
    assert light_tokenizer.load_recorded(folder, lambda: None) is None
    assert isinstance(load_tokenizer(folder), LightTokenizer)
    assert isinstance(light_tokenizer.load_recorded(folder, lambda: None), LightTokenizer)


@pytest.mark.slow
def test_an_engine_on_a_recorded_checkpoint_never_imports_transformers(own_cache, tiny_llama):
    folder = tiny_llama
    load_tokenizer(folder)  # the record
    code = f"""
import sys
from tokenmill.engine import EngineConfig, EngineRequest, SamplingParams, create_engine
engine = create_engine(EngineConfig(model={str(folder)!r}, kv_cache_gb=0.05))
out = engine.generate([
    EngineRequest("p", prompt="Hello there", sampling=SamplingParams(max_tokens=8, temperature=0.0, stop=["zz"])),
    EngineRequest("m", messages=[{{"role": "user", "content": "hi"}}],
                  sampling=SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)),
])
assert all(o.output_token_ids and o.output_text is not None for o in out.values()), out
print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
