"""Seeded random-weight checkpoints for tests and benchmarks, built offline with transformers.

Nothing here downloads: the tokenizer is a small byte-level BPE trained on a built-in corpus and
padded with pseudo-word tokens up to the model's vocabulary size, so every token id decodes to
readable text. Checkpoints are written like any Hugging Face directory (config.json,
model.safetensors, tokenizer files with a ChatML chat template) and cached by preset name.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Preset shapes. "tiny-llama" is the benchmark model of the engine issue; the test-* presets are
# small enough that a fidelity run takes seconds on 2 CPU cores.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        arch="llama", vocab_size=32000, hidden_size=256, intermediate_size=688,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    ),
    "test-llama": dict(
        arch="llama", vocab_size=2048, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "test-qwen2": dict(
        arch="qwen2", vocab_size=2048, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ),
    "test-qwen3": dict(
        arch="qwen3", vocab_size=2048, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    ),
}
PRESET_VERSION = "v1"  # bump when a builder change alters the weights or tokenizer


def cache_root() -> Path:
    root = os.environ.get("TOKENMILL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
    return Path(root)


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(tmp)` into a temporary directory beside it and renamed into place
    the first time (a reader never sees a half-written directory). Concurrent builders (test
    workers, worker processes) take turns on a lock file beside it, so one builds and the others
    find it built. A directory with a config.json counts as built."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / "config.json").exists():
            return target
        return _build_into_place(target, build)


def _build_into_place(target: Path, build: Callable[[Path], None]) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race with another builder: fine
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _corpus() -> list[str]:
    rng = random.Random(1234)
    words = (
        "the of and to in is you that it he was for on are as with his they at be this have from "
        "or one had by word but not what all were we when your can said there use an each which she "
        "do how their if will up other about out many then them these so some her would make like "
        "him into time has look two more write go see number no way could people my than first "
        "water been call who oil its now find long down day did get come made may part kafka token "
        "model batch prompt cache block queue worker result offset partition stream job translate "
        "french good morning hello world answer question summary data label review"
    ).split()
    lines = []
    for _ in range(3000):
        n = rng.randint(4, 16)
        lines.append(" ".join(rng.choice(words) for _ in range(n)) + rng.choice([".", "!", "?", ","]))
    lines += ["0123456789 " * 3, "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz", "Bonjour! Ça va?"]
    return lines


def _pseudo_words(count: int, taken: set[str]) -> list[str]:
    """Readable filler tokens ('Ġ' is byte-level BPE's leading space)."""
    rng = random.Random(99)
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    out: list[str] = []
    while len(out) < count:
        syll = rng.randint(1, 3)
        word = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(syll))
        tok = ("Ġ" if rng.random() < 0.7 else "") + word
        if tok not in taken:
            taken.add(tok)
            out.append(tok)
    return out


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly `vocab_size` ids and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 1000),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    missing = vocab_size - len(vocab)
    if missing < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the base vocabulary {len(vocab)}")
    for word in _pseudo_words(missing, set(vocab)):
        vocab[word] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def build_tiny_model(out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0, *, dtype: str = "float32",
                     device: Any = None, **shape: Any) -> Path:
    """Write a seeded random-weight checkpoint of `arch` (llama, qwen2, qwen3) to out_dir.

    The weights are initialised on `device` (default the CPU; a GPU builds a 1B model in seconds)
    and saved as `dtype` (a torch dtype name)."""
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    if arch not in classes:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(classes)}")
    config_cls, model_cls = classes[arch]
    vocab_size = shape.get("vocab_size", 2048)
    tokenizer = build_tokenizer(vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    shape.setdefault("max_position_embeddings", 2048)
    shape.setdefault("tie_word_embeddings", False)
    config = config_cls(bos_token_id=None, eos_token_id=[eos, im_end], pad_token_id=eos, **shape)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = model_cls(config)
    model = model.to(getattr(torch, dtype)).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return out


def cached_tiny_model(preset: str, seed: int = 0) -> Path:
    """Build a preset checkpoint once and reuse it (atomic: built in a temp dir, then renamed)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    target = cache_root() / "models" / f"{preset}-s{seed}-{PRESET_VERSION}"
    return build_once(target, lambda tmp: build_tiny_model(tmp, seed=seed, **dict(PRESETS[preset])))
