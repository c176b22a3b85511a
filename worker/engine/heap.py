"""The start-up heap, frozen out of the garbage collector's full passes while an engine serves.

An engine's start-up leaves a few hundred thousand long-lived objects behind (imported modules,
the model's modules and parameter wrappers, the tokenizer, its tables). Python's cyclic garbage
collector walks every tracked object in each full (generation 2) pass, and a busy engine's
allocations trigger one every few steps: rows with logprobs make a list of (id, logprob) pairs per
token, and on a 256-row tiny-llama step those passes cost about 4 ms of an 80 ms step walking
~190,000 start-up objects (`bench --workload features`, 2026-12-06). ``gc.freeze()`` moves the
objects alive now into a permanent generation the passes skip (vLLM's engine core does the same
after its start-up); a collection first, so no start-up garbage is frozen with them.

The freeze is for a process that serves one engine until it exits (the worker, `run-batch`,
`bench`); ``thaw()`` hands the frozen objects back to the collector where the process goes on to
other work (a command run inside a test, a second engine), so that cyclic garbage among them can
still be collected.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now out of the collector's passes; returns how many
    objects are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Give the frozen objects back to the collector (into its oldest generation)."""
    gc.unfreeze()
