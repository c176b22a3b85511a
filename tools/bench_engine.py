"""The engine side of the throughput benches: a workload's requests through tokenmill's engine (or
another backend's, through create_engine) after a warm-up, timed, as one EngineRun.

Its own module so that the benches built on it (invariance, kafka, the scaling probe) import it
without importing tools/bench.py, which dispatches to them."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.tools.bench_startup import new_engine, warm_up
from tokenmill.tools.bench_workloads import Workload, warm_up_workload


@dataclass
class EngineRun:
    wall_s: float
    cpu_s: float  # process CPU time of the timed run: on a shared machine, closer to the work done
    output_tokens: int
    prompt_tokens: int
    prefill_tokens_computed: int
    cached_prompt_tokens: int
    kv_slot_utilization_peak: float
    engine_overhead_fraction: float
    peak_running: int
    steps: int
    preemptions: int
    kv_blocks_total: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def engine_requests(work: Workload, tag: str):
    from tokenmill.engine.types import EngineRequest, SamplingParams

    return [
        EngineRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=p,
            sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        )
        for i, (p, n) in enumerate(zip(work.prompts, work.max_tokens, strict=True))
    ]


def run_engine(
    model_dir: Path, work: Workload, engine_options: dict[str, Any], before_timed: Callable[[], None] | None = None
) -> EngineRun:
    """The engine on `work` after a warm-up; `before_timed` runs after the warm-up, just before the
    clock starts (tools/scaling_ceiling.py lines up two processes' timed runs with it)."""
    from tokenmill.engine import EngineConfig
    from tokenmill.engine.engine import EngineMetrics

    engine = new_engine(EngineConfig(model=str(model_dir), **engine_options))
    # Warm-up (allocator, kernels, plans): two short requests whose tokens share nothing with the work.
    warm_up(engine, engine_requests(warm_up_workload(), "warm"))
    engine.metrics = EngineMetrics()
    cached_before = engine.stats().cached_prompt_tokens_total
    steps_before = engine.stats().steps

    requests = engine_requests(work, "bench")
    if before_timed is not None:
        before_timed()
    c0, t0 = time.process_time(), time.perf_counter()
    results = engine.generate(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if len(results) != len(requests):
        raise RuntimeError(f"engine finished {len(results)} of {len(requests)} requests")
    produced = sum(len(d.output_token_ids) for d in results.values())
    if produced != work.output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, the workload asks for {work.output_tokens}")
    m = engine.metrics
    stats = engine.stats()
    run = EngineRun(
        wall_s=wall,
        cpu_s=cpu,
        output_tokens=produced,
        prompt_tokens=work.prompt_tokens,
        prefill_tokens_computed=m.prompt_tokens_computed,
        cached_prompt_tokens=stats.cached_prompt_tokens_total - cached_before,
        kv_slot_utilization_peak=m.kv_slot_utilization_at_peak,
        engine_overhead_fraction=m.overhead_fraction_at_peak,
        peak_running=m.peak_running,
        steps=stats.steps - steps_before,
        preemptions=m.num_preemptions,
        kv_blocks_total=stats.kv_blocks_total,
    )
    close_engine(engine)
    del engine, results
    gc.collect()
    return run


def close_engine(engine: Any) -> None:
    """Let go of an engine now: vLLM's adapter shuts vLLM down (the next engine of the process needs
    its distributed state); tokenmill's own engine is simply dropped."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()
