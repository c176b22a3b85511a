"""The engine as the sections run it: its GPU path forced on, and what the report says it ran."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def gpu_path_options(device) -> dict:
    """The engine's GPU path, forced on: CUDA graphs (captured on CUDA; the same padded path run
    eagerly in a dry run on the CPU) and async scheduling (which on the CPU runs without overlap)."""
    return dict(cuda_graphs="on" if str(device).startswith("cuda") else "eager", async_scheduling="on")


def gpu_path_report(engine) -> dict:
    """What the report records about the GPU path an engine actually ran."""
    return dict(cuda_graphs=engine.graph_mode, async_scheduling=engine.async_scheduling,
                graph_steps=engine.runner.num_graph_steps, engine_steps=engine.stats().steps)


def engine_options(ctx: Context) -> dict[str, Any]:
    """EngineConfig fields (all but the model) of the mixed and throughput runs."""
    sizes = ctx.sizes
    return dict(device=str(ctx.device), dtype=sizes.model_dtype, attention_backend="triton",
                max_num_seqs=sizes.max_num_seqs, max_num_batched_tokens=sizes.max_num_batched_tokens,
                kv_cache_gb=sizes.kv_cache_gb, **gpu_path_options(ctx.device))


def make_engine(ctx: Context, model_dir: Path):
    from tokenmill.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(model_dir), **engine_options(ctx)))
