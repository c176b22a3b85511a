"""Tokenizer of a checkpoint directory (offline) and the one way a request becomes token ids."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.engine.checkpoint_files import (
    CONFIG_FILE,
    MODEL_TYPES,
    CheckpointError,
    has_tokenizer,
    no_tokenizer_message,
    read_json,
)

TOKENIZER_CONFIG = "tokenizer_config.json"


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer, never downloading anything: a LightTokenizer (light_tokenizer.py:
    the `tokenizers` library, no transformers import) where the folder's record says it equals
    transformers' tokenizer, else transformers' own. The first load of a folder uses transformers
    and writes that record."""
    from tokenmill.engine import light_tokenizer

    model_dir = Path(path)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    if not has_tokenizer(model_dir):
        raise CheckpointError(no_tokenizer_message(model_dir))

    def with_transformers():
        return load_transformers_tokenizer(model_dir)

    recorded = light_tokenizer.load_recorded(model_dir, with_transformers)
    if recorded:
        return recorded
    hf = with_transformers()
    if recorded is None:  # no record yet (or an outdated one): compare the two and write it
        return light_tokenizer.record(model_dir, str(model_dir), hf, with_transformers) or hf
    return hf


def load_transformers_tokenizer(model_dir: Path):
    """AutoTokenizer from the checkpoint directory, never downloading anything.

    Where tokenizer_config.json names its tokenizer class and config.json is of a model type we
    serve (the usual case), AutoTokenizer is given config.json as a plain PretrainedConfig: for
    these types it then takes the class the file names, as it does with the model's own config
    class, whose import pulls in torch.distributed, accelerate and sympy, 1-2 s of an engine's
    start on a 2-core EPYC (tests/test_tokenizer_load.py holds the two ways equal)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **_light_config(model_dir))
    except Exception as exc:  # transformers raises many types (OSError, ValueError, ...) for bad files
        raise CheckpointError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc


def _light_config(model_dir: Path) -> dict[str, Any]:
    """{"config": config.json as a plain PretrainedConfig} where that picks the tokenizer AutoTokenizer's
    own config would (see load_transformers_tokenizer), else {} (AutoTokenizer's own way)."""
    try:
        named = read_json(model_dir / TOKENIZER_CONFIG).get("tokenizer_class")
        config = read_json(model_dir / CONFIG_FILE)
    except (OSError, CheckpointError):
        return {}
    if not isinstance(named, str) or config.get("model_type") not in MODEL_TYPES:
        return {}
    from transformers import PretrainedConfig

    # from_dict keeps config.json's model_type on the instance: AutoTokenizer's choices by model type
    # read it as they would on the model's own config class.
    return {"config": PretrainedConfig.from_dict(config)}


def _validate_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
    return messages


def encode_request(
    tokenizer,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> list[int]:
    """Token ids of exactly one of prompt / messages / prompt_token_ids.

    `prompt` is encoded as-is with the tokenizer's own special-token handling (e.g. a BOS where the
    model has one), like transformers' generate input; `messages` go through the chat template with the
    assistant generation prompt appended; `prompt_token_ids` are checked against the vocabulary.
    """
    given = [x is not None for x in (prompt, messages, prompt_token_ids)]
    if sum(given) != 1:
        raise ValueError("exactly one of prompt, messages, prompt_token_ids is required")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        ids = tokenizer(prompt)["input_ids"]
    elif messages is not None:
        messages = _validate_messages(messages)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages were given but this model's tokenizer has no chat template; send a prompt instead")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some transformers versions
            ids = ids["input_ids"]
    else:
        assert prompt_token_ids is not None
        ids = list(prompt_token_ids)
        vocab = len(tokenizer)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("the prompt encodes to zero tokens")
    return ids
