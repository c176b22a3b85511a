"""Section `mixed`: the engine's `mixed` bench workload against transformers `generate`, same GPU
and weights, both sides run by tools/bench.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.tools.gpu_check.context import release_memory
from tokenmill.tools.gpu_check.engine_path import engine_options, gpu_path_options

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def section_mixed(ctx: Context) -> dict:
    """The workload, the engine run and the baseline come from tools/bench.py; the baseline's batch
    is the best of {8, 32, 64} on the first 64 requests (bench's calibration rule), then it runs the
    whole workload. The dry run clips prompts and outputs to toy lengths."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.tools import bench

    sizes = ctx.sizes
    model_dir = ctx.model_dir()
    mc = load_model_config(model_dir)
    work = bench.mixed_workload(mc.vocab_size, sizes.mixed_requests, seed=0, special=set(mc.eos_token_ids))
    if sizes.dry_run:
        work = bench.Workload(work.name, [p[: sizes.mixed_prompt_range[1]] for p in work.prompts],
                              [min(n, sizes.mixed_output_range[1]) for n in work.max_tokens])
    engine = bench.run_engine(model_dir, work, engine_options(ctx))
    release_memory(ctx.device)
    base = bench.run_hf_baseline(model_dir, work, sizes.model_dtype, device=ctx.device,
                                 batches=sizes.baseline_batches, calibration_requests=sizes.baseline_probe)
    return dict(requests=len(work.prompts), prompt_tokens=work.prompt_tokens, output_tokens=work.output_tokens,
                engine_seconds=engine.wall_s, engine_output_tok_s=engine.output_tok_s, engine_steps=engine.steps,
                engine_overhead_fraction=engine.engine_overhead_fraction,
                kv_slot_utilization_peak=engine.kv_slot_utilization_peak, baseline_batch=base.batch_size,
                baseline_probe_tok_s=base.calibration, baseline_seconds=base.wall_s,
                baseline_output_tok_s=base.output_tok_s, ratio=engine.output_tok_s / base.output_tok_s,
                **gpu_path_options(ctx.device))
