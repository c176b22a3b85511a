"""Section `structured`: the bench's structured workload (tools/bench_structured.py) on the GPU path:
256 rows constrained to 8 JSON schemas against the same rows unconstrained with the same lengths.

Needs llguidance (the engine's constraint backend) and jsonschema (the output check) besides the
package's usual torch, triton, transformers and safetensors; without them the section fails with
the import error and the others run on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.tools.gpu_check.engine_path import engine_options, gpu_path_report

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def section_structured(ctx: Context) -> dict:
    """Step-time overhead of constrained rows at the peak batch, mask fill and compile percentiles,
    and the output checks. The figures are reported as measured; the section fails (ok False) only
    when an output breaks its constraint: a "stop" output that does not validate, whitespace outside
    strings, a constraint that did not compile, or a request that did not finish."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.tools.bench_structured import run_structured
    from tokenmill.tools.structured_workload import structured_workload

    sizes = ctx.sizes
    model_dir = ctx.model_dir()
    mc = load_model_config(model_dir)
    work = structured_workload(mc.vocab_size, sizes.structured_requests, seed=0,
                               max_tokens=sizes.structured_max_tokens, special=set(mc.eos_token_ids))
    report = run_structured(model_dir, work, engine_options(ctx), on_engine=gpu_path_report)
    report["ok"] = (report["valid"] == report["stop"] and report["whitespace_runs"] == 0
                    and report["constraint_failures"] == 0 and report["other_finish"] == 0)
    return report
