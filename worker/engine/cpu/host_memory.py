"""Keep freed host memory mapped, so CPU steps stop paying page faults for their activations.

Why: a CPU step allocates and frees tens of MB of activations (a prefill chunk of 2048 tokens makes
an 11 MiB gate/up output per layer on a small model, 25 MiB on SmolLM2). glibc's malloc, left to its
defaults, hands some of that back to the kernel (large blocks through mmap, the heap top through
trimming), and the next step faults every page in again. Measured on the prefill of the `mixed`
benchmark (67,000 prompt tokens, tiny-llama, one core): glibc defaults ~200,000 minor faults and
6.3 s; tuned, none and 5.8 s. This is what a preloaded tcmalloc or jemalloc does for CPU inference
servers, done with glibc's own knobs.

The settings (mallopt), process-wide and applied once:
- M_MMAP_THRESHOLD 512 MiB (older glibc caps it at 32 MiB, which is taken then): blocks below it come
  from the heap, where freed memory is reused, instead of a fresh mapping each time.
- M_TOP_PAD 64 MiB and M_TRIM_THRESHOLD 512 MiB: the heap grows in large steps and keeps up to that
  much free memory at its top instead of returning it after every step.
So at most about half a GiB stays mapped after a burst, against a KV cache of GiBs.

Setting any of these turns off glibc's own adaptive threshold, so all three are set together. A
user who tunes malloc through the environment (MALLOC_*_ variables or GLIBC_TUNABLES) or preloads
another allocator is left alone; the engine's `malloc_tuning` setting turns this off ("on" refuses
to start where it cannot act).

Huge pages for large tensors (large_tensors_on_huge_pages): torch's CPU allocator can advise the
kernel to back every allocation of 2 MiB or more with transparent huge pages (its
THP_MEM_ALLOC_ENABLE setting; the kernel then maps the allocation's whole 2 MiB spans as huge
pages). A step streams its weights (tiny-llama: ~17 MB of split projection weights and the 16 MB
bfloat16 greedy screen, every decode step) and activations through the TLB; with 4 KiB pages each
4 KiB costs a page walk, nested under a VM's own page tables. Measured on tiny-llama's `mixed` run
(engine on / huge pages off, alternated): 2 threads 6.45 / 6.57, 5.99 / 6.25 and 6.15 /
6.57 s; 1 thread 11.41 / 11.73 and 11.26 / 11.67 s. torch reads the setting once, at its first
allocation of 2 MiB or more, so the engine sets it before loading a model; in a process that has
allocated a large tensor before, it cannot take effect, and the engine says so (debug log). A value
the user set is kept, a kernel without transparent huge pages is left alone, and the engine's
`huge_pages` setting turns this off ("on" refuses to start where it cannot act). The KV cache is
advised on its own (model_runner._kv_tensor), either way, and left unwritten: its spans become
huge pages as steps first write into them, so its size costs the start nothing.

Both act before torch allocates the model: the engine calls them first thing on the CPU, with its
settings (Engine.__init__), before it loads anything.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

# name: (mallopt parameter, values to try in turn). Values are C ints: ctypes would silently
# truncate a larger Python int (1 << 32 becomes 0, which means "trim after every free").
SETTINGS = {
    "M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, (512 << 20, 32 << 20)),
    "M_TOP_PAD": (_M_TOP_PAD, (64 << 20,)),
    "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, (512 << 20,)),
}

# Environment through which a user has already chosen malloc behaviour.
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_")

_applied: str | None = None  # why the last call did or did not tune, once decided

HUGE_PAGE = 2 << 20  # torch advises allocations of at least this many bytes (2 MiB)
_TORCH_THP_ENV = "THP_MEM_ALLOC_ENABLE"
_huge_pages: str | None = None  # large_tensors_on_huge_pages' answer, once decided
_THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


def keep_freed_memory(setting: str = "auto") -> str:
    """Tune glibc malloc for the engine's allocation pattern (once per process) under the engine's
    `malloc_tuning` setting; returns what was done: "tuned", "skipped: <reason>" or "partly: ...".
    Raises ValueError where the setting is "on" and malloc could not be tuned."""
    global _applied
    if setting == "off":  # not kept: a later engine of this process may still tune
        return "skipped: malloc_tuning=off"
    if _applied is None:
        reason = skip_reason(os.environ)
        _applied = f"skipped: {reason}" if reason else _apply()
        log.debug("glibc malloc for the CPU engine: %s", _applied)
    if setting == "on" and _applied != "tuned":
        raise ValueError(f"malloc_tuning=on, but glibc malloc was not tuned ({_applied})")
    return _applied


def skip_reason(env: Mapping[str, str]) -> str | None:
    """Why malloc must be left as it is in this environment, or None to tune it."""
    chosen = [name for name in _USER_MALLOC_ENV if env.get(name)]
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"malloc already configured by {', '.join(chosen)}"
    if any(a in env.get("LD_PRELOAD", "") for a in ("tcmalloc", "jemalloc", "mimalloc")):
        return "another allocator is preloaded"
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    return None


def _apply() -> str:
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "skipped: mallopt unavailable"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    refused = [name for name, (param, values) in SETTINGS.items() if not any(mallopt(param, v) == 1 for v in values)]
    return f"partly: mallopt refused {', '.join(refused)}" if refused else "tuned"


def large_tensors_on_huge_pages(setting: str = "auto") -> str:
    """Ask torch to put CPU tensors of 2 MiB or more on transparent huge pages (once per process;
    see the module docstring) under the engine's `huge_pages` setting; returns "on", "skipped:
    <reason>" or "too late: <reason>". Raises ValueError where the setting is "on" and the
    request could not take effect."""
    global _huge_pages
    if setting == "off":  # not kept: a later engine of this process may still ask in time
        return "skipped: huge_pages=off"
    if _huge_pages is None:
        _huge_pages = _enable_huge_pages(os.environ)
        log.debug("huge pages for large CPU tensors: %s", _huge_pages)
    if setting == "on" and not _huge_pages.startswith("on"):
        raise ValueError(f"huge_pages=on, but large CPU tensors are not on huge pages ({_huge_pages})")
    return _huge_pages


def huge_pages_skip_reason(env: Mapping[str, str]) -> str | None:
    """Why torch's huge-page setting must be left as it is in this environment, or None to set it."""
    if env.get(_TORCH_THP_ENV) is not None:
        return f"{_TORCH_THP_ENV}={env[_TORCH_THP_ENV]} set by the user"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    return None


def _enable_huge_pages(env: Mapping[str, str]) -> str:
    reason = huge_pages_skip_reason(env)
    if reason is not None:
        return f"skipped: {reason}"
    if not os.path.exists(_THP_SYSFS):
        return "skipped: the kernel has no transparent huge pages"
    # The first large allocation from here on fixes torch's choice; a probe makes it, and tells
    # which it was: with the setting, its memory is advised for huge pages (the kernel flags that
    # mapping "hg"). The variable goes again after: child processes (a test's, a tool's) keep
    # the environment they would have had.
    import torch

    os.environ[_TORCH_THP_ENV] = "1"
    try:
        probe = torch.empty(HUGE_PAGE // 4 + 1, dtype=torch.float32)
    finally:
        del os.environ[_TORCH_THP_ENV]
    flags = _mapping_flags(probe.data_ptr())
    if flags is None:
        return "on (unconfirmed: /proc/self/smaps unreadable)"
    if "hg" in flags:
        return "on"
    return "too late: torch had allocated a tensor of 2 MiB or more before"


def _mapping_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps), or None if unreadable."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, _, end = head.partition("-")
            try:
                inside = int(start, 16) <= address < int(end, 16)
            except ValueError:
                inside = False
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None
