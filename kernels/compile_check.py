"""Compile every kernel for a GPU target on a machine without a GPU.

The Triton interpreter runs kernels on the CPU but skips the GPU compiler, so it cannot catch what
only compilation rejects (loop-carried values changing type, tl.dot operands under 16 per dimension,
unsupported dtype mixes, an early return the code generator cannot lower). This module calls each
kernel's Python wrapper with small CPU tensors, intercepts the launch to record its arguments, and
compiles the recorded launch ahead of time for the chosen architecture (down to a cubin with the
ptxas bundled with Triton).

    python -m kernels.compile_check [--arch 90] [--quick]

Must run WITHOUT TRITON_INTERPRET (the kernels have to be defined as GPU kernels).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Launch:
    name: str
    kernel: object  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict


class _LaunchRecorder:
    """Stands in for a @triton.jit function: `kernel[grid](*args, **kwargs)` records instead of running."""

    def __init__(self, name: str, kernel, sink: list[Launch]):
        self.name, self.kernel, self.sink = name, kernel, sink

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.sink.append(Launch(self.name, self.kernel, args, kwargs))

        return record


_TORCH_TO_TRITON = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _signature(launch: Launch) -> tuple[dict, dict, dict]:
    """Triton signature, constexprs and compile options of a recorded launch."""
    import torch

    params = launch.kernel.arg_names
    values = dict(zip(params, launch.args, strict=False))  # trailing params come as kwargs
    values.update({k: v for k, v in launch.kwargs.items() if k not in _LAUNCH_OPTIONS})
    options = {k: v for k, v in launch.kwargs.items() if k in _LAUNCH_OPTIONS}
    signature, constexprs = {}, {}
    for i, name in enumerate(params):
        value = values[name]
        if launch.kernel.params[i].is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:  # Triton specialises integer arguments equal to 1 into constants
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: cannot type argument {name}={value!r}")
    return signature, constexprs, options


def record_launches(quick: bool = False) -> list[Launch]:
    """Run each wrapper on small CPU tensors with every kernel replaced by a recorder."""
    import torch

    import tokenmill.kernels.kv_write as kv_mod
    import tokenmill.kernels.paged_attention as pa_mod
    import tokenmill.kernels.rmsnorm as rms_mod
    import tokenmill.kernels.rotary as rot_mod
    import tokenmill.kernels.silu_mul as silu_mod
    from tokenmill.kernels.checks import AttentionCase, make_attention_inputs

    launches: list[Launch] = []
    patched = [
        (pa_mod, "_paged_attention_kernel"), (pa_mod, "_merge_splits_kernel"), (kv_mod, "_kv_write_kernel"),
        (rms_mod, "_rmsnorm_kernel"), (rot_mod, "_rotary_kernel"), (silu_mod, "_silu_mul_kernel"),
    ]
    originals = [(m, n, getattr(m, n)) for m, n in patched]

    def label(text: str) -> Callable[[], None]:
        def set_label():
            for m, n, orig in originals:
                setattr(m, n, _LaunchRecorder(f"{n} {text}", orig, launches))

        return set_label

    try:
        # Paged attention: decode (bf16, GQA 4, split-KV), prefill (fp16, head_dim 128, GQA 7 padded to 8),
        # fp32 (IEEE dots), padded head_dim 80, a single sequence (num_seqs specialised to 1).
        attention = [
            ("decode bf16 gqa4 split", AttentionCase("a", (1, 1, 1), (900, 20, 300), 32, 8, 64, 16, num_splits=4,
                                                     block_n=None), torch.bfloat16),
            ("prefill fp16 d128 gqa7", AttentionCase("b", (100, 1), (0, 40), 28, 4, 128, 16, block_n=None), torch.float16),
            ("mixed fp32", AttentionCase("c", (5, 1), (3, 30), 4, 4, 64, 16, block_n=None), torch.float32),
            ("one seq bf16 d80", AttentionCase("d", (1,), (77,), 12, 4, 80, 32, block_n=None), torch.bfloat16),
        ]
        if quick:
            attention = attention[:1]
        for text, case, dtype in attention:
            label(text)()
            inputs = make_attention_inputs(case, dtype, "cpu")
            pa_mod.paged_attention(**inputs, scale=case.head_dim**-0.5, num_splits=case.num_splits,
                                   block_n=case.block_n)
        for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
            label(str(dtype))()
            k = torch.zeros(4, 8, 64, dtype=dtype)
            cache = torch.zeros(10, 16, 8, 64, dtype=dtype)
            kv_mod.kv_write(k, k, cache, cache.clone(), torch.arange(4), tokens_per_program=1)  # the GPU's tiling
            x = torch.zeros(3, 2048, dtype=dtype)
            rms_mod.rms_norm(x, torch.ones(2048, dtype=dtype), 1e-5, residual=x.clone())
            rms_mod.rms_norm(x, torch.ones(2048, dtype=dtype), 1e-5)
            qkv = torch.zeros(3, 48 * 64, dtype=dtype)
            rot_mod.rotary_embedding(torch.arange(3), qkv[:, : 32 * 64].view(3, 32, 64),
                                     qkv[:, 32 * 64 : 40 * 64].view(3, 8, 64), torch.zeros(16, 64))
            silu_mod.silu_mul(torch.zeros(3, 2 * 8192, dtype=dtype))
    finally:
        for m, n, orig in originals:
            setattr(m, n, orig)
    return launches


def compile_launch(launch: Launch, arch: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, options = _signature(launch)
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100/H200)")
    parser.add_argument("--quick", action="store_true", help="one configuration per kernel")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (kernels must be defined as GPU kernels)", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    failures = 0
    for launch in record_launches(quick=args.quick):
        t0 = time.perf_counter()
        try:
            compile_launch(launch, args.arch)
            print(f"ok      sm_{args.arch}  {launch.name}  ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as exc:
            failures += 1
            print(f"FAILED  sm_{args.arch}  {launch.name}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
