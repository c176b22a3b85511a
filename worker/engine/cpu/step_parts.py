"""One CPU step as parts that run side by side, each on a thread of its own.

Why: a decode step's GEMMs have tens to a few hundred rows, and one such GEMM split over torch's
threads gains only ~1.45x from one thread to two (MKL and oneDNN both), while the element-wise ops
of those sizes run on one core whatever the thread count, and every parallel region ends in a
barrier that waits for the slowest thread (for long, beside a busy process). Two single-threaded
GEMMs of half the rows, side by side, each run at the one-thread rate. So a step's requests are cut
into contiguous parts of about equal work; each part runs every layer (attention included) and,
for greedy rows, the greedy screen on a pool thread with its share of torch's threads, and the
parts' rows are joined in batch order (model_runner.ModelRunner._execute_in_parts). A step that
needs logits runs the full LM head once over the joined rows.

A row's result does not depend on which part computed it beyond what any change of batch size
already does (GEMM blocking by row count), so the greedy sequences stay those of the unsplit step.

Work of a request in a step: n tokens through the projections, plus each token's attention over the
keys before it, plus the LM head when it samples. `key_weight` is what one key costs against one
token's projections: the K and V rows read (8 bytes per kv element at ~15 GB/s) against
2 * layer parameters FLOP (at ~100 GFLOP/s), about 13 * kv_size / layer_params. `head_weight` is a
sampling row's LM head: on tiny-llama (vocabulary 32,000, four small layers) 2.5 tokens' worth, on
SmolLM2 0.24; left out, the part with the most decode rows came out ~9% heavier. A step is split
only when its parts come out within `SLACK` of an even share; a step of one long prefill chunk,
say, runs whole with every thread.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# A part may hold up to this much more than an even share of the step's work.
SLACK = 1.25
# Fewer tokens than this in a step: the hand-over to the pool costs more than the split gains.
MIN_TOKENS = 8


def default_parts(threads: int, wait_policy: str | None = None) -> int:
    """Parts per step for `threads` torch threads under OpenMP wait policy `wait_policy` (the
    OMP_WAIT_POLICY the process started with; None reads it from the environment).

    Two from two threads (each part then has half the threads) when the policy is passive, else
    one. Measured on two cores (docs/engine.md, "Steps in parts"): under the passive policy parts
    were never slower (tiny-llama +5%, +8% beside a busy process; SmolLM2 +1%); under the default,
    spinning policy, a whole step's team is quick on a quiet machine (SmolLM2 8% slower in parts)
    but stalls beside a busy process (1.7-1.9x faster in parts there), so there it is left to
    `cpu_step_parts`. More parts than two would leave each GEMM too few rows on many cores.
    """
    if wait_policy is None:
        wait_policy = os.environ.get("OMP_WAIT_POLICY", "")
    passive = wait_policy.strip().lower() == "passive"
    return 2 if threads >= 2 and passive else 1


def key_weight(kv_size: int, layer_params: int) -> float:
    """One attended key's cost in units of one token's projections (see the module docstring)."""
    return 13.0 * kv_size / max(layer_params, 1)


def head_weight(vocab_size: int, hidden_size: int, num_layers: int, layer_params: int) -> float:
    """One sampling row's LM head in units of one token's projections through every layer. The
    0.9 is fitted: on tiny-llama the parts' CPU time came to 0.17 ms per sampling row against
    0.066 ms per token (the greedy screen's bfloat16 GEMM, its candidates, the row's own costs)."""
    return 0.9 * vocab_size * hidden_size / max(num_layers * layer_params, 1)


def layer_params(mc) -> int:
    """Weights of one decoder layer's projections (qkv, o, gate/up, down) of a ModelConfig."""
    h = mc.hidden_size
    return h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h + 3 * h * mc.intermediate_size


def plan_parts(num_new_tokens: np.ndarray, seq_lens: np.ndarray, parts: int, weight_per_key: float,
               samples: np.ndarray | None = None, weight_per_sample: float = 0.0) -> list[slice] | None:
    """Contiguous slices of the step's requests, one per part, of about equal work; None when the
    step cannot be split well (one request, too few tokens, or no cut within SLACK of even).

    samples: which requests sample this step (their row goes through the LM head, which the parts
    also run for greedy rows), each weighing `weight_per_sample` more."""
    count = len(num_new_tokens)
    if parts < 2 or count < parts or int(num_new_tokens.sum()) < MIN_TOKENS:
        return None
    n = num_new_tokens.astype(np.float64)
    # Keys attended by a chunk of n tokens ending at seq_len: n * seq_len - n * (n - 1) / 2.
    keys = n * seq_lens - n * (n - 1) / 2
    work = n + weight_per_key * keys
    if samples is not None:
        work = work + weight_per_sample * samples
    prefix = np.cumsum(work)
    total = float(prefix[-1])
    targets = total * np.arange(1, parts) / parts
    cuts = np.searchsorted(prefix, targets)  # first request whose prefix reaches the target
    # Cut before or after that request, whichever lands nearer the target.
    before = np.where(cuts > 0, prefix[np.maximum(cuts - 1, 0)], 0.0)
    cuts = np.where(np.abs(before - targets) <= np.abs(prefix[cuts] - targets), cuts, cuts + 1)
    bounds = [0, *np.clip(cuts, 1, count - 1).tolist(), count]
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:], strict=True)):
        return None
    share = [float(prefix[b - 1] - (prefix[a - 1] if a else 0.0)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if max(share) > SLACK * total / parts:
        return None
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class StepPartPool:
    """`parts` threads, the i-th computing with `threads_per_part[i]` torch threads; part i of a
    step always goes to thread i.

    torch's thread count is per thread (OpenMP's ICV, MKL's local setting), but a thread takes the
    process-wide count the first time it runs torch, and torch.set_num_threads also sets that
    process-wide count. So each pool thread sets its own count at start, and the constructor, once
    they all have, sets the caller's count again for every thread started later.
    """

    def __init__(self, threads_per_part: Sequence[int]) -> None:
        import torch

        if len(threads_per_part) < 2 or min(threads_per_part) < 1:
            raise ValueError(f"a step part pool needs two or more parts of one thread or more; got {threads_per_part}")
        self.parts = len(threads_per_part)
        own = torch.get_num_threads()
        started = threading.Barrier(self.parts + 1)
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(self.parts)]
        self._threads = [
            threading.Thread(target=self._serve, args=(inbox, count, started), name=f"step-part-{i}", daemon=True)
            for i, (inbox, count) in enumerate(zip(self._inboxes, threads_per_part, strict=True))
        ]
        for thread in self._threads:
            thread.start()
        started.wait()
        torch.set_num_threads(own)
        _live_pools.add(self)

    @staticmethod
    def _serve(inbox: queue.SimpleQueue, threads: int, started: threading.Barrier) -> None:
        import torch

        torch.get_num_threads()  # this thread's first torch call: it takes the process-wide count now
        torch.set_num_threads(threads)  # then its own (and, until the constructor resets it, everyone's)
        started.wait()
        while True:
            job = inbox.get()
            if job is None:
                return
            fn, args, future = job
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                future.set_exception(exc)

    def map(self, fn: Callable[..., T], args: Sequence[tuple]) -> list[T]:
        """fn(*args[i]) on thread i, side by side; results in order. The first exception is raised
        once every part has ended, so none is left running on the step's buffers."""
        if len(args) > self.parts:
            raise ValueError(f"{len(args)} parts for a pool of {self.parts}")
        futures: list[Future] = []
        for inbox, a in zip(self._inboxes, args, strict=False):
            future: Future = Future()
            inbox.put((fn, a, future))
            futures.append(future)
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]

    def stop(self) -> None:
        """Let the threads end once their current part is done (does not wait for them)."""
        for inbox in self._inboxes:
            inbox.put(None)

    def close(self) -> None:
        self.stop()
        for thread in self._threads:
            thread.join()


# Pools still alive when the interpreter exits end their threads first: a pool thread that has run
# torch and is still parked at exit makes the C++ runtime abort the process as it tears down.
_live_pools: weakref.WeakSet[StepPartPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_live_pools):
        pool.close()
