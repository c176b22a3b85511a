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
another allocator is left alone; TOKENMILL_MALLOC_TUNING=0 turns this off.
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


def keep_freed_memory() -> str:
    """Tune glibc malloc for the engine's allocation pattern (once per process); returns what was
    done: "tuned", "skipped: <reason>" or "partly: ..."."""
    global _applied
    if _applied is None:
        reason = skip_reason(os.environ)
        _applied = f"skipped: {reason}" if reason else _apply()
        log.debug("glibc malloc for the CPU engine: %s", _applied)
    return _applied


def skip_reason(env: Mapping[str, str]) -> str | None:
    """Why malloc must be left as it is in this environment, or None to tune it."""
    if env.get("TOKENMILL_MALLOC_TUNING", "1") == "0":
        return "TOKENMILL_MALLOC_TUNING=0"
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
