"""KV write, RMSNorm (+residual), rotary and SiLU-and-mul kernels vs torch, under the interpreter."""

import pytest
import torch

from tokenmill.kernels.checks import (
    TOLERANCE,
    kv_write_mismatches,
    rms_norm_error,
    rotary_error,
    silu_mul_error,
)
from tokenmill.kernels.kv_write import kv_write
from tokenmill.kernels.rmsnorm import rms_norm
from tokenmill.kernels.rotary import rope_cos_sin_cache, rotary_embedding
from tokenmill.kernels.silu_mul import silu_mul

DTYPES = [torch.float32, torch.float16]


# Tokens per program: the GPU's one, a tile that leaves the last program part-filled (9 tokens in
# tiles of 4), and the interpreter's default (all 9 in one program).
@pytest.mark.parametrize("tokens_per_program", [1, 4, None])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_write_matches_reference_and_skips_padding(dtype, tokens_per_program):
    assert kv_write_mismatches(dtype, "cpu", tokens_per_program=tokens_per_program) == 0


@pytest.mark.parametrize("tokens_per_program", [1, 2, None])
def test_kv_write_touches_only_mapped_slots(tokens_per_program):
    cache_k = torch.zeros(3, 4, 2, 16)
    cache_v = torch.zeros(3, 4, 2, 16)
    key = torch.arange(1, 4).view(3, 1, 1).expand(3, 2, 16).float()
    kv_write(key, 2 * key, cache_k, cache_v, torch.tensor([5, -1, 11], dtype=torch.int32), tokens_per_program)
    written = cache_k.view(-1, 2, 16).abs().sum(dim=(1, 2)) > 0
    assert written.nonzero().flatten().tolist() == [5, 11]
    assert torch.equal(cache_k.view(-1, 2, 16)[5], key[0]) and torch.equal(cache_v.view(-1, 2, 16)[11], 2 * key[2])
    with pytest.raises(ValueError, match="power of two"):
        kv_write(key, key, cache_k, cache_v, torch.tensor([5, -1, 11]), tokens_per_program=3)


def test_kv_write_rejects_bad_shapes():
    with pytest.raises(ValueError, match="one slot per token"):
        kv_write(torch.ones(3, 2, 16), torch.ones(3, 2, 16), torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16),
                 torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="do not match"):
        kv_write(torch.ones(3, 1, 16), torch.ones(3, 1, 16), torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16),
                 torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    assert rms_norm_error(dtype, "cpu", hidden=hidden, with_residual=with_residual) <= TOLERANCE[dtype]


def test_rms_norm_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(96)
    x, res = torch.randn(2, 3, 96), torch.randn(2, 3, 96)
    torch.testing.assert_close(rms_norm(x, norm.weight.data, 1e-5), norm(x), atol=1e-5, rtol=0)
    out, new_res = rms_norm(x, norm.weight.data, 1e-5, residual=res)
    torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
    torch.testing.assert_close(out, norm(x + res), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary(dtype, head_dim):
    assert rotary_error(dtype, "cpu", head_dim=head_dim) <= TOLERANCE[dtype]


def test_rotary_matches_transformers_llama():
    """Same convention (NeoX halves) and same frequencies as Hugging Face's Llama rotary."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    rope = LlamaRotaryEmbedding(config)
    torch.manual_seed(0)
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    positions = torch.tensor([0, 3, 9, 63, 17])
    cos, sin = rope(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    table = rope_cos_sin_cache(rope.inv_freq, 64, rope.attention_scaling)
    ours_q, ours_k = rotary_embedding(positions, q.clone(), k.clone(), table)
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_rotary_partial_rot_dim_leaves_the_rest():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    table = rope_cos_sin_cache(inv_freq, 8)  # rot_dim 16 of head_dim 32
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(torch.tensor([1, 2, 3]), q, k, table)
    assert torch.equal(q[..., 16:], q0[..., 16:]) and torch.equal(k[..., 16:], k0[..., 16:])
    assert not torch.equal(q[..., :16], q0[..., :16])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [8, 300, 1500])
def test_silu_mul(dtype, inter):
    assert silu_mul_error(dtype, "cpu", inter=inter) <= TOLERANCE[dtype]


def test_silu_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="odd"):
        silu_mul(torch.ones(2, 5))
