"""Timers for the sections: a whole step as the engine sees it, or back-to-back GPU time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


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
