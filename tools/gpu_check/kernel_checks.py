"""Section `kernels`: every kernel against its torch reference (kernels/checks.py's cases)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.tools.gpu_check.timing import dtype_of

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def section_kernels(ctx: Context) -> dict:
    from tokenmill.kernels.checks import ATTENTION_CASES, GPU_ATTENTION_CASES, run_all

    cases = ATTENTION_CASES + (GPU_ATTENTION_CASES if ctx.sizes.gpu_kernel_cases else [])
    if ctx.sizes.dry_run:
        cases = ATTENTION_CASES[:3]
    checks = run_all(ctx.device, [dtype_of(d) for d in ctx.sizes.kernel_dtypes], cases)
    failed = [c for c in checks if not c["ok"]]
    return dict(ok=not failed, passed=len(checks) - len(failed), failed=len(failed), checks=checks)
