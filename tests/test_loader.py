"""Checkpoint loading: config parsing, sharded weights, tied embeddings, dtypes, and one clear error per
missing or unsupported thing; tokenizer loading and request encoding."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.paged_helpers import PagedKV, run_step
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
from tokenmill.engine.loader import load_model
from tokenmill.engine.model_config import CheckpointError, load_model_config, resolve_dtype
from tokenmill.engine.tokenizer import encode_request, load_tokenizer


def load(path, **kw):
    return load_model(path, attention_backend=TorchAttentionBackend(), **kw)


@pytest.fixture
def ckpt(tmp_path, tiny_llama_dir):
    """A writable copy of the tiny Llama checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def logits(model, cfg, ids):
    return model.compute_logits(run_step(model, PagedKV.for_model(cfg), [("x", ids)])[0])


def test_config_fields(tiny_qwen3_dir, tiny_llama_dir):
    cfg = load_model_config(tiny_qwen3_dir)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == ("qwen3", 2048, 64, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 32)  # explicit head_dim
    assert cfg.max_model_len == 2048 and cfg.dtype == torch.float32
    assert cfg.qk_norm and not cfg.qkv_bias
    tok = load_tokenizer(tiny_qwen3_dir)
    assert cfg.eos_token_ids == [tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")]
    llama = load_model_config(tiny_llama_dir)
    assert llama.head_dim == 16 and llama.tie_word_embeddings and not llama.qk_norm


def test_eos_from_generation_config_wins(ckpt):
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    edit_config(ckpt, eos_token_id=[1, 2])
    assert load_model_config(ckpt).eos_token_ids == [5]
    (ckpt / "generation_config.json").unlink()
    assert load_model_config(ckpt).eos_token_ids == [1, 2]
    edit_config(ckpt, eos_token_id=7)
    assert load_model_config(ckpt).eos_token_ids == [7]


def test_dtype_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", "bfloat16", cpu) == torch.float32
    assert resolve_dtype("auto", "bfloat16", cuda) == torch.bfloat16
    assert resolve_dtype("fp16", None, cpu) == torch.float16
    assert resolve_dtype(torch.bfloat16, None, cpu) == torch.bfloat16
    with pytest.raises(CheckpointError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", None, cpu)


def test_sharded_checkpoint_loads_like_the_single_file(ckpt):
    single, cfg = load(ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, ckpt / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    (ckpt / "model.safetensors").unlink()
    sharded, _ = load(ckpt)
    ids = list(range(3, 30))
    torch.testing.assert_close(logits(sharded, cfg, ids), logits(single, cfg, ids), atol=0, rtol=0)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="lacks weight shard.*model-00002-of-00002.safetensors"):
        load(ckpt)


def test_lm_head_absent_means_tied(tiny_qwen2_dir, tmp_path):
    dst = tmp_path / "q2"
    shutil.copytree(tiny_qwen2_dir, dst)
    assert not load_model_config(dst).tie_word_embeddings
    tensors = load_file(dst / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    model, cfg = load(dst)
    assert cfg.tie_word_embeddings and model.lm_head is model.embed_tokens


def test_tied_checkpoint_shares_the_embedding(tiny_llama_dir):
    model, cfg = load(tiny_llama_dir)
    assert cfg.tie_word_embeddings and model.lm_head.data_ptr() == model.embed_tokens.data_ptr()


def test_bf16_load(tiny_qwen3_dir):
    model, cfg = load(tiny_qwen3_dir, dtype="bfloat16")
    assert cfg.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize(
    "break_it,message",
    [
        (lambda d: (d / "config.json").unlink(), "has no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), "has no weights: expected model.safetensors"),
        (lambda d: edit_config(d, model_type="gpt2", architectures=["GPT2LMHeadModel"]), "unsupported architecture 'gpt2'"),
        (lambda d: edit_config(d, hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
        (lambda d: edit_config(d, hidden_size=None), "config.json lacks hidden_size"),
        (lambda d: edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "unsupported rope_type 'yarn'"),
        (lambda d: edit_config(d, num_hidden_layers=3), r"lacks tensor\(s\) model.layers.2.input_layernorm.weight"),
        (lambda d: edit_config(d, intermediate_size=100), r"mlp\.\w+_proj\.weight: shape \((128, 64|64, 128)\), expected \((100, 64|64, 100)\)"),
        (lambda d: (d / "config.json").write_text("{not json"), "is not valid JSON"),
    ],
)
def test_broken_checkpoints_name_the_problem(ckpt, break_it, message):
    break_it(ckpt)
    with pytest.raises(CheckpointError, match=message):
        load(ckpt)


def test_missing_and_unexpected_tensors(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    extra = dict(tensors, **{"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    save_file(extra, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="does not use: model.layers.0.mlp.extra.weight"):
        load(ckpt)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks tensor\(s\) model.layers.1.self_attn.k_proj.weight"):
        load(ckpt)


def test_gguf_only_directory_points_to_convert(tmp_path, tiny_llama_dir):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="tokenmill convert"):
        load(tmp_path)


def test_missing_directory():
    with pytest.raises(CheckpointError, match="does not exist"):
        load("/nonexistent/model")


# -- tokenizer ---------------------------------------------------------------------------------


def test_missing_tokenizer_is_a_clear_error(ckpt):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        load_tokenizer(ckpt)


def test_encode_prompt_messages_and_ids(tiny_qwen2_dir):
    tok = load_tokenizer(tiny_qwen2_dir)
    assert encode_request(tok, prompt="hello world") == tok("hello world")["input_ids"]
    msgs = [{"role": "user", "content": "hello"}]
    ids = encode_request(tok, messages=msgs)
    assert tok.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert encode_request(tok, prompt_token_ids=[5, 6, 7]) == [5, 6, 7]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompt="a", prompt_token_ids=[1]), "exactly one of"),
        (dict(), "exactly one of"),
        (dict(prompt_token_ids=[1, 999999]), "outside the vocabulary"),
        (dict(prompt_token_ids=[]), "zero tokens"),
        (dict(prompt=""), "zero tokens"),
        (dict(messages=[{"role": "user"}]), r"messages\[0\] must be an object"),
        (dict(messages=[]), "non-empty list"),
    ],
)
def test_encode_request_errors(tiny_qwen2_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        encode_request(load_tokenizer(tiny_qwen2_dir), **kwargs)


def test_messages_without_chat_template(ckpt):
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(ckpt)
    assert encode_request(tok, prompt="hi")
    with pytest.raises(ValueError, match="no chat template"):
        encode_request(tok, messages=[{"role": "user", "content": "hi"}])
