"""Section `copy_bandwidth`: a device-to-device copy, bytes read + written per second (the
roofline's yardstick; Context.copy_bandwidth measures it on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.tools.gpu_check.timing import time_kernel_ms

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def section_copy_bandwidth(ctx: Context) -> dict:
    import torch

    n = ctx.sizes.copy_mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_kernel_ms(lambda: dst.copy_(src), ctx.device, iters=max(5, ctx.sizes.bench_iters))
    bytes_per_s = 2 * n / (ms / 1e3)  # each byte is read once and written once
    return dict(buffer_mib=ctx.sizes.copy_mib, ms=ms, bytes_per_s=bytes_per_s, gb_per_s=bytes_per_s / 1e9)
