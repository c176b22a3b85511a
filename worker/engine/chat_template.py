"""Chat templates rendered the way transformers' `apply_chat_template` renders them, without
importing transformers (seconds of an engine's start on a small shared CPU).

A chat template is Jinja code from the model's folder, i.e. untrusted: transformers runs it in
jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loop-controls
extension, a `{% generation %}` tag (its body rendered as it is; transformers only records where it
was, for assistant masks), a `tojson` filter that does not escape HTML, and the globals
`raise_exception`, `strftime_now`, a `dict` that only builds dicts and a `namespace` that refuses
underscore names. This module builds the same environment (transformers 5's
utils/chat_template_utils.py), so a template renders to the same text; the engine's tokenizer
(light_tokenizer.py) checks that on the model's own template before it relies on it, and a test holds
the two equal on every local checkpoint.

Only the plain case is here: one conversation of messages whose values are strings, no tools, no
documents, no continued final message. Anything else goes through transformers itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

# jinja2 releases before this one have known sandbox escapes; transformers refuses them too.
MIN_JINJA2 = (3, 1, 6)


def jinja2_is_recent_enough() -> bool:
    import jinja2

    try:
        version = tuple(int(part) for part in jinja2.__version__.split(".")[:3])
    except ValueError:
        return False
    return version >= MIN_JINJA2


@lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in transformers' sandboxed environment (cached by its text)."""
    import jinja2

    if not jinja2_is_recent_enough():  # as transformers refuses it
        raise ImportError(f"chat templates need jinja2>=3.1.6, found {jinja2.__version__}")
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: the body, rendered in place."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # dict(...) and dict.fromkeys(...) only: no attribute access to the type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # No underscore names: they would reach CPython internals
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def plain_messages(conversation: Any) -> list[dict[str, str]] | None:
    """The conversation as a fresh list of {role, content} dicts of plain strings, or None where it
    holds anything else (more keys, other types, a batch): transformers' own path takes those."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        return None
    messages = []
    for message in conversation:
        if type(message) is not dict or set(message) != {"role", "content"}:
            return None
        if type(message["role"]) is not str or type(message["content"]) is not str:
            return None
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def render(source: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
           special_tokens: Mapping[str, str]) -> str:
    """The text transformers' apply_chat_template(messages, add_generation_prompt=..., tokenize=False)
    gives for plain messages (plain_messages): the template sees the messages, tools and documents
    as None, add_generation_prompt and the tokenizer's named special tokens (bos_token, ...)."""
    return compile_template(source).render(
        messages=[dict(m) for m in messages], tools=None, documents=None,
        add_generation_prompt=add_generation_prompt, **special_tokens,
    )
