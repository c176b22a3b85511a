"""How big each measurement is: the GPU sizes (Sizes' defaults) and the dry run's toy sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LLAMA_1B = dict(  # Llama-3.2-1B shape
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
    max_position_embeddings=4096, rope_theta=500000.0,
)
FIDELITY_LLAMA = dict(  # small enough to build and run in seconds, big enough to have real GQA and depth
    vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    max_position_embeddings=1024,
)
# The dry run's model: one KV head for the four query heads (GQA still, at half the interpreted attention
# programs of two: the dry run 39 -> 32 s on 2 cores).
TOY_LLAMA = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
    max_position_embeddings=256,
)


@dataclass
class Sizes:
    """Every size a section reads; the defaults are the GPU run's."""

    dry_run: bool = False
    kernel_dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    gpu_kernel_cases: bool = True
    copy_mib: int = 2048
    # attention: (label, decode rows, context per row, forced splits or None)
    attention_runs: list[tuple[str, int, int, int | None]] = field(default_factory=lambda: [
        ("decode b64 ctx4096", 64, 4096, None),
        ("decode b256 ctx1024", 256, 1024, None),
        ("decode b8 ctx16384 no split", 8, 16384, 1),
        ("decode b8 ctx16384 split-KV", 8, 16384, None),
    ])
    attention_heads: tuple[int, int, int] = (32, 8, 64)  # heads, kv heads, head_dim
    # invariance: sequence lengths (the first is the target), the fixed key cut, the chunk's length
    invariance_lengths: tuple[int, ...] = (3000, 1, 700, 64, 2048, 17, 4095)
    invariance_split_keys: int = 512
    invariance_chunk: int = 600
    block_size: int = 16
    model_shape: dict[str, Any] = field(default_factory=lambda: dict(LLAMA_1B))  # Hugging Face LlamaConfig fields
    model_dtype: str = "bfloat16"
    decode_batches: tuple[int, ...] = (64, 256)
    decode_context: int = 512
    bench_iters: int = 20
    throughput_seqs: int = 256
    throughput_len_range: tuple[int, int] = (100, 1024)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_gb: float | None = 32.0
    # `mixed` (engine issue, tools/bench.py): requests; the dry run clips prompts/outputs to these ranges
    mixed_requests: int = 256
    mixed_prompt_range: tuple[int, int] = (16, 512)
    mixed_output_range: tuple[int, int] = (16, 256)
    baseline_batches: tuple[int, ...] = (8, 32, 64)
    baseline_probe: int = 64
    # `structured` (structured-output issue, tools/bench_structured.py): requests over the 8 schemas,
    # and the constrained pass's max_tokens
    structured_requests: int = 256
    structured_max_tokens: int = 256
    # fidelity: prompts (lengths in the range), greedy tokens each, on a small fp32 Llama
    fidelity_prompts: int = 32
    fidelity_prompt_range: tuple[int, int] = (8, 200)
    fidelity_tokens: int = 32
    fidelity_shape: dict[str, Any] = field(default_factory=lambda: dict(FIDELITY_LLAMA))


def gpu_sizes() -> Sizes:
    return Sizes()


def dry_sizes() -> Sizes:
    """The same code path on the CPU, at sizes that run in seconds."""
    return Sizes(
        dry_run=True, kernel_dtypes=("float32",), gpu_kernel_cases=False, copy_mib=4,
        attention_runs=[("decode b2 ctx40", 2, 40, None), ("decode b2 ctx40 split", 2, 40, 2)],
        attention_heads=(4, 2, 32), invariance_lengths=(150, 9, 40), invariance_split_keys=64, invariance_chunk=30,
        model_shape=dict(TOY_LLAMA), model_dtype="float32",
        decode_batches=(2, 4), decode_context=12, bench_iters=1,
        throughput_seqs=4, throughput_len_range=(4, 8),
        max_num_seqs=8, max_num_batched_tokens=256, kv_cache_gb=0.05,
        mixed_requests=4, mixed_prompt_range=(4, 20), mixed_output_range=(2, 4),
        baseline_batches=(2, 4), baseline_probe=4, structured_requests=8, structured_max_tokens=12,
        fidelity_prompts=3, fidelity_prompt_range=(3, 9), fidelity_tokens=3, fidelity_shape=dict(TOY_LLAMA),
    )
