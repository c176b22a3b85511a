"""`bench --workload structured`: what constrained decoding costs the batch, and whether its output holds.

One engine, one run, passes over the same requests (tools/structured_workload.py: 256 prompts
over 8 JSON schemas, each constrained to its schema), in pairs:

1. constrained: every row carries `structured_outputs.json` (compact whitespace), capped at the
   workload's max_tokens; it ends with "stop" when its JSON is complete.
2. unconstrained: the same prompts and sampling, no constraint, `max_tokens` = the length of that
   request's constrained output and `ignore_eos`, so both passes produce the same tokens per row
   and their batches shrink step for step alike.

Each pass is its own tenant, so no pass finds another's prompts in the prefix cache: both prefill
alike and their tokens/s compare whole. The first constrained pass gives the output lengths and
the outputs judged below; then `repeats` timed pairs run, each in lockstep: the constrained pass
on this engine and the unconstrained pass on a second engine of the same model and settings,
one step of each in turn. A neighbour's burst on a shared machine then lands on both sides
within a step (passes run one after the other differed by up to 30% in step time on the same
requests). The step-time overhead compares the mean wall time of the pure decode steps (one
token per row, no prompt chunk) at the peak batch, pooled over the pairs. Mask time per step
(bitmask fill + its use: the screen's mask, the masked argmax or the apply, for the constrained
rows) and compile time per schema come from the engine's metrics (`mask_s`, `compile_s`; the
compile cache serves every request after the first of each schema, so there are 8 compiles, one
per schema, in the whole run). The first constrained
pass's outputs are judged by tools/structured_workload.check_outputs: the share of "stop" outputs
that parse and validate (jsonschema), and the outputs holding whitespace outside strings; the
timed constrained passes are compared token for token with the first (`repeat_outputs_equal`).

Every pass is greedy (the workload seed picks the prompts): an all-greedy unconstrained batch is
a single argmax, the cheapest step there is, so the overhead is measured against the hardest
baseline.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.tools.bench_startup import map_kv_cache, new_engine, startup_rows, warm_up
from tokenmill.tools.structured_workload import StructuredWorkload, check_outputs


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class PassRun:
    """One pass: its final deltas by request id, the engine's record of each step, and its times."""

    results: dict[str, Any]  # request id -> final RequestDelta
    steps: list[dict]  # EngineMetrics.last_step of every step (seqs, tokens, wall_s, model_s) and its cpu_s
    wall_s: float
    cpu_s: float

    @property
    def output_tokens(self) -> int:
        return sum(len(d.output_token_ids or []) for d in self.results.values())

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def decode_steps_at(self, rows: int) -> list[dict]:
        """Steps that decoded exactly `rows` rows, one token each (no prompt chunk in the step)."""
        return [s for s in self.steps if s["seqs"] == rows and s["tokens"] == rows]


class SteppedPass:
    """One pass being driven step by step: the engine's record of each step, its own time."""

    def __init__(self, engine, requests: list) -> None:
        self.engine = engine
        self.wanted = {r.request_id for r in requests}
        self.results: dict[str, Any] = {}
        self.steps: list[dict] = []
        self.wall_s = self.cpu_s = 0.0
        self._last = engine.metrics.last_step
        for r in requests:
            engine.add(r)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.wanted) or not self.engine.has_work()

    def step(self) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        for d in self.engine.step():
            if d.finished and d.request_id in self.wanted:
                self.results[d.request_id] = d
        cpu = time.process_time() - c0
        self.wall_s += time.perf_counter() - t0
        self.cpu_s += cpu
        last = self.engine.metrics.last_step
        if last is not self._last:  # a step that scheduled nothing records nothing
            self._last = last
            # Process CPU time of the call (every thread: mask fill and compiles included): on a
            # shared machine wall time also measures the neighbours.
            self.steps.append({**last, "cpu_s": cpu})

    def run(self) -> PassRun:
        if len(self.results) != len(self.wanted):
            raise RuntimeError(f"the engine finished {len(self.results)} of {len(self.wanted)} requests")
        return PassRun(self.results, self.steps, self.wall_s, self.cpu_s)


def drive(engine, requests: list) -> PassRun:
    """Add the requests and step until all have finished, keeping the engine's record of each step."""
    one = SteppedPass(engine, requests)
    while not one.done:
        one.step()
    return one.run()


def drive_in_lockstep(*passes: SteppedPass) -> tuple[PassRun, ...]:
    """Step passes (each on its own engine) in turn, one step each, until all are done: a burst of a
    neighbour on a shared machine lands on all of them within one round, so their step times compare."""
    while not all(one.done for one in passes):
        for one in passes:
            if not one.done:
                one.step()
    return tuple(one.run() for one in passes)


def mean_ms(steps: list[dict], key: str) -> float:
    return 1e3 * sum(s[key] for s in steps) / len(steps)


def median_ms(steps: list[dict]) -> float:
    return 1e3 * percentile([s["wall_s"] for s in steps], 50)


def _constrained_requests(work: StructuredWorkload, r: int) -> list:
    from tokenmill.engine.types import EngineRequest, SamplingParams, StructuredOutputsParams

    return [EngineRequest(request_id=f"c{r}.{i}", prompt_token_ids=p, tenant=f"c{r}", sampling=SamplingParams(
                max_tokens=work.max_tokens, temperature=0.0,
                structured_outputs=StructuredOutputsParams(json=work.schema_of(i).schema)))
            for i, p in enumerate(work.prompts)]


def _plain_requests(work: StructuredWorkload, r: int, lengths: list[int]) -> list:
    from tokenmill.engine.types import EngineRequest, SamplingParams

    return [EngineRequest(request_id=f"u{r}.{i}", prompt_token_ids=p, tenant=f"u{r}", sampling=SamplingParams(
                max_tokens=length, temperature=0.0, ignore_eos=True))
            for i, (p, length) in enumerate(zip(work.prompts, lengths, strict=True))]


def _masked_drive(engine, requests: list) -> tuple[PassRun, list[float], list[int]]:
    """drive, with the mask timings (seconds, rows) the engine recorded during the pass."""
    k = len(engine.metrics.mask_s)
    run = drive(engine, requests)
    return run, engine.metrics.mask_s[k:], engine.metrics.mask_rows[k:]


def _per_schema(work: StructuredWorkload, outputs: list) -> dict[str, dict[str, Any]]:
    """Schema name -> requests, how many ended with "stop", mean output tokens."""
    table: dict[str, dict[str, Any]] = {}
    for i, d in enumerate(outputs):
        entry = table.setdefault(work.schema_of(i).name, {"requests": 0, "stop": 0, "tokens": 0})
        entry["requests"] += 1
        entry["tokens"] += len(d.output_token_ids or [])
        entry["stop"] += d.finish_reason is not None and d.finish_reason.value == "stop"
    for entry in table.values():
        entry["mean_tokens"] = entry.pop("tokens") / entry["requests"]
    return table


def run_structured(model_dir: Path, work: StructuredWorkload, engine_options: dict[str, Any], *,
                   repeats: int = 1,
                   on_engine: Callable[[Any], dict] | None = None) -> dict[str, Any]:
    """The passes; the report's figures (see the module docstring). `repeats` timed pairs, each
    in lockstep on two engines; their step times pool.
    `on_engine`, when given, describes the engine after the passes (tools/gpu_check records its GPU
    path with it)."""
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.engine.types import EngineRequest, SamplingParams, StructuredOutputsParams

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    engine = new_engine(EngineConfig(model=str(model_dir), **engine_options))
    # Warm-up outside the timings: kernels and plans, and the constraint backend's first use (its
    # tokenizer tables) through a choice constraint that none of the workload's requests share.
    warm_up(engine, [
        EngineRequest(request_id="warm-0", prompt_token_ids=[1] * 40,
                      sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)),
        EngineRequest(request_id="warm-1", prompt_token_ids=[2] * 20,
                      sampling=SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=StructuredOutputsParams(
                          choice=["warm-up yes", "warm-up no"]))),
    ])
    n = len(work.prompts)
    m = engine.metrics
    n_compile, failures0 = len(m.compile_s), m.constraint_failures
    first, mask_s, mask_rows = _masked_drive(engine, _constrained_requests(work, 0))
    outputs = [first.results[f"c0.{i}"] for i in range(n)]
    lengths = [len(d.output_token_ids or []) for d in outputs]
    if min(lengths) < 1:
        raise RuntimeError("a constrained request produced no tokens; the unconstrained pass cannot match it")
    # The timed pairs: the constrained pass again on this engine and the unconstrained one on a
    # second engine of the same model and settings, stepped in turn (drive_in_lockstep).
    plain_engine = Engine(EngineConfig(model=str(model_dir), **engine_options))
    plain_engine.generate([EngineRequest(request_id="warm", prompt_token_ids=[1] * 40,
                                         sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))])
    map_kv_cache(engine)  # both caches mapped before the timed pairs
    map_kv_cache(plain_engine)
    pairs: list[tuple[PassRun, PassRun]] = []
    repeats_equal = True
    for r in range(1, repeats + 1):
        k = len(engine.metrics.mask_s)
        c_run, u_run = drive_in_lockstep(SteppedPass(engine, _constrained_requests(work, r)),
                                         SteppedPass(plain_engine, _plain_requests(work, r, lengths)))
        mask_s, mask_rows = mask_s + engine.metrics.mask_s[k:], mask_rows + engine.metrics.mask_rows[k:]
        repeats_equal &= all(c_run.results[f"c{r}.{i}"].output_token_ids == outputs[i].output_token_ids
                             for i in range(n))
        if plain_engine.metrics.mask_s:
            raise RuntimeError("the unconstrained pass masked rows: it would not be a baseline")
        if u_run.output_tokens != first.output_tokens:
            raise RuntimeError(f"unconstrained pass produced {u_run.output_tokens} tokens, "
                               f"the constrained one {first.output_tokens}")
        pairs.append((c_run, u_run))
    m = engine.metrics
    compile_s, failures = m.compile_s[n_compile:], m.constraint_failures - failures0
    kv_blocks_total = engine.stats().kv_blocks_total
    engine_notes = on_engine(engine) if on_engine is not None else {}
    del engine, plain_engine
    gc.collect()

    peak = max(s["seqs"] for s in first.steps)
    c_steps = [s for c_run, _ in pairs for s in c_run.decode_steps_at(peak)]
    u_steps = [s for _, u_run in pairs for s in u_run.decode_steps_at(peak)]
    if not c_steps or not u_steps:
        raise RuntimeError(f"no pure decode step at the peak batch of {peak} rows "
                           f"(constrained {len(c_steps)}, unconstrained {len(u_steps)}): raise max_tokens")
    c_ms, u_ms = mean_ms(c_steps, "wall_s"), mean_ms(u_steps, "wall_s")
    c_cpu_ms, u_cpu_ms = mean_ms(c_steps, "cpu_s"), mean_ms(u_steps, "cpu_s")
    pair_overheads = [mean_ms(c.decode_steps_at(peak), "wall_s") / mean_ms(u.decode_steps_at(peak), "wall_s") - 1
                      for c, u in pairs if c.decode_steps_at(peak) and u.decode_steps_at(peak)]
    mask_at_peak = [s for s, rows in zip(mask_s, mask_rows, strict=True) if rows == peak]
    mask_peak_ms = 1e3 * sum(mask_at_peak) / len(mask_at_peak) if mask_at_peak else 0.0

    checked = check_outputs([
        (d.output_text or "", d.finish_reason.value if d.finish_reason else "none", work.schema_of(i))
        for i, d in enumerate(outputs)
    ])
    c_wall = sum(c.wall_s for c, _ in pairs)
    u_wall = sum(u.wall_s for _, u in pairs)
    tokens = first.output_tokens * len(pairs)
    return dict(
        requests=n, schemas=len(work.schemas), sampling="greedy", constrained_max_tokens=work.max_tokens,
        repeats=len(pairs), repeat_outputs_equal=repeats_equal,
        step_overhead_fraction=c_ms / u_ms - 1.0 if u_ms > 0 else 0.0,
        step_ms_constrained=c_ms, step_ms_unconstrained=u_ms, peak_running=peak,
        peak_decode_steps_constrained=len(c_steps), peak_decode_steps_unconstrained=len(u_steps),
        step_overhead_fraction_pairs=pair_overheads,
        # the same by median step: a neighbour's burst on a shared machine moves a mean more
        step_overhead_fraction_median=median_ms(c_steps) / median_ms(u_steps) - 1.0,
        step_overhead_fraction_by_cpu_time=c_cpu_ms / u_cpu_ms - 1.0 if u_cpu_ms > 0 else 0.0,
        step_cpu_ms_constrained=c_cpu_ms, step_cpu_ms_unconstrained=u_cpu_ms,
        # forward + LM head + sampling (the mask's apply included) of the same steps
        step_model_ms_constrained=mean_ms(c_steps, "model_s"), step_model_ms_unconstrained=mean_ms(u_steps, "model_s"),
        mask_ms_p50=1e3 * percentile(mask_s, 50), mask_ms_p99=1e3 * percentile(mask_s, 99),
        mask_ms_at_peak=mask_peak_ms, mask_share_of_step_at_peak=mask_peak_ms / c_ms if c_ms > 0 else 0.0,
        mask_steps=len(mask_s),
        compile_ms_p50=1e3 * percentile(compile_s, 50), compile_ms_p99=1e3 * percentile(compile_s, 99),
        compiles=len(compile_s), constraint_failures=failures,
        valid_fraction=checked.valid_fraction, valid=checked.valid, stop=checked.stop, length=checked.length,
        other_finish=checked.other, whitespace_runs=checked.whitespace_runs, problems=checked.problems,
        per_schema=_per_schema(work, outputs),
        output_tokens=first.output_tokens,
        constrained_output_tok_s=tokens / c_wall if c_wall > 0 else 0.0,
        unconstrained_output_tok_s=tokens / u_wall if u_wall > 0 else 0.0,
        constrained_wall_s=c_wall, unconstrained_wall_s=u_wall,
        constrained_cpu_s=sum(c.cpu_s for c, _ in pairs), unconstrained_cpu_s=sum(u.cpu_s for _, u in pairs),
        constrained_steps=len(first.steps), unconstrained_steps=len(pairs[0][1].steps),
        kv_blocks_total=kv_blocks_total, **engine_notes,
    )


def format_structured_table(report: dict[str, Any]) -> str:
    r = report
    rows = [
        ("workload", f"{r['workload']} ({r['requests']} requests over {r['schemas']} JSON schemas, {r['sampling']})"),
        ("model", r["model"]),
        ("step overhead at peak", f"{100 * r['step_overhead_fraction']:+.1f}%  ({r['step_ms_constrained']:.2f} ms "
                                  f"constrained vs {r['step_ms_unconstrained']:.2f} ms, {r['peak_running']} rows, "
                                  f"{r['peak_decode_steps_constrained']}/{r['peak_decode_steps_unconstrained']} "
                                  f"decode steps)"),
        ("  by median step", f"{100 * r['step_overhead_fraction_median']:+.1f}%  (per pair of passes: "
                             + ", ".join(f"{100 * x:+.1f}%" for x in r["step_overhead_fraction_pairs"]) + ")"),
        ("  by process CPU time", f"{100 * r['step_overhead_fraction_by_cpu_time']:+.1f}%  "
                                  f"({r['step_cpu_ms_constrained']:.2f} ms vs {r['step_cpu_ms_unconstrained']:.2f} ms)"),
        ("  model part of the step", f"{r['step_model_ms_constrained']:.2f} ms vs "
                                     f"{r['step_model_ms_unconstrained']:.2f} ms (forward, LM head, mask, sampling)"),
        ("mask ms per step p50 / p99", f"{r['mask_ms_p50']:.2f} / {r['mask_ms_p99']:.2f}  (at peak "
                                       f"{r['mask_ms_at_peak']:.2f} ms = {100 * r['mask_share_of_step_at_peak']:.1f}% "
                                       f"of the step; {r['mask_steps']} steps)"),
        ("compile ms p50 / p99", f"{r['compile_ms_p50']:.2f} / {r['compile_ms_p99']:.2f}  ({r['compiles']} compiles, "
                                 f"{r['constraint_failures']} failures)"),
        ("valid (of stop)", f"{r['valid']}/{r['stop']} = {r['valid_fraction']:.3f}  (stop {r['stop']}, length "
                            f"{r['length']}, other {r['other_finish']})"),
        ("whitespace runs", r["whitespace_runs"]),
        ("output tok/s constrained", f"{r['constrained_output_tok_s']:.1f}  ({r['constrained_wall_s']:.1f} s)"),
        ("output tok/s unconstrained", f"{r['unconstrained_output_tok_s']:.1f}  ({r['unconstrained_wall_s']:.1f} s)"),
    ]
    rows += [(f"  {name}", f"{e['stop']}/{e['requests']} stop, {e['mean_tokens']:.0f} tokens mean")
             for name, e in r["per_schema"].items()]
    rows += [("problem", p) for p in r["problems"]]
    rows += startup_rows(report)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
