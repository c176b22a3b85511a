"""The Triton attention backend inside the model and the engine, under the Triton interpreter.

Fidelity: with attention_backend="triton" forced, greedy output of the engine on the tiny Llama equals
transformers `generate` token for token (fp32, CPU), over a batch that mixes prefill and decode rows.
"""

import pytest
import torch

from tokenmill.engine.attention import AttentionMetadata, get_attention_backend
from tokenmill.engine.attention.triton_backend import TritonAttentionBackend
from tokenmill.kernels.checks import AttentionCase, make_attention_inputs
from tokenmill.kernels.paged_attention import paged_attention_ref


def test_factory_gives_the_triton_backend():
    backend = get_attention_backend("triton", "cpu")
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"


@pytest.mark.parametrize("num_splits", [None, 2])
def test_backend_write_then_attend_matches_reference(num_splits):
    """write_kv puts the step's new K/V where attend finds it (prefill row + decode row)."""
    case = AttentionCase("backend", (5, 1), (3, 18), 6, 2, 32, 8)
    inputs = make_attention_inputs(case, torch.float32, "cpu")
    k_cache, v_cache = inputs["key_cache"], inputs["value_cache"]
    # Overwrite the new tokens' slots with fresh K/V through the backend.
    slots, seq_lens, qsl = [], inputs["seq_lens"].tolist(), inputs["query_start_loc"].tolist()
    for b, seq_len in enumerate(seq_lens):
        q_len = qsl[b + 1] - qsl[b]
        for pos in range(seq_len - q_len, seq_len):
            slots.append(inputs["block_tables"][b, pos // 8].item() * 8 + pos % 8)
    new_k = torch.randn(len(slots), 2, 32)
    new_v = torch.randn(len(slots), 2, 32)
    backend = TritonAttentionBackend(num_splits=num_splits)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    backend.write_kv(new_k, new_v, k_cache, v_cache, torch.tensor(slots))
    ref_k.view(-1, 2, 32)[slots] = new_k
    ref_v.view(-1, 2, 32)[slots] = new_v
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    meta = AttentionMetadata(
        query_start_loc=inputs["query_start_loc"], seq_lens=inputs["seq_lens"], block_tables=inputs["block_tables"],
        slot_mapping=torch.tensor(slots), max_query_len=5, max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    out = backend.attend(inputs["query"], k_cache, v_cache, meta, 32**-0.5)
    ref = paged_attention_ref(inputs["query"], ref_k, ref_v, inputs["block_tables"], inputs["seq_lens"],
                              inputs["query_start_loc"], 32**-0.5)
    assert (out - ref).abs().max().item() <= 1e-5


def test_model_logits_with_triton_equal_torch_backend(tiny_model_dir):
    """Llama, Qwen2 (qkv bias) and Qwen3 (qk-norm, head_dim 32): a prefill step, then a mixed step of a
    decode row and a chunked-prefill row, give the same logits with either backend."""
    from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
    from tokenmill.engine.loader import load_model

    logits = {}
    for name, backend in (("torch", TorchAttentionBackend()), ("triton", TritonAttentionBackend())):
        model, cfg = load_model(tiny_model_dir, dtype="float32", device="cpu", attention_backend=backend)
        shape = (8, 4, cfg.num_kv_heads, cfg.head_dim)
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        tables = torch.tensor([[6, 1, 3], [4, 0, 7]], dtype=torch.int32)
        steps = [  # (rows: (context, new tokens)), token ids
            ([(0, 6), (0, 3)], list(range(10, 19))),
            ([(6, 1), (3, 5)], [50, 60, 61, 62, 63, 64]),
        ]
        outs = []
        for rows, ids in steps:
            qsl, seq_lens, slots, pos = [0], [], [], []
            for b, (ctx, new) in enumerate(rows):
                qsl.append(qsl[-1] + new)
                seq_lens.append(ctx + new)
                for p in range(ctx, ctx + new):
                    slots.append(int(tables[b, p // 4]) * 4 + p % 4)
                    pos.append(p)
            meta = AttentionMetadata(
                query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                block_tables=tables, slot_mapping=torch.tensor(slots), max_query_len=max(n for _, n in rows),
                max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            )
            hidden = model(torch.tensor(ids), torch.tensor(pos), meta, kv)
            outs.append(model.compute_logits(hidden))
        logits[name] = torch.cat(outs)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def _hf_greedy(model_dir, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:  # one at a time: no padding, so the reference is exact
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.mark.slow
def test_engine_with_triton_backend_matches_transformers(tiny_llama_dir):
    from tokenmill.engine.engine import Engine, EngineConfig
    from tokenmill.engine.types import EngineRequest, SamplingParams

    prompts = [[5, 17, 300, 42, 7, 99, 1000, 3, 64, 81, 12, 640, 77, 8, 1500, 23, 4, 9],  # > one block
               [11], [400, 401, 402], [1200, 1201, 9, 9, 9, 33, 2047]]
    max_new = 6
    # A small token budget makes the long prompt prefill in chunks next to the others' decodes.
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", attention_backend="triton",
                                 block_size=4, max_num_batched_tokens=8, kv_cache_gb=0.01))
    assert engine.attention_backend.name == "triton"
    requests = [EngineRequest(request_id=f"r{i}", prompt_token_ids=p,
                              sampling=SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts)]
    results = engine.generate(requests)
    expected = _hf_greedy(tiny_llama_dir, prompts, max_new)
    for i, want in enumerate(expected):
        assert results[f"r{i}"].output_token_ids == want, i
