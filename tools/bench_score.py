"""`bench --workload score`: multiple-choice loglikelihoods, the engine against transformers.

The workload (`score_workload`): 64 four-choice questions; each question is a shared context of
384-416 random token ids and four continuations of 8-12 ids (ordinary ids of the model's
vocabulary, no special ids, seeded). Every choice is one score-only request: the prompt is
context + continuation, `max_tokens` 0, `prompt_logprobs` 0, `score_from` = len(context), so its
loglikelihood is the request's `prompt_logprob_sum`. 256 requests in all, as an evaluation
harness sends them for an MMLU-style task.

Engine side: all requests through one `Engine.generate` (prefix cache on, the bench's engine
settings), after a short warm-up that shares no tokens with the work. The context of a question
is computed once: the first of its choices computes it, the other three are held back by the
prefix-aware admission until its blocks are cached and then compute only from the last cached
block boundary before `score_from - 1` (the hidden state there scores the first continuation
token). `prefill_tokens_computed` is the engine's count of prompt tokens actually computed.

Baseline: transformers `AutoModelForCausalLM` (the same checkpoint and dtype, the same process,
after the engine), the way lm-evaluation-harness's `hf` model scores: batches of requests in
arrival order, context + continuation right-padded with an attention mask, one forward over the
whole batch (logits for every position), log_softmax at the positions that predict a
continuation token, gathered and summed. Batch sizes 8 and 32 each run the first
`calibration_requests` (64) requests; the faster runs the whole workload (`full_sweep`: both
run it all). The engine's sums must equal the baseline's within `LOGLIKELIHOOD_TOL` on every
request (`check_agreement`), or the bench fails.

Throughput: requests, and prompt tokens (context + continuation), per second of wall time, from
handing over the requests to the last result. `ratio` = engine requests/s over the best
baseline's. `peak_rss_mb`: the process's peak resident set size (VmHWM) right after the
engine run, before the baseline model is loaded.

Memory figure (`memory_figure`, part of the report unless `memory_tokens` is 0): one prompt of
4,096 random ids, run in fresh child processes (at once), once scored (`prompt_logprobs` 0,
`score_from` 1, `max_tokens` 0: 4,095 positions scored) and once plain (no prompt logprobs,
`max_tokens` 1), plus a child that only builds the engine. Each child reports its own peak RSS
(VmHWM, see `peak_rss_mb`), so neither measurement hides the other. The children's KV cache is
sized to the one prompt (`kv_cache_gb` unless given): the engine zero-fills its KV cache, so a
default-sized cache would add the same 2 GiB to both sides and flatten the ratio. A model whose context is
shorter than the prompt is run from a copy of its checkpoint whose config allows it (same
weights; for the bundled tiny models with plain RoPE this changes nothing but the limit).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.tools.bench_startup import new_engine, startup_rows, warm_up

NUM_QUESTIONS = 64
CHOICES = 4
CONTEXT_LEN = (384, 416)  # inclusive range of a question's context length
CONTINUATION_LEN = (8, 12)  # inclusive range of a choice's length
BASELINE_BATCHES = (8, 32)
CALIBRATION_REQUESTS = 64
LOGLIKELIHOOD_TOL = 1e-3  # |engine sum - transformers sum| allowed per request (fp32)
MEMORY_TOKENS = 4096


class LoglikelihoodMismatch(RuntimeError):
    """The engine's loglikelihoods differ from the baseline's beyond the tolerance."""


@dataclass
class ScoreWorkload:
    contexts: list[list[int]]  # one per question
    choices: list[list[list[int]]]  # per question, CHOICES continuations

    @property
    def prompts(self) -> list[list[int]]:
        return [ctx + cont for ctx, conts in zip(self.contexts, self.choices, strict=True) for cont in conts]

    @property
    def score_from(self) -> list[int]:
        return [len(ctx) for ctx, conts in zip(self.contexts, self.choices, strict=True) for _ in conts]

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.choices)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def scored_tokens(self) -> int:
        return sum(len(cont) for conts in self.choices for cont in conts)

    def head(self, num_requests: int) -> tuple[list[list[int]], list[int]]:
        """The first requests' (prompts, score_from)."""
        return self.prompts[:num_requests], self.score_from[:num_requests]


def score_workload(vocab_size: int, num_questions: int = NUM_QUESTIONS, seed: int = 0,
                   special: set[int] = frozenset(), context_len: tuple[int, int] = CONTEXT_LEN,
                   continuation_len: tuple[int, int] = CONTINUATION_LEN, choices: int = CHOICES) -> ScoreWorkload:
    from tokenmill.tools.bench_workloads import token_range

    if num_questions < 1:
        raise ValueError(f"the score workload needs at least one question, got {num_questions}")
    if not (1 <= context_len[0] <= context_len[1]) or not (1 <= continuation_len[0] <= continuation_len[1]):
        raise ValueError(f"bad lengths: context {context_len}, continuation {continuation_len} (need 1 <= lo <= hi)")
    rng = random.Random(seed + 2)
    lo, hi = token_range(vocab_size, set(special))
    contexts, conts = [], []
    for _ in range(num_questions):
        contexts.append([rng.randint(lo, hi) for _ in range(rng.randint(*context_len))])
        conts.append([[rng.randint(lo, hi) for _ in range(rng.randint(*continuation_len))] for _ in range(choices)])
    return ScoreWorkload(contexts, conts)


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB: VmHWM of /proc/self/status, the
    high-water mark of this process's own memory. Not ru_maxrss where VmHWM is available: Linux
    carries the maximum over to a child across fork and exec, so a child started by a process of
    5 GiB reports at least 5 GiB there whatever it does itself."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def check_agreement(engine_sums: list[float], baseline_sums: list[float], tol: float = LOGLIKELIHOOD_TOL) -> float:
    """The largest |engine - baseline| over the requests; raises LoglikelihoodMismatch when a
    request differs by more than `tol` (or is not a number, or the counts differ)."""
    if len(engine_sums) != len(baseline_sums):
        raise LoglikelihoodMismatch(f"{len(engine_sums)} engine loglikelihoods against {len(baseline_sums)} baseline ones")
    diffs = [abs(a - b) for a, b in zip(engine_sums, baseline_sums, strict=True)]
    bad = [(i, engine_sums[i], baseline_sums[i]) for i, d in enumerate(diffs) if not d <= tol]  # NaN is bad
    if bad:
        shown = ", ".join(f"request {i}: engine {a:.6f} vs transformers {b:.6f}" for i, a, b in bad[:5])
        raise LoglikelihoodMismatch(f"{len(bad)} of {len(diffs)} loglikelihoods differ by more than {tol}: {shown}")
    return max(diffs, default=0.0)


# ---------------------------------------------------------------------------------------------
# engine side


def _score_requests(prompts: list[list[int]], score_from: list[int], tag: str, tenant: str | None = None):
    from tokenmill.engine.types import EngineRequest, SamplingParams

    return [
        EngineRequest(request_id=f"{tag}-{i}", prompt_token_ids=p, tenant=tenant,
                      sampling=SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0, score_from=s))
        for i, (p, s) in enumerate(zip(prompts, score_from, strict=True))
    ]


def _finished_sums(results: dict, requests: list) -> list[float]:
    sums = []
    for r in requests:
        d = results.get(r.request_id)
        if d is None:
            raise RuntimeError(f"the engine did not finish request {r.request_id}")
        if d.error is not None or d.prompt_logprob_sum is None:
            raise RuntimeError(f"request {r.request_id} was not scored: {d.finish_reason} {d.error or ''}".strip())
        want = len(r.prompt_token_ids) - r.sampling.score_from
        if len(d.prompt_logprobs) != want:
            raise RuntimeError(f"request {r.request_id}: {len(d.prompt_logprobs)} scored positions, expected {want}")
        sums.append(d.prompt_logprob_sum)
    return sums


def run_engine_score(model_dir: Path, work: ScoreWorkload, engine_options: dict[str, Any]) -> dict[str, Any]:
    from tokenmill.engine import EngineConfig
    from tokenmill.engine.engine import EngineMetrics

    engine = new_engine(EngineConfig(model=str(model_dir), **engine_options))
    # Warm-up in its own tenant, so nothing of it is a cache hit for the work.
    warm = _score_requests([[1] * 40 + [2] * 8, [2] * 20], [40, 10], "warm", tenant="bench-warm-up")
    warm_up(engine, warm)
    engine.metrics = EngineMetrics()
    before = engine.stats()

    requests = _score_requests(work.prompts, work.score_from, "score")
    c0, t0 = time.process_time(), time.perf_counter()
    results = engine.generate(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss = peak_rss_mb()
    sums = _finished_sums(results, requests)
    m, stats = engine.metrics, engine.stats()
    run = {
        "wall_s": wall, "cpu_s": cpu, "sums": sums,
        "prefill_tokens_computed": m.prompt_tokens_computed,
        "cached_prompt_tokens": stats.cached_prompt_tokens_total - before.cached_prompt_tokens_total,
        "steps": stats.steps - before.steps, "preemptions": m.num_preemptions, "peak_running": m.peak_running,
        "peak_rss_mb": rss, "dtype": str(engine.model_config.dtype).removeprefix("torch."),
    }
    del engine, results
    gc.collect()
    return run


# ---------------------------------------------------------------------------------------------
# transformers side


def hf_loglikelihoods(model, prompts: list[list[int]], score_from: list[int], batch_size: int,
                      pad_id: int) -> tuple[list[float], float, float]:
    """Each prompt's sum of log p(token p | tokens < p) for p >= its score_from, in batches of
    `batch_size` (arrival order, right padding, attention mask, logits of every position as
    lm-evaluation-harness's `hf` model computes them); (sums, wall s, CPU s)."""
    import torch

    sums: list[float] = []
    c0, t0 = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, p in enumerate(batch):
                ids[i, : len(p)] = torch.tensor(p)
                mask[i, : len(p)] = 1
            logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
            for i, p in enumerate(batch):
                s = score_from[start + i]
                lp = torch.log_softmax(logits[i, s - 1 : len(p) - 1].float(), dim=-1)
                target = torch.tensor(p[s:], device=lp.device)
                sums.append(float(lp.gather(1, target[:, None]).sum()))
            del logits
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return sums, time.perf_counter() - t0, time.process_time() - c0


def run_hf_score(model_dir: Path, work: ScoreWorkload, dtype: str, *, full_sweep: bool = False,
                 batches: tuple[int, ...] = BASELINE_BATCHES,
                 calibration_requests: int = CALIBRATION_REQUESTS) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype or "auto").eval()
    pad_id = model.generation_config.pad_token_id
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    pad_id = 0 if pad_id is None else pad_id
    hf_loglikelihoods(model, [[1] * 40 + [2] * 8, [2] * 20], [40, 10], 2, pad_id)  # warm-up
    prompts, score_from = work.prompts, work.score_from
    sample = len(prompts) if full_sweep else min(calibration_requests, len(prompts))
    calibration: dict[int, float] = {}
    timed: dict[int, tuple[list[float], float, float]] = {}
    for bsz in batches:
        timed[bsz] = hf_loglikelihoods(model, prompts[:sample], score_from[:sample], bsz, pad_id)
        calibration[bsz] = sample / timed[bsz][1]
    best = max(calibration, key=calibration.get)
    if sample == len(prompts):
        sums, wall, cpu = timed[best]
    else:
        sums, wall, cpu = hf_loglikelihoods(model, prompts, score_from, best, pad_id)
    del model
    gc.collect()
    return {"batch_size": best, "wall_s": wall, "cpu_s": cpu, "sums": sums, "calibration": calibration,
            "calibration_requests": sample}


# ---------------------------------------------------------------------------------------------
# memory figure: one long prompt, scored against plain, each in a fresh child process


def _model_allowing(model_dir: Path, positions: int) -> Path:
    """`model_dir`, or a cached copy of it whose config allows `positions` positions."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.tools.tiny_models import build_once, cache_root

    if load_model_config(model_dir).max_model_len >= positions:
        return model_dir
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("rope_scaling"):
        raise ValueError(f"{model_dir} allows fewer than {positions} positions and has RoPE scaling; "
                         "choose a shorter --memory-tokens or a model with a longer context")
    limit = 1 << (positions - 1).bit_length()
    # Named after the source directory's path too: two checkpoints named alike never share a copy.
    tag = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:8]
    target = cache_root() / "models" / f"{model_dir.name}-{tag}-ctx{limit}"

    def build(tmp: Path) -> None:
        for item in model_dir.iterdir():
            if item.is_file():
                shutil.copy2(item, tmp / item.name)
        config["max_position_embeddings"] = limit
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return build_once(target, build)


def _kv_cache_gb_for(model_dir: Path, tokens: int, dtype: str, block_size: int) -> float:
    """A KV cache holding one sequence of `tokens` tokens, plus 4 blocks."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.model_runner import ModelRunner

    mc = load_model_config(model_dir, dtype)
    blocks = math.ceil(tokens / block_size) + 4
    return blocks * ModelRunner.kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype,
                                                   block_size) / 1024**3


def _memory_child(mode: str, model_dir: str, tokens: int, options: dict[str, Any], seed: int) -> dict[str, Any]:
    """Runs in the child: build the engine, run the one prompt (mode scored / plain) or nothing
    (loaded), and report this process's peak RSS."""
    import torch

    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.types import EngineRequest, SamplingParams

    torch.set_num_threads(int(options.pop("threads", 1)))
    engine = Engine(EngineConfig(model=model_dir, **options))
    out: dict[str, Any] = {"mode": mode}
    if mode != "loaded":
        mc = load_model_config(Path(model_dir))
        from tokenmill.tools.bench_workloads import token_range

        lo, hi = token_range(mc.vocab_size, set(mc.eos_token_ids))
        rng = random.Random(seed + 3)
        prompt = [rng.randint(lo, hi) for _ in range(tokens)]
        if mode == "scored":
            sampling = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0, score_from=1)
        else:
            sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        d = engine.generate([EngineRequest(request_id="m", prompt_token_ids=prompt, sampling=sampling)])["m"]
        out["wall_s"] = time.perf_counter() - t0
        if d.error is not None:
            raise RuntimeError(f"the {mode} request failed: {d.error}")
        if mode == "scored":
            if len(d.prompt_logprobs or []) != tokens - 1 or not math.isfinite(d.prompt_logprob_sum):
                raise RuntimeError(f"the scored request gave {len(d.prompt_logprobs or [])} records, expected {tokens - 1}")
            out["scored_positions"] = len(d.prompt_logprobs)
        elif len(d.output_token_ids) != 1:
            raise RuntimeError(f"the plain request produced {len(d.output_token_ids)} tokens, expected 1")
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def memory_figure(model_dir: Path, engine_options: dict[str, Any], tokens: int = MEMORY_TOKENS, seed: int = 0,
                  threads: int = 1, timeout_s: float = 600) -> dict[str, Any]:
    """Peak RSS of a child scoring one `tokens`-token prompt against a child running it plainly."""
    if tokens < 2:
        raise ValueError(f"the memory figure needs a prompt of at least 2 tokens, got {tokens}")
    run_dir = _model_allowing(model_dir, tokens + 1)
    options = {k: v for k, v in engine_options.items() if v is not None}
    if options.get("kv_cache_gb") is None:
        options["kv_cache_gb"] = _kv_cache_gb_for(run_dir, tokens + 1, options.get("dtype", "auto"),
                                                  options.get("block_size", 16))
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("OMP_NUM_THREADS", str(threads))
    # The three children run at once: each measures only its own peak, and a run's peak does not
    # depend on its speed.
    procs = {}
    for mode in ("loaded", "plain", "scored"):
        cmd = [sys.executable, "-m", "tokenmill.tools.bench_score", "--memory-child", mode, "--model-dir", str(run_dir),
               "--tokens", str(tokens), "--seed", str(seed),
               "--options", json.dumps({**options, "threads": threads})]
        procs[mode] = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    runs: dict[str, dict[str, Any]] = {}
    failures = []
    try:
        for mode, proc in procs.items():
            out, err = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                failures.append(f"the {mode} memory run failed (exit {proc.returncode}):\n{err[-3000:]}")
            else:
                runs[mode] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failures:
        raise RuntimeError("\n".join(failures))
    scored, plain, loaded = (runs[m]["peak_rss_mb"] for m in ("scored", "plain", "loaded"))
    return {
        "memory_prompt_tokens": tokens,
        "memory_model_dir": str(run_dir),
        "memory_kv_cache_gb": options["kv_cache_gb"],
        "peak_rss_mb_loaded": loaded,
        "peak_rss_mb_plain": plain,
        "peak_rss_mb_scored": scored,
        "memory_ratio": scored / plain,
        # What each run added to the loaded engine's peak: the part the request itself needed.
        "memory_increment_ratio": (scored - loaded) / (plain - loaded) if plain > loaded else float("nan"),
    }


# ---------------------------------------------------------------------------------------------


def run_score(model: str, model_dir: Path, mc, *, num_requests: int | None = None, seed: int = 0,
              engine_options: dict[str, Any] | None = None, full_sweep: bool = False,
              context_len: tuple[int, int] = CONTEXT_LEN, continuation_len: tuple[int, int] = CONTINUATION_LEN,
              memory_tokens: int = MEMORY_TOKENS, threads: int = 1,
              tol: float = LOGLIKELIHOOD_TOL) -> dict[str, Any]:
    """The score workload's report (`num_requests`: a multiple of 4, default 256)."""
    options = dict(engine_options or {})
    num_requests = num_requests or NUM_QUESTIONS * CHOICES
    if num_requests % CHOICES:
        raise ValueError(f"the score workload runs {CHOICES} requests per question: --requests must be a "
                         f"multiple of {CHOICES}, got {num_requests}")
    work = score_workload(mc.vocab_size, num_requests // CHOICES, seed, set(mc.eos_token_ids),
                          context_len, continuation_len)
    need = max(len(p) for p in work.prompts)
    if need > mc.max_model_len:
        raise ValueError(f"the workload needs {need} positions; {model} allows {mc.max_model_len}")

    engine = run_engine_score(model_dir, work, options)
    base = run_hf_score(model_dir, work, engine["dtype"], full_sweep=full_sweep)
    max_diff = check_agreement(engine["sums"], base["sums"], tol)
    n, tokens = work.num_requests, work.prompt_tokens
    engine_rps, base_rps = n / engine["wall_s"], n / base["wall_s"]
    report: dict[str, Any] = {
        "workload": "score",
        "model": model,
        "questions": len(work.contexts),
        "requests": n,
        "scored_tokens": work.scored_tokens,
        "engine_requests_s": engine_rps,
        "engine_tok_s": tokens / engine["wall_s"],
        "baseline": "transformers forward over context+continuation, right padding, best batch of 8/32",
        "baseline_requests_s": base_rps,
        "baseline_tok_s": tokens / base["wall_s"],
        "baseline_batch_size": base["batch_size"],
        "baseline_calibration_requests_s": {str(k): v for k, v in base["calibration"].items()},
        "baseline_calibration_requests": base["calibration_requests"],
        "ratio": engine_rps / base_rps,
        "ratio_by_cpu_time": base["cpu_s"] / engine["cpu_s"] if engine["cpu_s"] > 0 else 0.0,
        "prompt_tokens": tokens,
        "prefill_tokens_computed": engine["prefill_tokens_computed"],
        "prefill_fraction": engine["prefill_tokens_computed"] / tokens,
        "cached_prompt_tokens": engine["cached_prompt_tokens"],
        "loglikelihood_max_abs_diff": max_diff,
        "loglikelihood_tol": tol,
        "peak_rss_mb": engine["peak_rss_mb"],
        "engine_wall_s": engine["wall_s"],
        "baseline_wall_s": base["wall_s"],
        "engine_cpu_s": engine["cpu_s"],
        "baseline_cpu_s": base["cpu_s"],
        "engine_steps": engine["steps"],
        "engine_peak_running": engine["peak_running"],
        "engine_preemptions": engine["preemptions"],
        "dtype": engine["dtype"],
    }
    if memory_tokens:
        report.update(memory_figure(model_dir, options, memory_tokens, seed, threads))
    report["engine_options"] = options
    return report


def format_score_table(report: dict[str, Any]) -> str:
    rows = [
        ("workload", report["workload"]),
        ("model", report["model"]),
        ("requests (questions x 4)", f"{report['requests']} ({report['questions']} x 4)"),
        ("engine requests/s, tok/s", f"{report['engine_requests_s']:.1f}, {report['engine_tok_s']:.0f}"),
        ("baseline requests/s, tok/s", f"{report['baseline_requests_s']:.1f}, {report['baseline_tok_s']:.0f}  "
                                       f"(batch {report['baseline_batch_size']})"),
        ("ratio", f"{report['ratio']:.2f}  (by process CPU time: {report['ratio_by_cpu_time']:.2f})"),
        ("prefill tokens computed / prompt tokens",
         f"{report['prefill_tokens_computed']} / {report['prompt_tokens']} = {report['prefill_fraction']:.3f}"),
        ("loglikelihood max |diff|", f"{report['loglikelihood_max_abs_diff']:.2e} (tol {report['loglikelihood_tol']})"),
        ("peak RSS (engine run)", f"{report['peak_rss_mb']:.0f} MiB"),
    ]
    if "memory_ratio" in report:
        rows.append((f"peak RSS, {report['memory_prompt_tokens']}-token prompt",
                     f"scored {report['peak_rss_mb_scored']:.0f} / plain {report['peak_rss_mb_plain']:.0f} MiB = "
                     f"{report['memory_ratio']:.3f}  (engine loaded: {report['peak_rss_mb_loaded']:.0f} MiB)"))
    rows += startup_rows(report)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="memory-figure child of bench --workload score (internal)")
    p.add_argument("--memory-child", required=True, choices=["loaded", "plain", "scored"])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--options", default="{}")
    args = p.parse_args(argv)
    out = _memory_child(args.memory_child, args.model_dir, args.tokens, json.loads(args.options), args.seed)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
