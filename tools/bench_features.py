"""`bench --workload features`: what each sampling feature costs a step, against plain greedy rows.

A feature that falls off one of the engine's fast paths (the greedy screen, final-only requests,
the argmax that plain greedy rows take) is a trap for its users: its rows run slower than the
plain rows beside them for reasons that have nothing to do with the work the feature asks for.
This bench runs the same requests plain and with each feature alone and names each one's cost.

The requests (tools/structured_workload.py): `--requests` prompts of 8-32 random ordinary tokens;
request i's output length L_i is what its JSON constraint (schema i mod 8) lets greedy decoding
write, found by a first constrained pass. Every pass then asks each row for L_i tokens
(`ignore_eos`, final-only requests as a worker's non-streaming jobs are), so every feature's batch
shrinks step for step as the plain one does. The features, each alone on top of greedy decoding:

- structured: the request's JSON schema (`structured_outputs.json`, compact whitespace);
- logprobs: `logprobs: 5`;
- top_p: seeded top-p sampling (temperature 0.8, top_p 0.9, seed per request);
- penalties: repetition 1.1, frequency 0.5, presence 0.5;
- stop: three stop strings (decoded token by token, as a stop string needs);
- n: `n: 4` on the first quarter of the prompts, against those prompts four times as single rows
  (both sides hold the same rows once the choices fork);
- prompt_logprobs: `prompt_logprobs: 5` (every prompt position scored: prefill work, which the
  decode steps do not show, so its figure is the whole pass).

A feature whose rows may end early (structured, stop) runs a first pass alone, and the plain rows
then take its output lengths. Then `repeats` timed pairs run, each in lockstep (one step of the
feature's pass on one engine, one step of the plain pass on a second engine of the same settings,
in turn: a neighbour's burst on a shared machine lands on both within a step), each pass its own
tenant so no pass finds another's prompts in the prefix cache. Every engine's KV cache is mapped
before the first pass (bench_startup.map_kv_cache). The two engines swap sides from one
pair to the next: two engines of the same settings can differ by a few % in the same process (where
their memory landed; up to 5% measured), and over the pairs that difference cancels instead of
counting for or against the feature.

Where plain greedy rows take the greedy screen (a bfloat16 LM head, then float32 for the few
candidates: CPUs where oneDNN has a bfloat16 GEMM), logprobs and top_p cannot: a logprob's
normaliser and a top-p draw need every logit of the row in float32, the whole LM head, bit for bit
the same on every CPU. Their figure over plain then holds the head's difference, which at tiny-llama's
shapes (the head three quarters of a step's multiply-adds) is a quarter of a step or more by itself.
So for those two a third pass runs in the same lockstep, the plain rows on an engine without the
screen, and the report gives `full_head_fraction` (that engine's step over plain: what the head
alone costs) and `step_overhead_over_full_head` (the feature's step over it: what the feature costs
beyond the head it needs). The goal is still judged on `step_overhead_fraction`.

Per feature: `step_overhead_fraction` = mean wall time of the pure decode steps at the peak batch,
feature over plain, minus 1, pooled over the pairs (also by median step and by process CPU time,
and the model part of those steps: forward, LM head, mask, sampling); `pass_overhead_fraction`, the
whole passes' wall time, prefill included. `within_goal` holds every feature but n and
prompt_logprobs to a step overhead of at most GOAL (their figures are stated). The report also
names the CPU (its model and whether it has AVX2, AVX-512, AVX-512 BF16 and AMX tiles) and the CPU
paths the engine took, since which fast paths exist depends on both.
"""

from __future__ import annotations

import gc
import platform
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tokenmill.tools.bench_startup import map_kv_cache, new_engine, startup_rows, warm_up
from tokenmill.tools.bench_structured import (
    PassRun,
    SteppedPass,
    drive,
    drive_in_lockstep,
    mean_ms,
    median_ms,
)
from tokenmill.tools.structured_workload import StructuredWorkload

# A feature's step overhead over plain greedy rows that is still on the fast path.
GOAL = 0.10
# Features whose cost is work of their own (more rows, scored prompt positions): stated, not held to GOAL.
STATED = ("n", "prompt_logprobs")
# Features that need every logit of a row in float32 (a logprob's normaliser, a top-p draw): they
# cannot take the greedy screen, and where plain rows do, a third pass measures the head's part.
WHOLE_DISTRIBUTION = ("logprobs", "top_p")
STOP_STRINGS = ["\n\n\n", "###", "</answer>"]
N_CHOICES = 4


@dataclass(frozen=True)
class Feature:
    """One feature: the sampling fields it sets on top of plain greedy decoding."""

    name: str
    fields: dict[str, Any]
    ends_early: bool = False  # its rows may stop before L_i: a first pass gives the plain lengths


FEATURES = (
    Feature("structured", {}, ends_early=True),  # the schema is per request (_feature_requests)
    Feature("logprobs", {"logprobs": 5}),
    Feature("top_p", {"temperature": 0.8, "top_p": 0.9}),  # seeded per request
    Feature("penalties", {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5}),
    Feature("stop", {"stop": STOP_STRINGS}, ends_early=True),
    Feature("n", {"n": N_CHOICES}),
    Feature("prompt_logprobs", {"prompt_logprobs": 5}),
)
FEATURE_NAMES = tuple(f.name for f in FEATURES)


def cpu_features() -> dict[str, Any]:
    """The CPU's model and the instruction sets the fast paths depend on (from /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"cpu": model, "avx2": "avx2" in flags, "avx512": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx": {"amx_tile", "amx_bf16"} <= flags}


def _greedy(max_tokens: int, **extra: Any):
    from tokenmill.engine.types import SamplingParams

    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra})


def _feature_requests(feature: Feature, work: StructuredWorkload, lengths: list[int], tag: str) -> list:
    """The feature's requests over the workload's prompts (n: the first quarter of them)."""
    from tokenmill.engine.types import EngineRequest, SamplingParams, StructuredOutputsParams

    out = []
    for i, prompt in enumerate(_prompts(feature, work)):
        if feature.name == "structured":
            sampling = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, structured_outputs=(
                StructuredOutputsParams(json=work.schema_of(i).schema)))
        elif feature.name == "top_p":
            sampling = _greedy(lengths[i], seed=1000 + i, **feature.fields)
        else:
            sampling = _greedy(lengths[i], **feature.fields)
        out.append(EngineRequest(request_id=f"{tag}.{i}", prompt_token_ids=prompt, tenant=tag, sampling=sampling,
                                 final_only=True))
    return out


def _plain_requests(feature: Feature, work: StructuredWorkload, lengths: list[int], tag: str) -> list:
    """Plain greedy rows doing the feature's decode work: the same prompts and output lengths (for n,
    each prompt once per choice)."""
    from tokenmill.engine.types import EngineRequest

    copies = N_CHOICES if feature.name == "n" else 1
    return [EngineRequest(request_id=f"{tag}.{i}.{c}", prompt_token_ids=prompt, tenant=tag,
                          sampling=_greedy(lengths[i]), final_only=True)
            for i, prompt in enumerate(_prompts(feature, work)) for c in range(copies)]


def _prompts(feature: Feature, work: StructuredWorkload) -> list[list[int]]:
    if feature.name == "n":
        return work.prompts[: max(1, len(work.prompts) // N_CHOICES)]
    return work.prompts


def _row_lengths(run: PassRun, tag: str, count: int) -> list[int]:
    """Each request's output length in a pass (requests of one choice)."""
    return [len(run.results[f"{tag}.{i}"].output_token_ids or []) for i in range(count)]


def _tokens(run: PassRun) -> int:
    return sum(sum(len(c.token_ids) for c in d.choices) if d.choices else len(d.output_token_ids or [])
               for d in run.results.values())


def _peak_figures(pairs: list[tuple[PassRun, PassRun]]) -> dict[str, Any]:
    """The step figures of the module docstring over the pure decode steps at the plain side's peak."""
    peak = max(s["seqs"] for _, plain in pairs for s in plain.steps)
    f_steps = [s for f, _ in pairs for s in f.decode_steps_at(peak)]
    p_steps = [s for _, p in pairs for s in p.decode_steps_at(peak)]
    f_wall, p_wall = sum(f.wall_s for f, _ in pairs), sum(p.wall_s for _, p in pairs)
    figures: dict[str, Any] = {
        "peak_running": peak, "peak_decode_steps": len(f_steps), "plain_peak_decode_steps": len(p_steps),
        "pass_overhead_fraction": f_wall / p_wall - 1.0 if p_wall > 0 else 0.0,
        "pass_wall_s": f_wall, "plain_pass_wall_s": p_wall,
        "pass_cpu_s": sum(f.cpu_s for f, _ in pairs), "plain_pass_cpu_s": sum(p.cpu_s for _, p in pairs),
    }
    if not f_steps or not p_steps:  # e.g. rows too short to reach a pure decode step at the peak
        return {**figures, "step_overhead_fraction": None}
    f_ms, p_ms = mean_ms(f_steps, "wall_s"), mean_ms(p_steps, "wall_s")
    f_cpu, p_cpu = mean_ms(f_steps, "cpu_s"), mean_ms(p_steps, "cpu_s")
    return {
        **figures,
        "step_overhead_fraction": f_ms / p_ms - 1.0,
        "step_ms": f_ms, "plain_step_ms": p_ms,
        "step_overhead_fraction_median": median_ms(f_steps) / median_ms(p_steps) - 1.0,
        "step_overhead_fraction_by_cpu_time": f_cpu / p_cpu - 1.0 if p_cpu > 0 else 0.0,
        "step_cpu_ms": f_cpu, "plain_step_cpu_ms": p_cpu,
        "step_model_ms": mean_ms(f_steps, "model_s"), "plain_step_model_ms": mean_ms(p_steps, "model_s"),
        "step_overhead_fraction_pairs": [
            mean_ms(f.decode_steps_at(peak), "wall_s") / mean_ms(p.decode_steps_at(peak), "wall_s") - 1.0
            for f, p in pairs if f.decode_steps_at(peak) and p.decode_steps_at(peak)],
    }


def _full_head_figures(pairs: list[tuple[PassRun, PassRun]], full_head_runs: list[PassRun]) -> dict[str, Any]:
    """The plain rows without the greedy screen (the whole float32 LM head) against plain and against the
    feature, at the plain side's peak batch (see the module docstring)."""
    head = _peak_figures([(full, plain) for (_, plain), full in zip(pairs, full_head_runs, strict=True)])
    beyond = _peak_figures([(feature, full) for (feature, _), full in zip(pairs, full_head_runs, strict=True)])
    if head["step_overhead_fraction"] is None or beyond["step_overhead_fraction"] is None:
        return {"full_head_fraction": None, "step_overhead_over_full_head": None}
    return {"full_head_fraction": head["step_overhead_fraction"], "full_head_step_ms": head["step_ms"],
            "step_overhead_over_full_head": beyond["step_overhead_fraction"]}


def _judge(name: str, figures: dict[str, Any]) -> bool | None:
    """Within GOAL (None for a stated feature, or where no step could be compared)."""
    overhead = figures["step_overhead_fraction"]
    if name in STATED or overhead is None:
        return None
    return overhead <= GOAL


def run_features(model_dir: Path, work: StructuredWorkload, engine_options: dict[str, Any], *,
                 features: tuple[str, ...] = FEATURE_NAMES, repeats: int = 2,
                 on_pass: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """The report's figures (see the module docstring); `on_pass(feature, pair)` is told before each
    timed pair (progress)."""
    from tokenmill.engine import EngineConfig
    from tokenmill.engine.types import EngineRequest, SamplingParams, StructuredOutputsParams

    unknown = set(features) - set(FEATURE_NAMES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; choose from {', '.join(FEATURE_NAMES)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    config = EngineConfig(model=str(model_dir), **engine_options)
    engine, plain_engine = new_engine(config), new_engine(config)
    # Warm-up outside the timings: kernels, plans, the sampler's buffers, the constraint backend's
    # first use (a choice constraint no workload request shares) and a fork of choices.
    warm = [EngineRequest(request_id="warm-0", prompt_token_ids=[1] * 40, sampling=_greedy(4)),
            EngineRequest(request_id="warm-1", prompt_token_ids=[2] * 20, sampling=SamplingParams(
                max_tokens=4, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))),
            EngineRequest(request_id="warm-2", prompt_token_ids=[3] * 24, sampling=_greedy(
                4, temperature=0.8, top_p=0.9, seed=1, logprobs=5, repetition_penalty=1.1, stop=STOP_STRINGS)),
            EngineRequest(request_id="warm-3", prompt_token_ids=[4] * 24, sampling=_greedy(4, n=2)),
            EngineRequest(request_id="warm-4", prompt_token_ids=[5] * 24, sampling=_greedy(4, prompt_logprobs=5))]
    warm_up(engine, warm)
    plain_engine.generate(warm)
    full_head_engine = None
    if engine.cpu_paths.greedy_screen and set(features) & set(WHOLE_DISTRIBUTION):
        full_head_engine = new_engine(EngineConfig(model=str(model_dir), **{**engine_options, "greedy_screen": "off"}))
        full_head_engine.generate(warm)
    for one in (engine, plain_engine, full_head_engine):
        if one is not None:
            map_kv_cache(one)

    # The lengths every pass asks for: what each request's constraint lets greedy decoding write.
    structured = next(f for f in FEATURES if f.name == "structured")
    n = len(work.prompts)
    first = drive(engine, _feature_requests(structured, work, [work.max_tokens] * n, "ref-structured"))
    lengths = _row_lengths(first, "ref-structured", n)
    if min(lengths) < 1:
        raise RuntimeError("a constrained request produced no tokens: the rows cannot be matched")

    report: dict[str, Any] = {}
    for feature in (f for f in FEATURES if f.name in features):
        count = len(_prompts(feature, work))
        plain_lengths = lengths[:count]  # per prompt: n's plain side repeats it per choice
        if feature.ends_early and feature.name != "structured":
            tag = f"ref-{feature.name}"
            plain_lengths = _row_lengths(drive(engine, _feature_requests(feature, work, lengths, tag)), tag, count)
        pairs: list[tuple[PassRun, PassRun]] = []
        full_head_runs: list[PassRun] = []
        with_full_head = full_head_engine is not None and feature.name in WHOLE_DISTRIBUTION
        for r in range(repeats):
            if on_pass is not None:
                on_pass(feature.name, r)
            feature_side, plain_side = (engine, plain_engine) if r % 2 == 0 else (plain_engine, engine)
            passes = [SteppedPass(feature_side, _feature_requests(feature, work, lengths, f"{feature.name}{r}")),
                      SteppedPass(plain_side, _plain_requests(feature, work, plain_lengths, f"plain-{feature.name}{r}"))]
            if with_full_head:
                passes.append(SteppedPass(full_head_engine, _plain_requests(
                    feature, work, plain_lengths, f"full-head-{feature.name}{r}")))
            feature_run, plain_run, *full_head_run = drive_in_lockstep(*passes)
            if _tokens(feature_run) != _tokens(plain_run):
                raise RuntimeError(f"{feature.name}: {_tokens(feature_run)} tokens against the plain rows' "
                                   f"{_tokens(plain_run)}: the passes would not compare")
            pairs.append((feature_run, plain_run))
            full_head_runs.extend(full_head_run)
        figures = _peak_figures(pairs)
        if full_head_runs:
            figures.update(_full_head_figures(pairs, full_head_runs))
        figures["output_tokens"] = _tokens(pairs[0][0])
        figures["requests"] = len(_prompts(feature, work))
        figures["within_goal"] = _judge(feature.name, figures)
        report[feature.name] = figures
    paths = {f.name: getattr(engine.cpu_paths, f.name) for f in fields(engine.cpu_paths)}
    del engine, plain_engine, full_head_engine
    gc.collect()
    return {"requests": n, "repeats": repeats, "goal": GOAL, "stated": list(STATED),
            "output_lengths_mean": sum(lengths) / n, "features": report, "cpu_paths": paths,
            **cpu_features(),
            "all_within_goal": all(f["within_goal"] is not False for f in report.values())}


def format_features_table(report: dict[str, Any]) -> str:
    r = report
    flags = ", ".join(f"{name} {'yes' if r[key] else 'no'}" for key, name in
                      (("avx2", "AVX2"), ("avx512", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"), ("amx", "AMX")))
    rows = [
        ("workload", f"features ({r['requests']} requests, {r['output_lengths_mean']:.0f} output tokens mean, "
                     f"{r['repeats']} timed pairs each)"),
        ("model", r["model"]),
        ("cpu", f"{r['cpu']} ({flags})"),
        ("cpu paths", ", ".join(name for name, on in r["cpu_paths"].items() if on) or "none"),
        ("goal", f"step overhead at most {100 * r['goal']:.0f}% over plain greedy "
                 f"(stated only: {', '.join(r['stated'])})"),
    ]
    for name, f in r["features"].items():
        mark = {True: "ok", False: "OVER", None: "stated" if name in r["stated"] else "-"}[f["within_goal"]]
        if f["step_overhead_fraction"] is None:
            rows.append((name, f"no pure decode step at the peak; pass {100 * f['pass_overhead_fraction']:+.1f}%"))
            continue
        rows.append((name, f"{100 * f['step_overhead_fraction']:+6.1f}%  {mark:<6} ({f['step_ms']:.1f} vs "
                           f"{f['plain_step_ms']:.1f} ms at {f['peak_running']} rows; median "
                           f"{100 * f['step_overhead_fraction_median']:+.1f}%, CPU time "
                           f"{100 * f['step_overhead_fraction_by_cpu_time']:+.1f}%, model part "
                           f"{f['step_model_ms']:.1f} vs {f['plain_step_model_ms']:.1f} ms; whole pass "
                           f"{100 * f['pass_overhead_fraction']:+.1f}%)"))
        if f.get("step_overhead_over_full_head") is not None:
            rows.append(("", f"{100 * f['step_overhead_over_full_head']:+6.1f}%  over plain rows on the whole "
                             f"float32 LM head, which it needs ({f['full_head_step_ms']:.1f} ms: the head alone "
                             f"{100 * f['full_head_fraction']:+.1f}% over the screen)"))
    rows += startup_rows(report)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
