"""Engine flags shared by the offline commands (run-batch, bench): one definition, one mapping."""

from __future__ import annotations

import argparse
from typing import Any


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_engine_options(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    e = parser.add_argument_group("engine")
    if model_required:
        e.add_argument("--model", required=True, help="checkpoint directory or s3://bucket/prefix/")
    e.add_argument("--served-model-name", default=None, help="model name in Results (default: directory name)")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    e.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    e.add_argument("--block-size", type=positive_int, default=16, help="KV cache block size in tokens")
    e.add_argument("--kv-cache-gb", type=positive_float, default=None,
                   help="KV cache size (default: a fraction of free GPU memory; 2 GiB on CPU)")
    e.add_argument("--gpu-memory-fraction", type=positive_float, default=0.85)
    e.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget per step")
    e.add_argument("--max-num-seqs", type=positive_int, default=256, help="sequences per step")
    e.add_argument("--max-model-len", type=positive_int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    e.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    e.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off", "eager"],
                   help="decode steps as CUDA graphs (auto: on for CUDA with the triton backend; "
                        "eager: the same padded path without capture)")
    e.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="prepare step N+1 while step N runs on the GPU (auto: on for CUDA)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments (all but `model`) from parsed flags."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        kv_cache_gb=args.kv_cache_gb,
        gpu_memory_fraction=args.gpu_memory_fraction,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        served_model_name=args.served_model_name,
        seed=args.seed,
        cuda_graphs=args.cuda_graphs,
        async_scheduling=args.async_scheduling,
    )
