"""One prepared command that measures tokenmill's GPU path and writes a JSON and a markdown report.

    tools/gpu_check [--out DIR] [--dry-run] [--only SECTION ...]

Sections (each catches and reports its own failure, so one broken part never loses the others):
  environment      versions, device name, SM count
  kernels          every kernel against its torch reference (fp32, fp16 and, on CUDA, bf16)
  fidelity         greedy tokens of the engine's GPU path (CUDA graphs + async scheduling) against
                   transformers `generate` and against the same engine with both off (fp32)
  copy_bandwidth   device-to-device copy: bytes read + written per second; the roofline's yardstick
  attention        paged-attention decode: KV bytes read per second, as a fraction of copy bandwidth
  decode_step      ~1B Llama (bf16, random weights) decode step at batch 64 and 256 vs its roofline
                   (weight + KV bytes read per step / copy bandwidth)
  mixed            the engine's `mixed` bench workload against transformers `generate`
  throughput       256 sequences, input and output lengths uniform in [100, 1024], ignore_eos, on a
                   Llama-3.2-1B-shaped model: output tokens/s and its fraction of the roofline ceiling
                   (sum over decode steps of bytes read / copy bandwidth)

Runs with torch, triton, transformers and safetensors only (no Kafka, pydantic or boto3). The report
goes to --out, else $OUT, else ./gpu_check_out. --dry-run takes the same code path on the CPU at toy
sizes (Triton kernels under the interpreter) so the test suite keeps this script working.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------- sizes


@dataclass
class Sizes:
    dry_run: bool
    kernel_dtypes: tuple[str, ...]
    gpu_kernel_cases: bool
    copy_mib: int
    # attention: (label, decode rows, context per row, forced splits or None)
    attention_runs: list[tuple[str, int, int, int | None]]
    attention_heads: tuple[int, int, int]  # heads, kv heads, head_dim
    block_size: int
    model_shape: dict[str, Any]  # Hugging Face LlamaConfig fields
    model_dtype: str
    decode_batches: tuple[int, ...]
    decode_context: int
    bench_iters: int
    throughput_seqs: int
    throughput_len_range: tuple[int, int]
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_gb: float | None
    # `mixed` (engine issue, tools/bench.py): requests; the dry run clips prompts/outputs to these ranges
    mixed_requests: int = 256
    mixed_prompt_range: tuple[int, int] = (16, 512)
    mixed_output_range: tuple[int, int] = (16, 256)
    baseline_batches: tuple[int, ...] = (8, 32, 64)
    baseline_probe: int = 64
    # fidelity: prompts (lengths in the range), greedy tokens each, on a small fp32 Llama
    fidelity_prompts: int = 32
    fidelity_prompt_range: tuple[int, int] = (8, 200)
    fidelity_tokens: int = 32
    fidelity_shape: dict[str, Any] = field(default_factory=lambda: dict(FIDELITY_LLAMA))


LLAMA_1B = dict(  # Llama-3.2-1B shape
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
    max_position_embeddings=4096, rope_theta=500000.0,
)
FIDELITY_LLAMA = dict(  # small enough to build and run in seconds, big enough to have real GQA and depth
    vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    max_position_embeddings=1024,
)
TOY_LLAMA = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    max_position_embeddings=256,
)


def gpu_sizes() -> Sizes:
    return Sizes(
        dry_run=False,
        kernel_dtypes=("float32", "float16", "bfloat16"),
        gpu_kernel_cases=True,
        copy_mib=2048,
        attention_runs=[
            ("decode b64 ctx4096", 64, 4096, None),
            ("decode b256 ctx1024", 256, 1024, None),
            ("decode b8 ctx16384 no split", 8, 16384, 1),
            ("decode b8 ctx16384 split-KV", 8, 16384, None),
        ],
        attention_heads=(32, 8, 64),
        block_size=16,
        model_shape=LLAMA_1B,
        model_dtype="bfloat16",
        decode_batches=(64, 256),
        decode_context=512,
        bench_iters=20,
        throughput_seqs=256,
        throughput_len_range=(100, 1024),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        kv_cache_gb=32.0,
    )


def dry_sizes() -> Sizes:
    return Sizes(
        dry_run=True,
        kernel_dtypes=("float32",),
        gpu_kernel_cases=False,
        copy_mib=4,
        attention_runs=[("decode b2 ctx40", 2, 40, None), ("decode b2 ctx40 split", 2, 40, 2)],
        attention_heads=(4, 2, 32),
        block_size=16,
        model_shape=TOY_LLAMA,
        model_dtype="float32",
        decode_batches=(2, 4),
        decode_context=12,
        bench_iters=1,
        throughput_seqs=4,
        throughput_len_range=(4, 8),
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_cache_gb=0.05,
        mixed_requests=4,
        mixed_prompt_range=(4, 20),
        mixed_output_range=(2, 4),
        baseline_batches=(2, 4),
        baseline_probe=4,
        fidelity_prompts=3,
        fidelity_prompt_range=(3, 9),
        fidelity_tokens=3,
        fidelity_shape=dict(TOY_LLAMA),
    )


# --------------------------------------------------------------------------------------------- helpers


@dataclass
class Context:
    sizes: Sizes
    device: Any  # torch.device
    results: dict[str, Any] = field(default_factory=dict)
    workdir: Path | None = None
    _model_dir: Path | None = None

    def model_dir(self) -> Path:
        """A random-weight checkpoint of the configured shape, built once per run."""
        if self._model_dir is None:
            self._model_dir = build_checkpoint(self.sizes.model_shape, self.sizes.model_dtype, self.device,
                                               self.workdir / "model")
        return self._model_dir

    def copy_bandwidth(self) -> float:
        """Bytes per second (read + written) of a device-to-device copy; measured on first use."""
        if "copy_bandwidth" not in self.results or not self.results["copy_bandwidth"].get("ok"):
            self.results["copy_bandwidth"] = run_section("copy_bandwidth", section_copy_bandwidth, self)
        return self.results["copy_bandwidth"]["bytes_per_s"]


def dtype_of(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device, iters: int, warmup: int = 2) -> float:
    """Median wall time of fn in ms, synchronised after each call: a whole step as the engine sees it,
    host launch cost included."""
    for _ in range(min(warmup, iters)):
        fn()
    synchronize(device)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def time_kernel_ms(fn: Callable[[], Any], device, iters: int, warmup: int = 3) -> float:
    """Mean GPU time of fn in ms, launched back to back between two CUDA events.

    For bandwidth: the host's launch cost overlaps the previous call's GPU work, as in a real step,
    instead of being added to every sample. On a CPU it is time_ms.
    """
    import torch

    if device.type != "cuda":
        return time_ms(fn, device, iters, warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def run_section(name: str, fn: Callable[[Context], dict], ctx: Context) -> dict:
    t0 = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        result = fn(ctx)
        result.setdefault("ok", True)
    except Exception as exc:  # report and go on: the other sections' numbers still count
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    _release_memory(ctx.device)
    print(f"[gpu_check] {name}: {'ok' if result['ok'] else 'FAILED ' + result.get('error', 'failed checks')} "
          f"({result['seconds']} s)",
          flush=True)
    return result


def _release_memory(device) -> None:
    """Drop what a finished section left behind, so the next one gets the GPU's memory."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_checkpoint(shape: dict, dtype_name: str, device, out_dir: Path) -> Path:
    """Seeded random-weight Llama checkpoint (initialised on the device: fast even at 1B)."""
    import torch
    import transformers

    from tools.tiny_models import build_tokenizer

    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = build_tokenizer(shape["vocab_size"])
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = transformers.LlamaConfig(bos_token_id=None, eos_token_id=[eos, im_end], pad_token_id=eos, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(dtype_of(dtype_name)).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out_dir


def param_bytes(model) -> int:
    """Bytes of distinct parameters (a tied embedding counts once: the LM head reads it whole)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


# -------------------------------------------------------------------------------------------- sections


def section_environment(ctx: Context) -> dict:
    import torch
    import triton

    info = dict(
        python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
        device=str(ctx.device), dry_run=ctx.sizes.dry_run,
        triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
    )
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    return info


def section_kernels(ctx: Context) -> dict:
    from kernels.checks import ATTENTION_CASES, GPU_ATTENTION_CASES, run_all

    cases = ATTENTION_CASES + (GPU_ATTENTION_CASES if ctx.sizes.gpu_kernel_cases else [])
    if ctx.sizes.dry_run:
        cases = ATTENTION_CASES[:3]
    checks = run_all(ctx.device, [dtype_of(d) for d in ctx.sizes.kernel_dtypes], cases)
    failed = [c for c in checks if not c["ok"]]
    return dict(ok=not failed, passed=len(checks) - len(failed), failed=len(failed), checks=checks)


def section_fidelity(ctx: Context) -> dict:
    """Greedy tokens of the engine's GPU path against transformers and against the plain engine.

    fp32, a small seeded random Llama, prompts of mixed length run as one batch. Three runs: the
    engine with CUDA graphs + async scheduling (as `auto` picks on CUDA), the engine with both off,
    and transformers `generate` one prompt at a time (no padding). On a GPU, bit-exact agreement is
    not guaranteed (padded graph batches and different GEMM shapes may round differently), so the
    counts are reported for reading, with the first position where a sequence differs; the section
    fails only if it cannot run. On the CPU (dry run) all three agree exactly (the suite checks it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.types import EngineRequest, SamplingParams

    sizes = ctx.sizes
    model_dir = build_checkpoint(sizes.fidelity_shape, "float32", ctx.device, ctx.workdir / "fidelity_model")
    rng = random.Random(11)
    lo, hi = sizes.fidelity_prompt_range
    vocab = sizes.fidelity_shape["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(sizes.fidelity_prompts)]
    new = sizes.fidelity_tokens

    def engine_tokens(**gpu_path) -> tuple[list[list[int]], dict]:
        engine = Engine(EngineConfig(
            model=str(model_dir), device=str(ctx.device), dtype="float32", attention_backend="triton",
            max_num_seqs=max(len(prompts), 2), kv_cache_gb=0.25 if ctx.device.type == "cuda" else 0.02, **gpu_path,
        ))
        requests = [EngineRequest(request_id=f"f{i}", prompt_token_ids=p,
                                  sampling=SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
                    for i, p in enumerate(prompts)]
        done = engine.generate(requests)
        tokens = [list(done[f"f{i}"].output_token_ids) for i in range(len(prompts))]
        path = gpu_path_report(engine)
        del engine
        _release_memory(ctx.device)
        return tokens, path

    fast, path = engine_tokens(**gpu_path_options(ctx.device))
    plain, _ = engine_tokens(cuda_graphs="off", async_scheduling="off")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(ctx.device).eval()
    reference = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=ctx.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            reference.append(out[0, len(p):].tolist())
    del model

    def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
        first = [next((j for j, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), None) for s, t in zip(a, b, strict=True)]
        return dict(equal=sum(f is None for f in first), of=len(first),
                    first_difference_at=[f for f in first if f is not None])

    return dict(prompts=len(prompts), tokens_each=new, prompt_tokens=sum(map(len, prompts)),
                gpu_path_vs_transformers=agreement(fast, reference), plain_vs_transformers=agreement(plain, reference),
                gpu_path_vs_plain=agreement(fast, plain), **path)


def section_copy_bandwidth(ctx: Context) -> dict:
    import torch

    n = ctx.sizes.copy_mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_kernel_ms(lambda: dst.copy_(src), ctx.device, iters=max(5, ctx.sizes.bench_iters))
    bytes_per_s = 2 * n / (ms / 1e3)  # each byte is read once and written once
    return dict(buffer_mib=ctx.sizes.copy_mib, ms=ms, bytes_per_s=bytes_per_s, gb_per_s=bytes_per_s / 1e9)


def section_attention(ctx: Context) -> dict:
    import torch

    from kernels.paged_attention import paged_attention

    copy_bw = ctx.copy_bandwidth()
    heads, kv_heads, head_dim = ctx.sizes.attention_heads
    dtype = dtype_of(ctx.sizes.model_dtype)
    bs = ctx.sizes.block_size
    runs = []
    for label, batch, context, splits in ctx.sizes.attention_runs:
        seq_len = context + 1
        blocks_per_seq = math.ceil(seq_len / bs)
        num_blocks = batch * blocks_per_seq
        cache_shape = (num_blocks, bs, kv_heads, head_dim)
        key_cache = torch.randn(cache_shape, dtype=dtype, device=ctx.device)
        value_cache = torch.randn(cache_shape, dtype=dtype, device=ctx.device)
        perm = torch.randperm(num_blocks, device=ctx.device).to(torch.int32)  # scattered, as in a real pool
        block_tables = perm.view(batch, blocks_per_seq)
        seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=ctx.device)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=ctx.device)
        query = torch.randn((batch, heads, head_dim), dtype=dtype, device=ctx.device)

        args = (query, key_cache, value_cache, block_tables, seq_lens, qsl, head_dim**-0.5)
        hints = dict(max_query_len=1, max_seq_len=seq_len, num_splits=splits)
        ms = time_kernel_ms(lambda a=args, h=hints: paged_attention(*a, **h), ctx.device, iters=ctx.sizes.bench_iters)
        kv_bytes = 2 * batch * seq_len * kv_heads * head_dim * key_cache.element_size()
        moved = kv_bytes + 2 * query.numel() * query.element_size()  # + query read and output write
        runs.append(dict(label=label, batch=batch, context=context, forced_splits=splits, ms=ms,
                         bytes=moved, bytes_per_s=moved / (ms / 1e3), fraction_of_copy=moved / (ms / 1e3) / copy_bw))
    best = max(r["fraction_of_copy"] for r in runs)
    return dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=ctx.sizes.model_dtype, runs=runs,
                best_fraction_of_copy=best)


def _load_engine_model(ctx: Context):
    from worker.engine.attention.triton_backend import TritonAttentionBackend
    from worker.engine.loader import load_model

    return load_model(ctx.model_dir(), dtype=ctx.sizes.model_dtype, device=ctx.device,
                      attention_backend=TritonAttentionBackend())


def section_decode_step(ctx: Context) -> dict:
    import torch

    from worker.engine.attention import AttentionMetadata
    from worker.engine.cuda_graphs import DecodeGraphRunner

    copy_bw = ctx.copy_bandwidth()
    model, config = _load_engine_model(ctx)
    weights = param_bytes(model)
    bs = ctx.sizes.block_size
    elt = torch.empty((), dtype=config.dtype).element_size()
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * elt
    runs = []
    for batch in ctx.sizes.decode_batches:
        seq_len = ctx.sizes.decode_context + 1
        blocks_per_seq = math.ceil(seq_len / bs)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, bs, config.num_kv_heads, config.head_dim)
        kv_caches = [(torch.randn(shape, dtype=config.dtype, device=ctx.device),
                      torch.randn(shape, dtype=config.dtype, device=ctx.device)) for _ in range(config.num_layers)]
        block_tables = torch.arange(num_blocks, dtype=torch.int32, device=ctx.device).view(batch, blocks_per_seq)
        positions = torch.full((batch,), seq_len - 1, dtype=torch.long, device=ctx.device)
        slots = (block_tables[:, (seq_len - 1) // bs].long() * bs + (seq_len - 1) % bs)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=ctx.device),
            seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=ctx.device),
            block_tables=block_tables, slot_mapping=slots, max_query_len=1, max_seq_len=seq_len,
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[seq_len] * batch,
        )
        input_ids = torch.randint(0, config.vocab_size, (batch,), device=ctx.device)

        step_args = (input_ids, positions, meta, kv_caches)
        ms = time_ms(lambda a=step_args: model.compute_logits(model(*a)), ctx.device, iters=ctx.sizes.bench_iters)
        step_bytes = weights + batch * seq_len * kv_bytes_per_token
        roofline_ms = step_bytes / copy_bw * 1e3
        run = dict(batch=batch, context=ctx.sizes.decode_context, step_ms=ms, roofline_ms=roofline_ms,
                   roofline_over_step=roofline_ms / ms, bytes_per_step=step_bytes, tokens_per_s=batch / (ms / 1e3))
        # The same step replayed as a CUDA graph (on the CPU: the runner's eager padded path).
        try:
            graphs = DecodeGraphRunner(model, kv_caches, max_blocks_per_seq=blocks_per_seq, batch_sizes=(batch,))
            graphs.capture()
            graph_ms = time_ms(lambda g=graphs, a=step_args[:3]: g.run(*a), ctx.device, iters=ctx.sizes.bench_iters)
            run.update(graph_step_ms=graph_ms, graph_roofline_over_step=roofline_ms / graph_ms,
                       graph_tokens_per_s=batch / (graph_ms / 1e3))
        except Exception as exc:
            run["graph_error"] = f"{type(exc).__name__}: {exc}"
        runs.append(run)
    return dict(weight_bytes=weights, kv_bytes_per_token=kv_bytes_per_token, runs=runs)


def roofline_ceiling(prompt_lens: list[int], output_lens: list[int], weight_bytes: int, kv_bytes_per_token: int,
                     copy_bw: float, max_num_seqs: int) -> dict:
    """Fastest possible decode: every step reads the weights once plus the KV of every running sequence.

    Sequences run max_num_seqs at a time (a new one joins as soon as one finishes); each decode step
    reads the weights and the whole context of each running sequence; prefill is left out (it is
    compute-bound and tiny next to the decode steps here). Returns the ceiling time and tokens/s.
    """
    pending = list(zip(prompt_lens, output_lens, strict=True))[::-1]
    running: list[list[int]] = []  # [context, tokens left]
    total_bytes = 0
    steps = 0
    while pending or running:
        while pending and len(running) < max_num_seqs:
            p, o = pending.pop()
            running.append([p, o])
        total_bytes += weight_bytes + kv_bytes_per_token * sum(ctx_len for ctx_len, _ in running)
        steps += 1
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    seconds = total_bytes / copy_bw
    return dict(steps=steps, bytes=total_bytes, seconds=seconds, tokens_per_s=sum(output_lens) / seconds)


def gpu_path_options(device) -> dict:
    """The engine's GPU path, forced on: CUDA graphs (captured on CUDA; the same padded path run
    eagerly in a dry run on the CPU) and async scheduling (which on the CPU runs without overlap)."""
    return dict(cuda_graphs="on" if str(device).startswith("cuda") else "eager", async_scheduling="on")


def gpu_path_report(engine) -> dict:
    """What the report records about the GPU path an engine actually ran."""
    return dict(cuda_graphs=engine.graph_mode, async_scheduling=engine.async_scheduling,
                graph_steps=engine.runner.num_graph_steps, engine_steps=engine.stats().steps)


def make_engine(ctx: Context, model_dir: Path):
    from worker.engine.engine import Engine, EngineConfig

    config = EngineConfig(
        model=str(model_dir), device=str(ctx.device), dtype=ctx.sizes.model_dtype, attention_backend="triton",
        max_num_seqs=ctx.sizes.max_num_seqs, max_num_batched_tokens=ctx.sizes.max_num_batched_tokens,
        kv_cache_gb=ctx.sizes.kv_cache_gb, **gpu_path_options(ctx.device),
    )
    return Engine(config)


def section_throughput(ctx: Context) -> dict:
    import torch

    from worker.engine.types import EngineRequest, SamplingParams

    copy_bw = ctx.copy_bandwidth()
    rng = random.Random(2026)
    lo, hi = ctx.sizes.throughput_len_range
    n = ctx.sizes.throughput_seqs
    vocab = ctx.sizes.model_shape["vocab_size"]
    prompt_lens = [rng.randint(lo, hi) for _ in range(n)]
    output_lens = [rng.randint(lo, hi) for _ in range(n)]
    requests = [
        EngineRequest(
            request_id=f"t{i}",
            prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prompt_lens[i])],
            sampling=SamplingParams(max_tokens=output_lens[i], temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]
    engine = make_engine(ctx, ctx.model_dir())
    warm = EngineRequest(request_id="warmup", prompt_token_ids=[5] * 16,
                         sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.generate([warm])  # compile kernels outside the timed run
    synchronize(ctx.device)
    t0 = time.perf_counter()
    outputs = engine.generate(requests)  # request_id -> final delta
    synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.output_token_ids or []) for o in outputs.values())
    if produced != sum(output_lens):
        raise RuntimeError(f"engine produced {produced} tokens, expected {sum(output_lens)} (ignore_eos)")
    model_cfg = ctx.sizes.model_shape
    head_dim = model_cfg["hidden_size"] // model_cfg["num_attention_heads"]
    elt = torch.empty((), dtype=dtype_of(ctx.sizes.model_dtype)).element_size()
    kv_bytes_per_token = 2 * model_cfg["num_hidden_layers"] * model_cfg["num_key_value_heads"] * head_dim * elt
    weights = _llama_param_count(model_cfg) * elt
    ceiling = roofline_ceiling(prompt_lens, output_lens, weights, kv_bytes_per_token, copy_bw,
                               ctx.sizes.max_num_seqs)
    tok_s = produced / seconds
    return dict(sequences=n, prompt_tokens=sum(prompt_lens), output_tokens=produced, seconds=seconds,
                output_tok_s=tok_s, ceiling_tok_s=ceiling["tokens_per_s"], ceiling_steps=ceiling["steps"],
                fraction_of_ceiling=tok_s / ceiling["tokens_per_s"], weight_bytes=weights,
                max_num_seqs=ctx.sizes.max_num_seqs, max_num_batched_tokens=ctx.sizes.max_num_batched_tokens,
                **gpu_path_report(engine))


def _llama_param_count(shape: dict) -> int:
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    emb = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    return layers * per_layer + emb + h


def hf_static_batch_seconds(model, prompts: list[list[int]], outputs: list[int], batch: int, pad_id: int, device) -> float:
    """transformers `generate` on `device`, static batches in arrival order, left padding, EOS off.

    Same rule as tools/bench.py's baseline, whose model stays on the CPU; here it runs on the GPU.
    """
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk, want = prompts[i : i + batch], outputs[i : i + batch]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, p in enumerate(chunk):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(want),
                           do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    synchronize(device)
    return time.perf_counter() - t0


def section_mixed(ctx: Context) -> dict:
    """The engine's `mixed` bench workload, engine vs transformers `generate`, same GPU and weights.

    The workload and the engine run come from tools/bench.py; the baseline's batch is the best of
    {8, 32, 64} on the first 64 requests (bench's calibration rule), then it runs the whole workload.
    The dry run clips prompts and outputs to toy lengths.
    """
    from transformers import AutoModelForCausalLM

    from tools import bench
    from worker.engine.model_config import load_model_config

    model_dir = ctx.model_dir()
    mc = load_model_config(model_dir)
    work = bench.mixed_workload(mc.vocab_size, ctx.sizes.mixed_requests, seed=0, special=set(mc.eos_token_ids))
    if ctx.sizes.dry_run:
        work = bench.Workload(work.name, [p[: ctx.sizes.mixed_prompt_range[1]] for p in work.prompts],
                              [min(n, ctx.sizes.mixed_output_range[1]) for n in work.max_tokens])
    options = dict(device=str(ctx.device), dtype=ctx.sizes.model_dtype, attention_backend="triton",
                   max_num_seqs=ctx.sizes.max_num_seqs, max_num_batched_tokens=ctx.sizes.max_num_batched_tokens,
                   kv_cache_gb=ctx.sizes.kv_cache_gb, **gpu_path_options(ctx.device))
    engine = bench.run_engine(model_dir, work, options)
    _release_memory(ctx.device)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype_of(ctx.sizes.model_dtype))
    model = model.to(ctx.device).eval()
    pad_id = model.config.pad_token_id or 0
    probe = min(ctx.sizes.baseline_probe, len(work.prompts))
    hf_static_batch_seconds(model, work.prompts[:2], [2, 2], 2, pad_id, ctx.device)  # warm-up
    probe_tok_s = {
        b: sum(work.max_tokens[:probe])
        / hf_static_batch_seconds(model, work.prompts[:probe], work.max_tokens[:probe], b, pad_id, ctx.device)
        for b in ctx.sizes.baseline_batches
    }
    best = max(probe_tok_s, key=probe_tok_s.get)
    baseline_s = hf_static_batch_seconds(model, work.prompts, work.max_tokens, best, pad_id, ctx.device)
    del model
    baseline_tok_s = work.output_tokens / baseline_s
    return dict(requests=len(work.prompts), prompt_tokens=work.prompt_tokens, output_tokens=work.output_tokens,
                engine_seconds=engine.wall_s, engine_output_tok_s=engine.output_tok_s, engine_steps=engine.steps,
                engine_overhead_fraction=engine.engine_overhead_fraction,
                kv_slot_utilization_peak=engine.kv_slot_utilization_peak, baseline_batch=best,
                baseline_probe_tok_s=probe_tok_s, baseline_seconds=baseline_s, baseline_output_tok_s=baseline_tok_s,
                ratio=engine.output_tok_s / baseline_tok_s, **gpu_path_options(ctx.device))


SECTIONS: list[tuple[str, Callable[[Context], dict]]] = [
    ("environment", section_environment),
    ("kernels", section_kernels),
    ("fidelity", section_fidelity),
    ("copy_bandwidth", section_copy_bandwidth),
    ("attention", section_attention),
    ("decode_step", section_decode_step),
    ("mixed", section_mixed),
    ("throughput", section_throughput),
]


# --------------------------------------------------------------------------------------------- report


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def markdown_report(report: dict) -> str:
    s = report["sections"]
    lines = ["# tokenmill gpu_check", ""]
    env = s.get("environment", {})
    lines.append(f"- device: {env.get('gpu', env.get('device'))}; torch {env.get('torch')}, triton {env.get('triton')}, "
                 f"transformers {env.get('transformers')}; dry run: {report['dry_run']}")
    lines.append(f"- total: {report['seconds']:.1f} s; sections failed: {', '.join(report['failed']) or 'none'}")
    lines.append("")
    lines.append("| section | ok | seconds | headline |")
    lines.append("|---|---|---|---|")
    for name, res in s.items():
        lines.append(f"| {name} | {'yes' if res.get('ok') else 'NO'} | {res.get('seconds')} | {_headline(name, res)} |")
    k = s.get("kernels", {})
    if k.get("checks"):
        lines += ["", "## kernels", "", "| check | dtype | max error | tolerance | ok |", "|---|---|---|---|---|"]
        for c in k["checks"]:
            err = _fmt(c["max_err"]) if c.get("max_err") is not None else c.get("error", "")
            lines.append(f"| {c['check']} | {c['dtype']} | {err} | {c['tol']:g} | {'yes' if c['ok'] else 'NO'} |")
    a = s.get("attention", {})
    if a.get("runs"):
        lines += ["", "## attention (decode, KV bytes read per second)", "",
                  "| run | ms | GB/s | fraction of copy |", "|---|---|---|---|"]
        for r in a["runs"]:
            lines.append(f"| {r['label']} | {_fmt(r['ms'])} | {_fmt(r['bytes_per_s'] / 1e9)} | {_fmt(r['fraction_of_copy'])} |")
    d = s.get("decode_step", {})
    if d.get("runs"):
        lines += ["", "## decode step (~1B Llama)", "",
                  "| batch | step ms | roofline ms | roofline / step | tok/s | graph step ms | roofline / graph step |",
                  "|---|---|---|---|---|---|---|"]
        for r in d["runs"]:
            graph = (f"{_fmt(r['graph_step_ms'])} | {_fmt(r['graph_roofline_over_step'])}" if "graph_step_ms" in r
                     else f"{r.get('graph_error', '')[:120]} | ")
            lines.append(f"| {r['batch']} | {_fmt(r['step_ms'])} | {_fmt(r['roofline_ms'])} | "
                         f"{_fmt(r['roofline_over_step'])} | {_fmt(r['tokens_per_s'])} | {graph} |")
    for name, res in s.items():
        if not res.get("ok") and res.get("error"):
            lines += ["", f"## {name} failed", "", "```", res.get("traceback", res["error"]).strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _gpu_path_note(res: dict) -> str:
    return f"cuda graphs {res['cuda_graphs']}, async scheduling {'on' if res['async_scheduling'] in (True, 'on') else 'off'}"


def _headline(name: str, res: dict) -> str:
    if not res.get("ok"):
        return f"error: {res.get('error', 'failed checks')}"[:200].replace("|", "/")
    if name == "kernels":
        return f"{res['passed']} passed, {res['failed']} failed"
    if name == "copy_bandwidth":
        return f"{_fmt(res['gb_per_s'])} GB/s (read + write)"
    if name == "attention":
        return f"best {_fmt(res['best_fraction_of_copy'])} of copy bandwidth"
    if name == "decode_step":
        return "; ".join(
            f"b{r['batch']}: {_fmt(r['step_ms'])} ms, roofline/step {_fmt(r['roofline_over_step'])}"
            + (f" (graph {_fmt(r['graph_step_ms'])} ms, {_fmt(r['graph_roofline_over_step'])})" if "graph_step_ms" in r else "")
            for r in res["runs"])
    if name == "throughput":
        return (f"{_fmt(res['output_tok_s'])} output tok/s, {_fmt(res['fraction_of_ceiling'])} of ceiling "
                f"{_fmt(res['ceiling_tok_s'])} tok/s; {_gpu_path_note(res)}, "
                f"{res['graph_steps']}/{res['engine_steps']} steps as graphs")
    if name == "mixed":
        return (f"engine {_fmt(res['engine_output_tok_s'])} tok/s vs transformers {_fmt(res['baseline_output_tok_s'])} "
                f"(batch {res['baseline_batch']}): ratio {_fmt(res['ratio'])}; {_gpu_path_note(res)}")
    if name == "fidelity":
        def eq(key: str) -> str:
            return f"{res[key]['equal']}/{res[key]['of']}"
        return (f"greedy sequences equal: GPU path vs transformers {eq('gpu_path_vs_transformers')}, plain engine vs "
                f"transformers {eq('plain_vs_transformers')}, GPU path vs plain engine {eq('gpu_path_vs_plain')}; "
                f"{_gpu_path_note(res)}, {res['graph_steps']}/{res['engine_steps']} steps as graphs")
    if name == "environment":
        return str(res.get("gpu", res.get("device")))
    return ""


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                        help="folder for gpu_check.json and gpu_check.md (default: $OUT or ./gpu_check_out)")
    parser.add_argument("--dry-run", action="store_true", help="same code path on the CPU at toy sizes")
    parser.add_argument("--only", nargs="+", choices=[name for name, _ in SECTIONS], help="run only these sections")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="sections not started within this many seconds are reported as skipped (default 450)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # The interpreter must be on before any kernel module defines its @triton.jit functions.
        os.environ["TRITON_INTERPRET"] = "1"
    for var, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("TRANSFORMERS_VERBOSITY", "error"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(var, value)
    import torch

    if args.dry_run:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --dry-run on a CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
    sizes = dry_sizes() if args.dry_run else gpu_sizes()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        ctx = Context(sizes=sizes, device=device, workdir=Path(tmp))
        for name, fn in SECTIONS:
            if args.only and name not in args.only:
                continue
            if name == "copy_bandwidth" and name in ctx.results:
                continue  # measured already on demand
            if time.perf_counter() - t0 > args.budget_s:
                ctx.results[name] = {"ok": False, "skipped": True, "seconds": 0.0,
                                     "error": f"not started: the {args.budget_s:.0f} s budget was spent"}
                continue
            ctx.results[name] = run_section(name, fn, ctx)
    order = [name for name, _ in SECTIONS if name in ctx.results]
    report = dict(
        dry_run=sizes.dry_run, sizes=asdict(sizes), seconds=time.perf_counter() - t0,
        sections={name: ctx.results[name] for name in order},
        failed=[name for name in order if not ctx.results[name].get("ok")],
    )
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(markdown_report(report))
    print(f"[gpu_check] report: {out / 'gpu_check.md'}; failed sections: {report['failed'] or 'none'}")
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
