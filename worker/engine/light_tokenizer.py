"""The engine's tokenizer without importing transformers on its start path.

Why: importing transformers and building its tokenizer cost 1.35-1.55 CPU seconds of SmolLM2's
engine start on a 2-core EPYC (transformers' import alone 0.6-1.0), against 0.13 for the
`tokenizers` library reading the same tokenizer.json.

How it stays exact: what transformers does to a checkpoint's tokenizer while it loads it (the class
it picks for the model type, tokens it adds, a post-processor it rebuilds) is not copied here;
transformers does it, once, and its result is kept. At the first start on a checkpoint folder the
tokenizer is loaded with transformers as before, and where it is a fast tokenizer whose class
encodes, decodes and renders chat templates as transformers' generic `TokenizersBackend` does (no
override of those methods, no truncation, padding, clean-up of spaces or splitting of special
tokens), its Rust tokenizer is serialised into a record under $TOKENMILL_CACHE/tokenizers with what
the engine reads of the rest (named special tokens and their ids, the chat template), but only
after probes agree: texts with special tokens, unicode and whitespace encoded with and without
special tokens, decoded with and without skipping them, and the chat template rendered and encoded
with and without a generation prompt and a system message. Otherwise the record says to keep
transformers' tokenizer, which later starts then load as before. Later starts read the record
(keyed by the folder's tokenizer files and the transformers and tokenizers versions) and build the
same Rust tokenizer in 0.1-0.2 s.

LightTokenizer answers what the engine asks of a tokenizer (encode a prompt, render and encode a
chat, decode, the vocabulary's size, the Rust backend for incremental detokenisation, special token
ids) the way transformers would; any other attribute, or a call with arguments it does not cover,
goes to the transformers tokenizer it stands for, loaded then (eval's harness asks for more).
"""

from __future__ import annotations

import copy
import importlib.metadata
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.engine import chat_template, disk_cache

log = logging.getLogger(__name__)

RECORD_KIND = "tokenizers"
RECORD_SUFFIX = ".tok"
RECORD_VERSION = 1
# Records kept (one per checkpoint folder): older ones are removed when a new one is written.
KEEP_RECORDS = 64

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Methods of transformers' TokenizersBackend whose behaviour LightTokenizer reproduces: a tokenizer
# class that overrides any of them is not replaced.
REPRODUCED_METHODS = ("__call__", "encode", "_encode_plus", "decode", "_decode", "apply_chat_template",
                      "get_chat_template", "convert_tokens_to_ids", "_convert_token_to_id_with_added_voc",
                      "__len__", "set_truncation_and_padding")

PROBE_TEXTS = (
    "Hello world", "", " ", "  leading spaces\nand\ttabs\r\n", "naïve café, ünïcode: 東京, Ελληνικά, emoji 🚀👍🏽",
    "numbers 1234567 3.14159 and punctuation!?;:", "don't won't y'all", "\u00a0non-breaking\u2009thin space",
    "a" * 64, "<html><body class=\"x\">tags</body></html>", "mixed\x00control\x07chars",
)
PROBE_CHATS = (
    [{"role": "user", "content": "What is Kafka?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🚀"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "  and\nnow?"}],
)


class LightTokenizer:
    """A checkpoint's tokenizer as transformers would load it, answered by the `tokenizers` library."""

    def __init__(self, name_or_path: str, backend, record: dict[str, Any],
                 load_transformers: Callable[[], Any], transformers_tokenizer: Any = None) -> None:
        self.name_or_path = name_or_path
        self.backend_tokenizer = backend
        self.chat_template: str | None = record["chat_template"]
        self.special_tokens_map: dict[str, str] = dict(record["special_tokens_map"])
        self._named: dict[str, Any] = dict(record["named"])
        self._model_input_names: list[str] = list(record["model_input_names"])
        self._load_transformers = load_transformers
        self._transformers = transformers_tokenizer
        self._lock = threading.Lock()

    # -- what transformers' tokenizer answers, the same way ---------------------------------------
    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if type(text) is not str or kwargs or type(add_special_tokens) is not bool:
            return self.transformers_tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: Any = None, add_special_tokens: bool = True, **kwargs: Any):
        """A plain dict of the model's input names (input_ids, attention_mask) for one string;
        transformers' BatchEncoding for anything else."""
        names = self._model_input_names
        if type(text) is not str or kwargs or type(add_special_tokens) is not bool \
                or not set(names) <= {"input_ids", "attention_mask", "token_type_ids"}:
            return self.transformers_tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)
        encoding = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        out: dict[str, list[int]] = {"input_ids": encoding.ids}
        if "token_type_ids" in names:
            out["token_type_ids"] = encoding.type_ids
        if "attention_mask" in names:
            out["attention_mask"] = encoding.attention_mask
        return out

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if type(token_ids) is int:
            token_ids = [token_ids]
        plain = type(token_ids) in (list, tuple) and all(type(t) is int for t in token_ids)
        if not plain or kwargs.keys() - {"clean_up_tokenization_spaces"} \
                or kwargs.get("clean_up_tokenization_spaces") or type(skip_special_tokens) is not bool:
            return self.transformers_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: Any, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs: Any):
        """Plain messages (chat_template.plain_messages) rendered here, as token ids (tokenize with
        return_dict=False) or text (tokenize=False); anything else through transformers."""
        messages = chat_template.plain_messages(conversation)
        if messages is None or kwargs or not isinstance(self.chat_template, str) \
                or type(add_generation_prompt) is not bool or (tokenize and return_dict):
            return self.transformers_tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                return_dict=return_dict, **kwargs)
        text = chat_template.render(self.chat_template, messages, add_generation_prompt, self.special_tokens_map)
        if not tokenize:
            return text
        return self.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def convert_tokens_to_ids(self, tokens: Any):
        if type(tokens) is str:
            found = self.backend_tokenizer.token_to_id(tokens)
            return found if found is not None else self.unk_token_id
        return self.transformers_tokenizer.convert_tokens_to_ids(tokens)

    # -- everything else: the transformers tokenizer ----------------------------------------------
    @property
    def transformers_tokenizer(self):
        """The transformers tokenizer this one stands for (loaded on first use)."""
        with self._lock:
            if self._transformers is None:
                log.info("loading the transformers tokenizer of %s", self.name_or_path)
                self._transformers = self._load_transformers()
            return self._transformers

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)  # private, or not set yet (copying, unpickling): never load for these
        if name in self._named:
            return self._named[name]
        return getattr(self.transformers_tokenizer, name)


def rust_tokenizer_json(tokenizer: Any) -> str:
    """The tokenizer's Rust `tokenizers.Tokenizer` (a LightTokenizer's or a fast transformers
    tokenizer's) as JSON without padding or truncation: what llguidance.hf.from_tokenizer builds its
    tokenizer from, without llguidance.hf's import of transformers. ValueError for a slow tokenizer."""
    from tokenizers import Tokenizer

    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError("only fast tokenizers (a tokenizer.json) are supported")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


# -- the record ----------------------------------------------------------------------------------
def record_key(model_dir: Path) -> dict[str, Any]:
    """What a record is valid for: the folder's files other than weights, and the versions of the
    libraries that made it (jinja2 renders the same for both, whichever version it is)."""
    import tokenizers

    return {
        "version": RECORD_VERSION,
        "folder": str(model_dir.resolve()),
        "files": disk_cache.folder_identity(model_dir, lambda p: not p.name.endswith(disk_cache.WEIGHT_SUFFIXES)),
        "transformers": _installed_version("transformers"),
        "tokenizers": tokenizers.__version__,
    }


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_recorded(model_dir: Path, load_transformers: Callable[[], Any]) -> LightTokenizer | None | bool:
    """The LightTokenizer the folder's record describes; False where the record says transformers' own
    tokenizer must be used; None where there is no valid record."""
    path = disk_cache.entry_path(RECORD_KIND, model_dir, RECORD_SUFFIX)
    try:
        f = open(path, "rb")
    except OSError:
        return None
    with f:
        header = disk_cache.read_key(f)
        if header is None or header.get("key") != record_key(model_dir):
            return None
        record = header.get("record")
        if not isinstance(record, dict) or not record.get("light"):
            disk_cache.touch(path)
            return False
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_str(f.read().decode("utf-8"))
        except Exception:  # noqa: BLE001 - a damaged record is only a cache miss
            log.warning("ignoring the damaged tokenizer record %s", path)
            return None
    disk_cache.touch(path)
    return LightTokenizer(str(model_dir), backend, record, load_transformers)


def record(model_dir: Path, name_or_path: str, hf: Any, load_transformers: Callable[[], Any]) -> LightTokenizer | None:
    """Compare a LightTokenizer built from the transformers tokenizer `hf` with it; write the
    folder's record either way (where the cache can be written). The LightTokenizer where they agree,
    else None (the caller keeps `hf`)."""
    key = record_key(model_dir)
    light, why = _light_from(name_or_path, hf, load_transformers)
    if light is None:
        log.info("the engine keeps transformers' tokenizer for %s: %s", model_dir, why)
    body = [light.backend_tokenizer.to_str().encode("utf-8")] if light is not None else []
    entry = {"light": light is not None, "reason": why}
    if light is not None:
        entry.update(chat_template=light.chat_template, special_tokens_map=light.special_tokens_map,
                     named=light._named, model_input_names=light._model_input_names)
    try:
        disk_cache.write_entry(disk_cache.entry_path(RECORD_KIND, model_dir, RECORD_SUFFIX),
                               [disk_cache.header_line({"key": key, "record": entry}), *body])
        disk_cache.prune(RECORD_KIND, KEEP_RECORDS)
    except OSError as exc:
        log.info("cannot write the tokenizer record of %s (%s): the next start loads transformers again",
                 model_dir, exc)
    return light


def _light_from(name_or_path: str, hf: Any, load_transformers: Callable[[], Any]) -> tuple[LightTokenizer | None, str]:
    """(a LightTokenizer equal to `hf`, "") or (None, why not)."""
    from tokenizers import Tokenizer
    from transformers import TokenizersBackend

    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(hf, TokenizersBackend) or not isinstance(backend, Tokenizer):
        return None, f"{type(hf).__name__} is not a fast tokenizer"
    overridden = [m for m in REPRODUCED_METHODS if getattr(type(hf), m) is not getattr(TokenizersBackend, m)]
    if overridden:
        return None, f"{type(hf).__name__} overrides {', '.join(overridden)}"
    if backend.truncation is not None or backend.padding is not None:
        return None, "its tokenizer.json truncates or pads"
    if hf.split_special_tokens or backend.encode_special_tokens or hf.clean_up_tokenization_spaces:
        return None, "it splits special tokens or cleans up spaces"
    template = hf.chat_template
    if template is not None and (not isinstance(template, str) or not chat_template.jinja2_is_recent_enough()):
        return None, "its chat templates are named or jinja2 is older than 3.1.6"
    special = hf.special_tokens_map
    if not all(isinstance(v, str) for v in special.values()):
        return None, "a special token is not a string"
    named: dict[str, Any] = {}
    for name in NAMED_TOKENS:
        value = getattr(hf, name)
        named[name] = None if value is None else str(value)
        named[name + "_id"] = getattr(hf, name + "_id")
    record = {"chat_template": template, "special_tokens_map": dict(special), "named": named,
              "model_input_names": list(hf.model_input_names)}
    light = LightTokenizer(name_or_path, Tokenizer.from_str(backend.to_str()), record, load_transformers, hf)
    why = _disagreement(light, hf)
    return (None, why) if why else (light, "")


def _disagreement(light: LightTokenizer, hf: Any) -> str:
    """The first probe on which `light` and `hf` differ, or ""."""
    if len(light) != len(hf):
        return f"vocabulary sizes {len(light)} and {len(hf)}"
    specials = [str(t) for t in hf.all_special_tokens]
    texts = [*PROBE_TEXTS, " ".join(specials), "".join(f"x{t}y " for t in specials)]
    for text in texts:
        for add in (True, False):
            ours, theirs = light(text, add_special_tokens=add), hf(text, add_special_tokens=add)
            if any(ours[k] != theirs[k] for k in ours) or set(ours) != set(theirs.keys()):
                return f"encodings of {text!r} (add_special_tokens={add})"
            if light.encode(text, add_special_tokens=add) != hf.encode(text, add_special_tokens=add):
                return f"encode of {text!r}"
        ids = hf(text)["input_ids"]
        for skip in (True, False):
            if light.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
                return f"decoding of {text!r} (skip_special_tokens={skip})"
    for token in specials:
        if light.convert_tokens_to_ids(token) != hf.convert_tokens_to_ids(token):
            return f"the id of {token!r}"
    if light.chat_template is not None:
        for chat in PROBE_CHATS:
            for prompt in (True, False):
                try:
                    theirs = hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
                except Exception:  # noqa: BLE001 - a template that refuses the probe is compared by raising
                    theirs = None
                try:
                    ours = light.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
                except Exception:  # noqa: BLE001
                    ours = None
                if ours != theirs:
                    return "the chat template's text"
                if theirs is not None and light.apply_chat_template(
                        chat, add_generation_prompt=prompt, return_dict=False) != hf.apply_chat_template(
                        chat, add_generation_prompt=prompt, return_dict=False):
                    return "the chat template's ids"
    return ""
