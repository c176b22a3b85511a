"""load_transformers_tokenizer gives AutoTokenizer a plain config where that picks the same tokenizer:
the same class, vocabulary, encodings, chat prompts and texts as AutoTokenizer on its own, without
importing the model's config class (and with it torch.distributed, accelerate and sympy)."""

import subprocess
import sys

import pytest

from tokenmill.engine.tokenizer import load_transformers_tokenizer
from tokenmill.tools.smollm2 import cached_smollm2, unavailable_reason
from tokenmill.tools.tiny_models import cached_tiny_model

TEXTS = ["Hello world", "naïve café, ünïcode and 123 numbers", "  leading spaces\nand\ttabs", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Kafka?"}]


@pytest.fixture(scope="module", params=["test-llama", "test-qwen2", "test-qwen3", "tiny-llama", "smollm2"])
def model_dir(request):
    if request.param == "smollm2":
        if unavailable_reason():
            pytest.skip(unavailable_reason())
        return cached_smollm2()
    return cached_tiny_model(request.param)


def test_the_light_config_picks_the_tokenizer_autotokenizer_picks(model_dir):
    from transformers import AutoTokenizer

    ours = load_transformers_tokenizer(model_dir)
    theirs = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert type(ours) is type(theirs) and len(ours) == len(theirs)
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
    ids = ours(TEXTS[1])["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.chat_template == theirs.chat_template
    if theirs.chat_template:
        assert ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False) == \
            theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.slow
def test_loading_the_tokenizer_leaves_the_model_config_classes_unimported():
    code = ("import sys, pathlib; from tokenmill.engine.tokenizer import load_transformers_tokenizer; "
            f"load_transformers_tokenizer(pathlib.Path({str(cached_tiny_model('tiny-llama'))!r})); "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.llama', "
            "'torch.distributed.tensor', 'accelerate'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
