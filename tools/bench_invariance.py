"""`tokenmill bench --workload invariance`: every job's Result the same bits alone and in any batch.

With at-least-once delivery a job can run twice (a killed worker, a rebalance, a broker outage): the
second Result should equal the first, whatever each run was batched with. This bench runs the same
jobs in several placements and compares every Result field that comes from the model, bit for bit.

Jobs (`--requests`, default 1,000; tools/bench_invariance.py `invariance_jobs`, seeded): prompts of
8-600 random ordinary tokens, two in five opening with one of 8 shared prefixes of 48-240 tokens (so
the mixes find them in the prefix cache), 4-40 output tokens. Their kinds, in turn:
- greedy, logprobs 0-5 on most;
- seeded sampling: temperature 0.5-1.3 with top_k, top_p, min_p, repetition / presence / frequency
  penalties in random combinations, logprobs on most, a stop string or min_tokens on some;
- structured output: one of the 8 JSON schemas of the structured workload, greedy or seeded, with
  logprobs;
- scoring: prompt_logprobs 0-3 from a score_from inside the prompt, max_tokens 0 (score only) or a few
  tokens as well;
- n: 2-4 seeded choices with logprobs.

Placements, each on an engine of its own (the engine settings given on the command line apply to
all; `--batch-invariant off` shows what the engine gives without the setting):
- alone: each job by itself, one thread, synchronous steps, no prefix cache, whole prompts: the
  reference;
- mix64-chunked: mixes of 64 jobs, prompts cut into chunks of at most 96 tokens per step, the prefix
  cache on, one thread;
- mix64-2threads-async: mixes of 64, two threads, async scheduling forced on, the prefix cache on;
- mix256-preempt-2threads: mixes of 256 in a KV cache too small for them (requests preempted and
  recomputed), chunks of 256 tokens, two threads;
- mix256-preempt-async: mixes of 256, the small cache, one thread, async scheduling on.
Each mix is a seeded shuffle of the jobs, so a job meets other neighbours in every placement.

Reported: per placement the jobs whose Result equals the reference (token ids, text, finish reason,
every logprob and top-logprob, prompt logprobs with ranks and their sum, every choice of an n job),
its preemptions and cached prompt tokens; `share_identical` (jobs identical in every placement, over
all jobs) and the first differing jobs with the field that differs. Floats compare by their bits.

Cost (`--cost-rounds`, default 2; 0 skips it): the `mixed` workload's engine side (tools/bench.py) with
batch_invariant on and off in turn, the same settings otherwise, `--cost-rounds` runs of each,
alternated: `throughput_cost` = 1 - (on tok/s) / (off tok/s) over the runs' totals, by wall time and by
process CPU time. With `--threads 1`, as the bench's default, CPU time is the work each side needed;
on a shared machine wall time also counts the neighbours.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.tools.bench_startup import new_engine

NUM_JOBS = 1000
SHARED_PREFIXES = 8
KINDS = ("greedy", "sampled", "structured", "scoring", "n")
# A job's kind by its index: greedy and sampled jobs most often, as a batch job's mix is.
_KIND_CYCLE = ("greedy", "sampled", "greedy", "sampled", "structured", "sampled", "scoring", "greedy", "n", "sampled")
STOP_STRINGS = ("e", " the", "a")


@dataclass
class Placement:
    name: str
    mix: int | None  # jobs per engine.generate call; None: each job alone
    options: dict[str, Any] = field(default_factory=dict)  # engine settings over the bench's own
    small_kv: bool = False  # a KV cache too small for a mix: requests are preempted and recomputed


PLACEMENTS = (
    Placement("alone", None, {"cpu_threads": 1, "async_scheduling": "off", "enable_prefix_caching": False}),
    Placement("mix64-chunked", 64, {"cpu_threads": 1, "max_num_batched_tokens": 96}),
    Placement("mix64-2threads-async", 64, {"cpu_threads": 2, "async_scheduling": "on"}),
    Placement("mix256-preempt-2threads", 256, {"cpu_threads": 2, "max_num_batched_tokens": 256}, small_kv=True),
    Placement("mix256-preempt-async", 256, {"cpu_threads": 1, "async_scheduling": "on"}, small_kv=True),
)


@dataclass
class Job:
    kind: str
    prompt: list[int]
    sampling: dict[str, Any]


def invariance_jobs(vocab_size: int, num_jobs: int, seed: int, special: set[int]) -> list[Job]:
    """The bench's jobs (see the module docstring), the same for a given seed."""
    from tokenmill.tools.bench_workloads import token_range
    from tokenmill.tools.structured_workload import SCHEMAS

    rng = random.Random(seed + 36)
    lo, hi = token_range(vocab_size, special)
    prefixes = [[rng.randint(lo, hi) for _ in range(rng.randint(48, 240))] for _ in range(SHARED_PREFIXES)]
    jobs = []
    for i in range(num_jobs):
        kind = _KIND_CYCLE[i % len(_KIND_CYCLE)]
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.4 else []
        prompt += [rng.randint(lo, hi) for _ in range(rng.randint(8, 600 - len(prompt)))]
        jobs.append(Job(kind, prompt, _sampling(kind, rng, len(prompt), SCHEMAS)))
    return jobs


def _sampling(kind: str, rng: random.Random, prompt_len: int, schemas) -> dict[str, Any]:
    seed = rng.randint(0, 2**31)
    logprobs = rng.choice((None, 0, 1, 3, 5))
    if kind == "greedy":
        return {"max_tokens": rng.randint(4, 40), "temperature": 0.0, "ignore_eos": True, "logprobs": logprobs}
    if kind == "sampled":
        params: dict[str, Any] = {"max_tokens": rng.randint(4, 40), "temperature": rng.uniform(0.5, 1.3),
                                  "seed": seed, "ignore_eos": True, "logprobs": logprobs}
        for name, values in (("top_k", (0, 0, 20, 50)), ("top_p", (1.0, 1.0, 0.9, 0.8)), ("min_p", (0.0, 0.0, 0.05)),
                             ("repetition_penalty", (1.0, 1.0, 1.1, 1.3)), ("presence_penalty", (0.0, 0.0, 0.5)),
                             ("frequency_penalty", (0.0, 0.0, 0.3))):
            params[name] = rng.choice(values)
        if rng.random() < 0.15:
            params["stop"] = [rng.choice(STOP_STRINGS)]
        if rng.random() < 0.15:
            params["min_tokens"] = rng.randint(1, params["max_tokens"])
        return params
    if kind == "structured":
        schema = rng.choice(schemas)
        params = {"max_tokens": 96, "logprobs": rng.choice((0, 2)), "structured_outputs": {"json": schema.schema}}
        if rng.random() < 0.5:
            params.update(temperature=0.7, top_k=20, seed=seed)
        else:
            params["temperature"] = 0.0
        return params
    if kind == "scoring":
        return {"max_tokens": rng.choice((0, 0, 4)), "temperature": 0.0, "ignore_eos": True,
                "prompt_logprobs": rng.choice((0, 1, 3)), "score_from": rng.randint(1, prompt_len - 1)}
    return {"max_tokens": rng.randint(4, 24), "temperature": 0.9, "top_p": 0.95, "seed": seed, "ignore_eos": True,
            "n": rng.randint(2, 4), "logprobs": rng.choice((0, 2))}


def _requests(jobs: list[Job]):
    from tokenmill.engine.types import EngineRequest, SamplingParams

    return [EngineRequest(request_id=f"job-{i}", prompt_token_ids=list(job.prompt),
                          sampling=SamplingParams(**job.sampling)) for i, job in enumerate(jobs)]


# -- comparing Results -------------------------------------------------------------------------


def _bits(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def _token_logprobs(records) -> tuple | None:
    if records is None:
        return None
    return tuple((r.token_id, r.token, _bits(r.logprob), tuple((i, t, _bits(v)) for i, t, v in r.top_logprobs))
                 for r in records)


def fingerprint(delta) -> dict[str, Any]:
    """Every field of a final delta that a Result carries from the model, floats by their bits."""
    prompt = None
    if delta.prompt_logprobs is not None:
        prompt = tuple((p.position, p.token_id, _bits(p.logprob), p.rank, tuple((i, _bits(v)) for i, v in p.top_logprobs),
                        p.token, tuple(p.top_tokens)) for p in delta.prompt_logprobs)
    choices = None
    if delta.choices is not None:
        choices = tuple((c.index, tuple(c.token_ids), c.text, c.finish_reason, _token_logprobs(c.logprobs))
                        for c in delta.choices)
    return {
        "finish_reason": delta.finish_reason,
        "token_ids": tuple(delta.output_token_ids or ()),
        "text": delta.output_text,
        "logprobs": _token_logprobs(delta.output_logprobs),
        "prompt_logprobs": prompt,
        "prompt_logprob_sum": _bits(delta.prompt_logprob_sum),
        "is_greedy": delta.is_greedy,
        "choices": choices,
        "error": delta.error,
    }


def differing_field(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first field in which two fingerprints differ, or None when they are equal."""
    return next((k for k in a if a[k] != b.get(k)), None)


# -- running -----------------------------------------------------------------------------------


def _kv_gb_for_blocks(mc, blocks: int, block_size: int) -> float:
    from tokenmill.engine.model_runner import ModelRunner

    per_block = ModelRunner.kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, block_size)
    return blocks * per_block / 1024**3


def _small_kv_blocks(jobs: list[Job], mix: int, block_size: int) -> int:
    """Blocks for about an eighth of a mix's need, and at least twice the longest job's (with n)."""
    need = [-(-(len(j.prompt) + j.sampling["max_tokens"] + 1) // block_size) * j.sampling.get("n", 1) for j in jobs]
    mean = sum(need) / len(need)
    return max(int(min(mix, len(jobs)) * mean / 8), 2 * max(need) + 4)


def run_placement(model_dir: Path, mc, jobs: list[Job], placement: Placement, base: dict[str, Any],
                  seed: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(fingerprint by job id, the run's facts) of every job in one placement, on a fresh engine."""
    from tokenmill.engine import EngineConfig

    options = {**base, **placement.options}
    if placement.small_kv:
        block_size = options.get("block_size", 16)
        blocks = _small_kv_blocks(jobs, placement.mix or 1, block_size)
        options["kv_cache_gb"] = _kv_gb_for_blocks(mc, blocks, block_size)
    engine = new_engine(EngineConfig(model=str(model_dir), **options))
    requests = _requests(jobs)
    t0, c0 = time.perf_counter(), time.process_time()
    results: dict[str, Any] = {}
    if placement.mix is None:
        for r in requests:
            results.update(engine.generate([r]))
    else:
        order = list(range(len(requests)))
        random.Random(f"{seed}-{placement.name}").shuffle(order)
        for start in range(0, len(order), placement.mix):
            results.update(engine.generate([requests[i] for i in order[start : start + placement.mix]]))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    facts = {
        "name": placement.name, "mix": placement.mix, "threads": engine.cpu_threads,
        "async_scheduling": options.get("async_scheduling", "auto"),
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "prefix_caching": engine.config.enable_prefix_caching, "kv_blocks": engine.stats().kv_blocks_total,
        "preemptions": engine.metrics.num_preemptions,
        "cached_prompt_tokens": engine.stats().cached_prompt_tokens_total,
        "batch_invariant": getattr(engine, "batch_invariant", None), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
    }
    prints = {rid: fingerprint(d) for rid, d in results.items()}
    del engine, results
    gc.collect()
    return prints, facts


def throughput_cost(model_dir: Path, mc, base: dict[str, Any], rounds: int, num_requests: int,
                    seed: int) -> dict[str, Any]:
    """The `mixed` workload's engine side with batch_invariant on and off in turn (see the docstring)."""
    from tokenmill.tools.bench_engine import run_engine
    from tokenmill.tools.bench_workloads import mixed_workload

    work = mixed_workload(mc.vocab_size, num_requests, seed, set(mc.eos_token_ids))
    runs: dict[str, list] = {"on": [], "off": []}
    for _ in range(rounds):
        for setting in ("on", "off"):
            runs[setting].append(run_engine(model_dir, work, {**base, "batch_invariant": setting}))
    tokens = {k: sum(r.output_tokens for r in v) for k, v in runs.items()}
    wall = {k: sum(r.wall_s for r in v) for k, v in runs.items()}
    cpu = {k: sum(r.cpu_s for r in v) for k, v in runs.items()}
    tok_s = {k: tokens[k] / wall[k] for k in runs}
    tok_cpu_s = {k: tokens[k] / cpu[k] for k in runs}
    return {
        "cost_workload": f"mixed, {num_requests} requests, engine only",
        "cost_rounds": rounds,
        "invariant_output_tok_s": round(tok_s["on"], 1),
        "plain_output_tok_s": round(tok_s["off"], 1),
        "throughput_cost": round(1.0 - tok_s["on"] / tok_s["off"], 4),
        "throughput_cost_by_cpu_time": round(1.0 - tok_cpu_s["on"] / tok_cpu_s["off"], 4),
        "cost_runs_tok_s": {k: [round(r.output_tok_s, 1) for r in v] for k, v in runs.items()},
    }


def cpu_features() -> dict[str, bool]:
    """The vector and matrix extensions of this CPU that the kernels care about (/proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        flags = set()
    return {"avx2": "avx2" in flags, "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx": {"amx_tile", "amx_bf16"} <= flags}


def run_invariance(model: str, model_dir: Path, mc, *, num_requests: int | None, seed: int,
                   engine_options: dict[str, Any], cost_rounds: int = 2,
                   cost_requests: int = 256) -> dict[str, Any]:
    """The `invariance` workload's report."""
    base = {k: v for k, v in engine_options.items() if k != "cpu_threads"}
    jobs = invariance_jobs(mc.vocab_size, num_requests or NUM_JOBS, seed, set(mc.eos_token_ids))
    need = max(len(j.prompt) + j.sampling["max_tokens"] for j in jobs)
    if need > mc.max_model_len:
        raise ValueError(f"the workload needs {need} positions; {model} allows {mc.max_model_len}")
    reference, ref_facts = run_placement(model_dir, mc, jobs, PLACEMENTS[0], base, seed)
    placements = [ref_facts]
    identical_everywhere = [True] * len(jobs)
    differing: list[dict[str, Any]] = []
    for placement in PLACEMENTS[1:]:
        prints, facts = run_placement(model_dir, mc, jobs, placement, base, seed)
        same = 0
        for i, job in enumerate(jobs):
            rid = f"job-{i}"
            diff = differing_field(reference[rid], prints[rid])
            if diff is None:
                same += 1
                continue
            identical_everywhere[i] = False
            if len(differing) < 10:
                differing.append({"job": rid, "kind": job.kind, "placement": placement.name, "field": diff})
        facts.update(identical=same, share_identical=round(same / len(jobs), 4))
        placements.append(facts)
    kinds = {k: sum(j.kind == k for j in jobs) for k in KINDS}
    identical_by_kind = {k: sum(ok for ok, j in zip(identical_everywhere, jobs, strict=True) if j.kind == k)
                         for k in KINDS}
    report: dict[str, Any] = {
        "workload": "invariance",
        "model": model,
        "jobs": len(jobs),
        "kinds": kinds,
        "identical": sum(identical_everywhere),
        "share_identical": round(sum(identical_everywhere) / len(jobs), 4),
        "identical_by_kind": identical_by_kind,
        "batch_invariant": ref_facts["batch_invariant"],
        "placements": placements,
        "differing": differing,
        "cpu_features": cpu_features(),
        "engine_options": dict(engine_options),
    }
    if cost_rounds > 0:
        threads = engine_options.get("cpu_threads")
        report.update(throughput_cost(model_dir, mc, {**base, "cpu_threads": threads}, cost_rounds, cost_requests, seed))
    return report


def format_invariance_table(report: dict[str, Any]) -> str:
    rows = [
        ("workload", report["workload"]),
        ("model", report["model"]),
        ("jobs", f"{report['jobs']}  ({', '.join(f'{k} {v}' for k, v in report['kinds'].items())})"),
        ("batch invariant", report["batch_invariant"]),
        ("cpu features", ", ".join(k for k, v in report["cpu_features"].items() if v) or "none of avx2/avx512/amx"),
    ]
    for p in report["placements"]:
        what = (f"mix {p['mix'] or 1}, {p['threads']} thread(s), async {p['async_scheduling']}, "
                f"{p['max_num_batched_tokens']} tokens/step, {p['kv_blocks']} KV blocks, "
                f"{p['preemptions']} preemptions, {p['cached_prompt_tokens']} cached prompt tokens")
        if "identical" in p:
            what = f"{p['identical']}/{report['jobs']} identical  ({what})"
        else:
            what = f"reference  ({what})"
        rows.append((p["name"], what))
    rows.append(("identical in every placement", f"{report['identical']}/{report['jobs']}  "
                 f"(share {report['share_identical']:.4f})"))
    for d in report["differing"][:5]:
        rows.append(("  differs", f"{d['job']} ({d['kind']}) in {d['placement']}: {d['field']}"))
    if "throughput_cost" in report:
        rows.append(("throughput cost", f"{100 * report['throughput_cost']:.1f}% by wall time, "
                     f"{100 * report['throughput_cost_by_cpu_time']:.1f}% by CPU time  ({report['cost_workload']}: "
                     f"{report['invariant_output_tok_s']} tok/s invariant, {report['plain_output_tok_s']} plain)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
