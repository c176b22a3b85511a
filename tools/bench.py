"""Engine benchmarks: `mixed` (vs transformers generate), `prefix` (vs the engine without its cache)
and `structured` (constrained vs unconstrained, tools/bench_structured.py).

- mixed:  256 requests, prompt 16-512 tokens, output 16-256 tokens (ignore_eos), fixed seed.
          Baseline: transformers `generate` with the best static batch of {8, 32, 64}, left padding,
          same weights, same process, run right after the engine.
          With `--backend vllm` the engine side is vLLM behind tokenmill's adapter (mixed, prefix and
          kafka only); the baseline is the same.
- prefix: 128 requests sharing a 512-token prefix plus 32 unique tokens, 32 output tokens each.
          Baseline: the same engine with prefix caching off.
- structured: 256 requests over 8 JSON schemas, every row constrained, against the same requests
          unconstrained with the same output lengths (tools/bench_structured.py has its method).
- features: the structured workload's prompts plain greedy and with each sampling feature alone
          (structured JSON, logprobs, seeded top-p, penalties, stop strings, n, prompt_logprobs),
          each feature's decode steps against the plain ones in lockstep (tools/bench_features.py).
- n:      32 prompts with n = 8 samples each against the same 256 samples as single seeded jobs,
          the prefix cache on in both (tools/bench_n.py).
- score:  256 score-only requests (64 four-choice questions over a shared ~400-token context)
          against transformers computing the same loglikelihoods (tools/bench_score.py).
- invariance: 1,000 jobs (greedy, seeded sampling, structured, scoring, n), each alone and in mixes
          of 64 and 256 with chunked prefill, prefix-cache hits, preemption, 1 and 2 threads, async
          scheduling on and off: the share whose Results are the same bits in every placement, and
          what batch_invariant costs on `mixed` (tools/bench_invariance.py).

Throughput is requested output tokens per second of wall time, from the moment all requests are
handed over to the moment the last finishes (model loading and a short warm-up excluded, for both
sides). Everything runs in one process, one after the other, with the same torch thread count.

Every workload's report (table and JSON) also says how the process started (tools/bench_startup.py):
- startup_s: from the process's own start to its first engine ready (create_engine returned): the
  imports, the weights, the tokenizer, the KV cache; the kafka workload's throw-away broker is
  not counted.
- first_result_s: from that engine ready to its first finished request (the warm-up's first,
  alone): what a first job waits beyond the start.

Finding the best static batch for `mixed`: every candidate runs a calibration sample (the first 64
requests of the workload, or all with `full_sweep`); the winner then runs the whole workload.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.tools.bench_engine import EngineRun, close_engine, engine_requests, run_engine  # noqa: F401 (re-exported)
from tokenmill.tools.bench_startup import startup_fields, startup_rows
from tokenmill.tools.bench_workloads import (  # noqa: F401 (re-exported: the benches' public names)
    Workload,
    mixed_workload,
    prefix_workload,
    resolve_model,
    token_range,
    warm_up_workload,
)

WORKLOADS = ("mixed", "prefix", "structured", "features", "score", "n", "invariance")
# The workloads another backend (--backend vllm) runs: those that measure an engine from outside (the
# others read tokenmill's own engine's internals: its compile and mask timings, its fork of choices).
OTHER_BACKEND_WORKLOADS = ("mixed", "prefix", "kafka")
BASELINE_BATCHES = (8, 32, 64)
CALIBRATION_REQUESTS = 64


# ---------------------------------------------------------------------------------------------
# transformers side


def hf_static_batches(model, work: Workload, batch_size: int, pad_id: int) -> tuple[float, float]:
    """Run the workload through `generate` in static batches (arrival order), on the model's
    device (synchronised at the end on a GPU); (wall, CPU) seconds."""
    import torch

    c0, t0 = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[start : start + batch_size]
            outs = work.max_tokens[start : start + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):  # left padding
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            model.generate(
                input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max(outs),
                do_sample=False, eos_token_id=None, pad_token_id=pad_id,
            )
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - t0, time.process_time() - c0


@dataclass
class BaselineRun:
    batch_size: int
    wall_s: float
    cpu_s: float
    output_tokens: int
    calibration: dict[int, float] = field(default_factory=dict)  # batch size -> requested tok/s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def run_hf_baseline(model_dir: Path, work: Workload, dtype: str, full_sweep: bool = False, *, device: Any = "cpu",
                    batches: tuple[int, ...] = BASELINE_BATCHES,
                    calibration_requests: int = CALIBRATION_REQUESTS) -> BaselineRun:
    """transformers `generate` on ``device``: each static batch size of ``batches`` runs the first
    ``calibration_requests`` requests (all of them with ``full_sweep``), the fastest then runs the
    whole workload (tools/gpu_check's `mixed` section runs it on the GPU, with its own sizes)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype or "auto").to(device).eval()
    pad_id = model.generation_config.pad_token_id
    model.generation_config.eos_token_id = None  # ignore_eos, like the engine side
    if pad_id is None:
        pad_id = 0
    elif isinstance(pad_id, list):
        pad_id = pad_id[0]
    hf_static_batches(model, warm_up_workload(), 2, pad_id)  # warm-up
    sample = work if full_sweep else work.head(calibration_requests)
    calibration: dict[int, float] = {}
    times: dict[int, tuple[float, float]] = {}
    for bsz in batches:
        times[bsz] = hf_static_batches(model, sample, bsz, pad_id)
        calibration[bsz] = sample.output_tokens / times[bsz][0]
    best = max(calibration, key=calibration.get)
    if full_sweep or len(sample.prompts) == len(work.prompts):
        wall, cpu = times[best]
    else:
        wall, cpu = hf_static_batches(model, work, best, pad_id)
    del model
    gc.collect()
    return BaselineRun(batch_size=best, wall_s=wall, cpu_s=cpu, output_tokens=work.output_tokens,
                       calibration=calibration)


# ---------------------------------------------------------------------------------------------


def run_bench(
    workload: str,
    model: str,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    engine_options: dict[str, Any] | None = None,
    full_sweep: bool = False,
    repeats: int = 3,
    workload_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One workload's report, startup_s and first_result_s included (tools/bench_startup.py);
    `repeats` is the structured and features workloads' number of timed pairs of passes (per feature);
    `workload_options` go to the score workload's run_score (context_len, continuation_len,
    memory_tokens, threads)."""
    from tokenmill.engine.heap import thaw

    try:
        report = _workload_report(workload, model, num_requests=num_requests, seed=seed,
                                  engine_options=engine_options, full_sweep=full_sweep, repeats=repeats,
                                  workload_options=workload_options)
    finally:
        thaw()  # the engines' start-up objects, frozen as each engine was made (new_engine), go back
    report.update(startup_fields())
    return report


def _workload_report(
    workload: str,
    model: str,
    *,
    num_requests: int | None,
    seed: int,
    engine_options: dict[str, Any] | None,
    full_sweep: bool,
    repeats: int,
    workload_options: dict[str, Any] | None,
) -> dict[str, Any]:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    from tokenmill.engine.model_config import load_model_config

    options = dict(engine_options or {})
    backend = options.get("backend", "tokenmill")
    if backend != "tokenmill" and workload not in OTHER_BACKEND_WORKLOADS:
        raise ValueError(f"--backend {backend} runs the {', '.join(OTHER_BACKEND_WORKLOADS)} workloads; "
                         f"{workload} measures parts of tokenmill's own engine")
    model_dir = resolve_model(model)
    mc = load_model_config(model_dir)
    special = set(mc.eos_token_ids)
    if workload == "score":
        from tokenmill.tools.bench_score import run_score

        return run_score(model, model_dir, mc, num_requests=num_requests, seed=seed, engine_options=options,
                         full_sweep=full_sweep, **(workload_options or {}))
    if workload == "invariance":
        from tokenmill.tools.bench_invariance import run_invariance

        return run_invariance(model, model_dir, mc, num_requests=num_requests, seed=seed, engine_options=options,
                              **(workload_options or {}))
    if workload_options:
        raise ValueError(f"workload_options are for the score and invariance workloads, not {workload!r}")
    if workload == "n":
        from tokenmill.tools.bench_n import run_n

        return run_n(model, model_dir, mc, num_requests=num_requests, seed=seed, engine_options=options)
    if workload == "structured":
        return _structured_report(model, model_dir, mc, num_requests or 256, seed, options, repeats)
    if workload == "features":
        return _features_report(model, model_dir, mc, num_requests or 256, seed, options, repeats)
    if workload == "mixed":
        work = mixed_workload(mc.vocab_size, num_requests or 256, seed, special)
    else:
        work = prefix_workload(mc.vocab_size, num_requests or 128, seed, special)
    need = max(len(p) + n for p, n in zip(work.prompts, work.max_tokens, strict=True))
    if need > mc.max_model_len:
        raise ValueError(f"the workload needs {need} positions; {model} allows {mc.max_model_len}")

    engine = run_engine(model_dir, work, options)
    report: dict[str, Any] = {
        "workload": workload,
        "model": model,
        "backend": backend,
        "requests": len(work.prompts),
        "engine_output_tok_s": engine.output_tok_s,
    }
    if workload == "mixed":
        base = run_hf_baseline(model_dir, work, options.get("dtype", "auto"), full_sweep=full_sweep)
        report["baseline"] = "transformers generate, best static batch of 8/32/64, left padding"
        report["baseline_batch_size"] = base.batch_size
        report["baseline_calibration_tok_s"] = {str(k): v for k, v in base.calibration.items()}
    else:
        no_cache = run_engine(model_dir, work, {**options, "enable_prefix_caching": False})
        base = no_cache
        report["baseline"] = "the same engine with prefix caching off"
        report["baseline_prefill_tokens_computed"] = no_cache.prefill_tokens_computed
    report.update(
        baseline_output_tok_s=base.output_tok_s,
        ratio=engine.output_tok_s / base.output_tok_s if base.output_tok_s else 0.0,
        kv_slot_utilization_peak=engine.kv_slot_utilization_peak,
        engine_overhead_fraction=engine.engine_overhead_fraction,
        prompt_tokens=engine.prompt_tokens,
        prefill_tokens_computed=engine.prefill_tokens_computed,
        cached_prompt_tokens=engine.cached_prompt_tokens,
        output_tokens=engine.output_tokens,
        engine_wall_s=engine.wall_s,
        baseline_wall_s=base.wall_s,
        engine_cpu_s=engine.cpu_s,
        baseline_cpu_s=base.cpu_s,
        # Throughput ratio by process CPU time: on a busy shared machine wall time also measures the
        # neighbours; with one thread per side, CPU time is what each side itself needed.
        ratio_by_cpu_time=(base.cpu_s / engine.cpu_s) if engine.cpu_s > 0 else 0.0,
        engine_steps=engine.steps,
        engine_peak_running=engine.peak_running,
        engine_preemptions=engine.preemptions,
        kv_blocks_total=engine.kv_blocks_total,
        engine_options={k: v for k, v in options.items()},
    )
    return report


def _structured_report(model: str, model_dir: Path, mc, num_requests: int, seed: int,
                       options: dict[str, Any], repeats: int) -> dict[str, Any]:
    from tokenmill.tools.bench_structured import run_structured
    from tokenmill.tools.structured_workload import structured_workload

    work = structured_workload(mc.vocab_size, num_requests, seed, special=set(mc.eos_token_ids))
    need = max(len(p) for p in work.prompts) + work.max_tokens
    if need > mc.max_model_len:
        raise ValueError(f"the workload needs {need} positions; {model} allows {mc.max_model_len}")
    report: dict[str, Any] = {"workload": "structured", "model": model}
    report.update(run_structured(model_dir, work, options, repeats=repeats))
    report["engine_options"] = dict(options)
    return report


def _features_report(model: str, model_dir: Path, mc, num_requests: int, seed: int,
                     options: dict[str, Any], repeats: int) -> dict[str, Any]:
    from tokenmill.tools.bench_features import run_features
    from tokenmill.tools.structured_workload import structured_workload

    work = structured_workload(mc.vocab_size, num_requests, seed, special=set(mc.eos_token_ids))
    need = max(len(p) for p in work.prompts) + work.max_tokens
    if need > mc.max_model_len:
        raise ValueError(f"the workload needs {need} positions; {model} allows {mc.max_model_len}")
    report: dict[str, Any] = {"workload": "features", "model": model}
    report.update(run_features(model_dir, work, options, repeats=repeats))
    report["engine_options"] = dict(options)
    return report


def format_table(report: dict[str, Any]) -> str:
    if report["workload"] == "invariance":
        from tokenmill.tools.bench_invariance import format_invariance_table

        return format_invariance_table(report)
    if report["workload"] == "score":
        from tokenmill.tools.bench_score import format_score_table

        return format_score_table(report)
    if report["workload"] == "n":
        from tokenmill.tools.bench_n import format_n_table

        return format_n_table(report)
    if report["workload"] == "features":
        from tokenmill.tools.bench_features import format_features_table

        return format_features_table(report)
    if report["workload"] == "structured":
        from tokenmill.tools.bench_structured import format_structured_table

        return format_structured_table(report)
    rows = [
        ("workload", report["workload"]),
        ("model", report["model"]),
        ("backend", report.get("backend", "tokenmill")),
        ("requests", report["requests"]),
        ("engine output tok/s", f"{report['engine_output_tok_s']:.1f}"),
        ("baseline output tok/s", f"{report['baseline_output_tok_s']:.1f}  ({report['baseline']})"),
        ("ratio", f"{report['ratio']:.2f}  (by process CPU time: {report['ratio_by_cpu_time']:.2f})"),
        ("kv slot utilization (peak)", f"{report['kv_slot_utilization_peak']:.3f}"),
        ("engine overhead fraction", f"{report['engine_overhead_fraction']:.3f}"),
        ("prompt tokens", report["prompt_tokens"]),
        ("prefill tokens computed", report["prefill_tokens_computed"]),
        ("cached prompt tokens", report["cached_prompt_tokens"]),
        ("engine steps / preemptions", f"{report['engine_steps']} / {report['engine_preemptions']}"),
    ]
    if "baseline_batch_size" in report:
        rows.append(("baseline batch size", report["baseline_batch_size"]))
    rows += startup_rows(report)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_json(report: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)) + "\n")
