"""Every kernel compiles for the GPU (sm_90, down to a cubin) on this GPU-less machine.

The interpreter never runs the GPU compiler, so errors only it reports (tl.dot tiles under 16,
loop-carried type changes, ...) would otherwise surface first on a GPU. Runs in a fresh interpreter
without TRITON_INTERPRET, since the kernels must be defined as GPU kernels.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return env


@pytest.mark.slow
def test_all_kernels_compile_for_sm90():
    proc = subprocess.run([sys.executable, "-m", "tokenmill.kernels.compile_check", "--arch", "90"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok", "FAILED"))]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(lines) == 15 and all(ln.startswith("ok") for ln in lines), lines
    names = " ".join(lines)
    for kernel in ("_paged_attention_kernel", "_merge_splits_kernel", "_kv_write_kernel", "_rmsnorm_kernel",
                   "_rotary_kernel", "_silu_mul_kernel"):
        assert kernel in names


@pytest.mark.slow
def test_the_compile_check_rejects_what_only_a_gpu_compiler_rejects(tmp_path):
    """An fp16 tl.dot with K = 8 (under the GPU minimum of 16) runs under the interpreter but must fail here."""
    (tmp_path / "bad_kernel.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        @triton.jit
        def small_dot(a_ptr, out_ptr, N: tl.constexpr):
            offs = tl.arange(0, N)
            a = tl.load(a_ptr + offs[:, None] * N + offs[None, :])
            tl.store(out_ptr + offs[:, None] * N + offs[None, :], tl.dot(a, a))
    '''))
    driver = textwrap.dedent('''
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from bad_kernel import small_dot
        from tokenmill.kernels.compile_check import Launch, compile_launch
        def buffers(n):
            return torch.zeros(n * n, dtype=torch.float16), torch.zeros(n * n, dtype=torch.float16)
        good = Launch("dot16", small_dot, buffers(16), {"N": 16})
        compile_launch(good, 90)
        bad = Launch("dot8", small_dot, buffers(8), {"N": 8})
        try:
            compile_launch(bad, 90)
        except Exception as exc:
            print("REJECTED", type(exc).__name__)
        else:
            print("ACCEPTED")
    ''')
    proc = subprocess.run([sys.executable, "-c", driver, str(tmp_path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REJECTED" in proc.stdout, proc.stdout
