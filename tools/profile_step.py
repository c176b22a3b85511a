"""Where an engine step's time goes: the `mixed` workload with a timer around each part of a step.

    python -m tools.profile_step --model tiny-llama --threads 1 2 [--num-requests 256] [--json out.json]

Each part is timed exclusively (a part called inside another counts for itself only), so the rows
add up to the run's wall time. The parts:

- scheduling       Scheduler.schedule
- step inputs      ModelRunner.prepare (ids, positions, slots, block tables, rows to sample)
- GEMM             the layers' projections (qkv, o, gate_up, down): F.linear, oneDNN, AMX or the
                   fixed-order GEMM of batch_invariant
- LM head          compute_logits
- decode attention (the C kernel or the torch path), prefill attention (SDPA or the AMX kernel, and
  the C kernel's share for short prefill rows, split from one call by keys read), KV write (with the
  rotary of q and k where the two are one C pass), attention, other (the per-step plan, output copies)
- element-wise     norms, rotary, SiLU x mul
- forward, other   the rest of the model's forward (embedding, index_select, Python per layer)
- sampling         launch_sampling (the sampler, ids to the host)
- detokenize       the incremental detokenizer
- take-in, other   the rest of taking a step's tokens in (append, stop rule, deltas, ends)
- step, other      the rest of Engine.step; driver: generate()'s loop around it

Run per thread count in a child process (torch's thread pool is fixed at its first use). The table
puts the thread counts side by side with the speed-up of each part: a part near 1.0x runs on one
core only. The timers cost about a microsecond per call, so the timed run is a little slower than
`tokenmill bench`; the untimed wall time of the same run is printed beside it.

The timed run takes the Python layers, whose kernel calls the timers wrap; the untimed run takes a
pure decode step's layers in one C call where the engine does (kernels/cpu/decode_layers.py),
so the gap between the two figures includes that. The timed and untimed runs take every step whole. From two threads the engine cuts a step's model
body into parts that run side by side on threads of their own (worker/engine/cpu/step_parts.py),
which per-part timers on one thread cannot follow: a third run, untimed, with the engine's parts,
is printed below the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

PARTS = ("scheduling", "step inputs", "GEMM", "LM head", "decode attention", "prefill attention", "KV write",
         "attention, other", "element-wise", "forward, other", "sampling", "detokenize", "take-in, other",
         "step, other", "driver")


class PartTimer:
    """Exclusive wall time per part: entering a part pauses the one it is called from."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [part, start of its current stretch]

    def wrap(self, part: str | Callable[[list[str]], str], fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            now = time.perf_counter()
            stack = self._stack
            if stack:
                top = stack[-1]
                self.seconds[top[0]] += now - top[1]
            name = part if isinstance(part, str) else part([f[0] for f in stack])
            stack.append([name, now])
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                frame = stack.pop()
                self.seconds[frame[0]] += end - frame[1]
                self.calls[frame[0]] += 1
                if stack:
                    stack[-1][1] = end
        return timed


def _patch(stack: ExitStack, owner: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    setattr(owner, name, wrapper(original))
    stack.callback(setattr, owner, name, original)


def _instrument(stack: ExitStack, timer: PartTimer) -> None:
    import torch.nn.functional as F

    from tokenmill.engine import engine as engine_module
    from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
    from tokenmill.engine.detokenizer import IncrementalDetokenizer
    from tokenmill.engine.model_runner import ModelRunner
    from tokenmill.engine.models import decoder as decoder_module
    from tokenmill.engine.models import ops as ops_module
    from tokenmill.engine.models.decoder import DecoderForCausalLM
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.kernels.cpu import amx_gemm, amx_prefill_attention, decode_attention, gemm, invariant_gemm

    def linear_part(parents: list[str]) -> str:
        return "LM head" if "LM head" in parents else "GEMM"

    for owner, name, part in [
        (Scheduler, "schedule", "scheduling"),
        (ModelRunner, "prepare", "step inputs"),
        (ModelRunner, "execute", "forward, other"),
        (DecoderForCausalLM, "compute_logits", "LM head"),
        (DecoderForCausalLM, "greedy_ids", "LM head"),
        (TorchAttentionBackend, "write_kv", "KV write"),
        (ops_module.TorchOps, "rotary_write_kv", "KV write"),  # with the rotary, where the two are one pass
        (TorchAttentionBackend, "attend", "attention, other"),
        (TorchAttentionBackend, "_decode", "decode attention"),
        (TorchAttentionBackend, "_prefill", "prefill attention"),
        (ops_module.TorchOps, "add_rms_norm", "element-wise"),
        (ops_module.TorchOps, "rotary_qk", "element-wise"),
        (ops_module.TorchOps, "silu_and_mul", "element-wise"),
        (IncrementalDetokenizer, "add", "detokenize"),
        (IncrementalDetokenizer, "flush", "detokenize"),
        (engine_module.Engine, "_take_in", "take-in, other"),
        (engine_module.Engine, "step", "step, other"),
        (engine_module, "launch_sampling", "sampling"),
    ]:
        _patch(stack, owner, name, lambda fn, part=part: timer.wrap(part, fn))
    _patch(stack, decode_attention, "paged_decode_attention", lambda fn: _kernel_split(timer, fn))
    _patch(stack, amx_prefill_attention, "prefill_attention_rows", lambda fn: timer.wrap("prefill attention", fn))
    _patch(stack, F, "linear", lambda fn: timer.wrap(linear_part, fn))
    _patch(stack, gemm, "linear", lambda fn: timer.wrap(linear_part, fn))
    _patch(stack, amx_gemm.SplitWeight, "_gemm", lambda fn: timer.wrap(linear_part, fn))
    _patch(stack, invariant_gemm.InvariantWeight, "_gemm", lambda fn: timer.wrap(linear_part, fn))  # batch_invariant
    _patch(stack, decoder_module, "rms_norm", lambda fn: timer.wrap("element-wise", fn))  # Qwen3's q/k norm


def _kernel_split(timer: PartTimer, fn: Callable) -> Callable:
    """The C attention kernel timed as decode attention, then the share of its rows that are tokens of
    a prefill row (rows sharing a block-table row; a decode row has one of its own), weighted by the
    keys each reads, moved to prefill attention: one call does both. The share is worked out inside
    the timed span: outside it, its few small torch ops (~0.2 ms a step) were charged to the caller,
    "attention, other", as if the backend's own Python cost that much."""
    import torch

    def kernel_and_share(*args, **kwargs):
        result = fn(*args, **kwargs)
        share = 0.0
        table_row, seq_lens = args[5], args[6].to(dtype=torch.float64)
        if table_row.numel() and seq_lens.sum() > 0:
            in_prefill = torch.bincount(table_row)[table_row] > 1
            share = float(seq_lens[in_prefill].sum() / seq_lens.sum())
        return result, share

    timed = timer.wrap("decode attention", kernel_and_share)

    def call(*args, **kwargs):
        start = time.perf_counter()
        result, share = timed(*args, **kwargs)
        spent = time.perf_counter() - start
        if share:
            timer.seconds["decode attention"] -= spent * share
            timer.seconds["prefill attention"] += spent * share
            timer.calls["prefill attention"] += 1
        return result
    return call


def profile_once(model: str, threads: int, num_requests: int, seed: int = 0, kv_cache_gb: float = 4.0) -> dict[str, Any]:
    """One thread count, in this process: the timed run, then an untimed run of the same requests."""
    import torch

    torch.set_num_threads(threads)
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.tools.bench_engine import engine_requests
    from tokenmill.tools.bench_workloads import mixed_workload, resolve_model, warm_up_workload

    model_dir = resolve_model(model)
    mc = load_model_config(model_dir)
    work = mixed_workload(mc.vocab_size, num_requests, seed, set(mc.eos_token_ids))  # as `tokenmill bench`
    # Prefix caching off: the untimed run repeats the timed run's prompts and must not find them
    # cached (the bench's random prompts share no block, so its runs lose nothing by this).
    engine = Engine(EngineConfig(model=str(model_dir), enable_prefix_caching=False, cpu_threads=threads,
                                 kv_cache_gb=kv_cache_gb))
    engine.generate(engine_requests(warm_up_workload(), "warm"))

    # The timers time one thread at a time: steps cut into parts (engine/cpu/step_parts.py) would run the
    # layers on two threads at once, so the timed and plain runs take whole steps, and a third run,
    # untimed, the engine's own choice.
    parts_pool, engine.runner.step_parts = engine.runner.step_parts, None
    # The timers wrap the Python layers' kernel calls: a decode step's layers in one C call
    # (kernels/cpu/decode_layers.py) would hide them, so the timed run takes the Python layers and the plain
    # run the engine's own choice.
    network = engine.runner.model
    decode_layers, network._decode_layers = network._decode_layers, None
    timer = PartTimer()
    steps_before = engine.stats().steps
    with ExitStack() as stack:
        _instrument(stack, timer)
        driver = timer.wrap("driver", engine.generate)
        t0 = time.perf_counter()
        results = driver(engine_requests(work, "timed"))
        timed_s = time.perf_counter() - t0
    steps = engine.stats().steps - steps_before
    network._decode_layers = decode_layers
    # The same requests again without timers, after the timed run has warmed every buffer up.
    t0 = time.perf_counter()
    engine.generate(engine_requests(work, "plain"))
    plain_s = time.perf_counter() - t0
    parts_s = None
    if parts_pool is not None:
        engine.runner.step_parts = parts_pool
        t0 = time.perf_counter()
        engine.generate(engine_requests(work, "parts"))
        parts_s = time.perf_counter() - t0
    produced = sum(len(d.output_token_ids) for d in results.values())
    if produced != work.output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, the workload asks for {work.output_tokens}")
    return {
        "model": model, "threads": threads, "num_requests": num_requests, "output_tokens": produced,
        "steps": steps, "plain_wall_s": plain_s, "timed_wall_s": timed_s, "parts_wall_s": parts_s,
        "step_parts": parts_pool.parts if parts_pool is not None else 1,
        "decode_layers_in_c": decode_layers is not None,
        "parts_s": {p: timer.seconds.get(p, 0.0) for p in PARTS},
        "calls": {p: timer.calls.get(p, 0) for p in PARTS},
    }


def _child(model: str, threads: int, num_requests: int, kv_cache_gb: float) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "tokenmill.tools.profile_step", "--model", model, "--threads", str(threads),
           "--num-requests", str(num_requests), "--kv-cache-gb", str(kv_cache_gb), "--child"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"profile run at {threads} thread(s) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def format_table(runs: list[dict[str, Any]]) -> str:
    head = "| part | " + " | ".join(f"{r['threads']} thr ms/step | share" for r in runs)
    if len(runs) > 1:
        head += f" | speed-up {runs[0]['threads']}->{runs[-1]['threads']}"
    lines = [head + " |", "|" + "---|" * (1 + 2 * len(runs) + (len(runs) > 1))]
    for part in PARTS:
        cells = []
        for r in runs:
            s = r["parts_s"][part]
            cells += [f"{1000 * s / r['steps']:.3f}", f"{100 * s / r['timed_wall_s']:.1f}%"]
        row = f"| {part} | " + " | ".join(cells)
        if len(runs) > 1:
            a, b = runs[0]["parts_s"][part], runs[-1]["parts_s"][part]
            row += f" | {a / b:.2f}x" if b > 0 else " | -"
        lines.append(row + " |")
    total = [f"{1000 * r['timed_wall_s'] / r['steps']:.3f} | 100%" for r in runs]
    row = "| **step (timed run)** | " + " | ".join(total)
    if len(runs) > 1:
        row += f" | {runs[0]['timed_wall_s'] / runs[-1]['timed_wall_s']:.2f}x"
    lines.append(row + " |")
    for r in runs:
        lines.append(f"\n{r['threads']} thread(s): {r['steps']} steps, {r['output_tokens']} output tokens; "
                     f"untimed {r['output_tokens'] / r['plain_wall_s']:.0f} tok/s"
                     + (" (decode layers in C)" if r.get("decode_layers_in_c") else "") + ", "
                     f"timed {r['output_tokens'] / r['timed_wall_s']:.0f} tok/s"
                     + (f"; untimed with steps in {r['step_parts']} parts "
                        f"{r['output_tokens'] / r['parts_wall_s']:.0f} tok/s "
                        f"({1000 * r['parts_wall_s'] / r['steps']:.3f} ms/step)" if r.get("parts_wall_s") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.profile_step", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama", help="tiny-llama, smollm2, or a checkpoint directory")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--kv-cache-gb", type=float, default=4.0,
                   help="KV cache size; 4 GiB as the side-by-side with vLLM, so SmolLM2's 256 requests need no preemption")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(t < 1 for t in args.threads):
        p.error("--threads must be >= 1")
    if args.child:
        print(json.dumps(profile_once(args.model, args.threads[0], args.num_requests, kv_cache_gb=args.kv_cache_gb)))
        return 0
    runs = [_child(args.model, t, args.num_requests, args.kv_cache_gb) for t in args.threads]
    print(format_table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
