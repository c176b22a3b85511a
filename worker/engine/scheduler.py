"""Continuous-batching scheduler: which requests run this step, and how many tokens each computes.

One rule (vLLM v1): every request has `num_computed_tokens`; each step hands out tokens so that it
catches up with `num_tokens` (prompt + output so far), within `max_num_batched_tokens` tokens and
`max_num_seqs` sequences per step. A decode is 1 token, a prefill is many, a long prefill is split
over steps (chunked prefill), a prefix-cache hit starts computed > 0: all the same rule, so decode
and prefill chunks share one batched forward.

Order: running requests first, by priority (lower first) then arrival; then waiting ones by the
same order. When the KV pool runs out, the running request with the lowest priority, newest
first, is preempted by recompute: its blocks are released (full ones stay in the prefix cache, so
the recompute is mostly cache hits), computed drops to 0 and it goes back to waiting, where its
early arrival puts it at the front.

Prefix-aware admission (after SGLang's longest-prefix-match): among the first `admission_window`
waiting requests, those with the longest cached prefix are admitted first; and a request whose
next uncached block is being computed right now by a running request is held back until that
block is in the cache, so a group sharing a prompt prefix computes it once. Every pass
that leaves a request in the window waiting ages it; after `max_defer_steps` passes it is neither
held back nor overtaken by cache-hit order (nothing starves).

A request ends only through `finish` (or `finish_many`, the same for many requests in one pass over
the running list): it is taken out of waiting or running, its KV blocks are released, and the next
SchedulerOutput names it in `finished`, so that the model runner frees its own per-request state.

After a failed step the engine preempts every running request at once (`preempt_all`, named in
the next output's `preempted`) and, while it looks for the request that caused the failure, lets
only its suspects in, a group at a time (`only`: the others wait; see fault_isolation.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.types import FinishReason

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    admission_window: int = 128
    max_defer_steps: int = 32

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


@dataclass
class SchedulerOutput:
    """What one schedule() decided; every part of the step reads what concerns it."""

    # The requests that compute tokens this step, in batch order.
    requests: list[Request] = field(default_factory=list)
    # How many tokens each of them computes (aligned with requests).
    num_new_tokens: list[int] = field(default_factory=list)
    # Sent back to waiting to free KV blocks (recompute later): the model runner frees their rows.
    preempted: list[Request] = field(default_factory=list)
    # Finished by this schedule(): their deadline passed before they started (also in finished).
    expired: list[Request] = field(default_factory=list)
    # Every request that ended since the previous schedule() (finish, finish_many, expiry): the
    # model runner frees their rows.
    finished: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._num_waiting_with_deadline = 0
        self._finished: list[Request] = []  # ended since the last schedule(): the next output names them
        self._preempted: list[Request] = []  # preempted by preempt_all: the next output names them
        # When set, only these waiting requests may be admitted (the engine's fault isolation).
        self.only: set[Request] | None = None

    # ------------------------------------------------------------------ membership
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        if request.deadline_ms is not None:
            self._num_waiting_with_deadline += 1

    def add_running(self, request: Request) -> None:
        """A request that joins the running batch with its tokens computed already: a forked
        choice of an n > 1 request (sample_groups.py), whose blocks it holds."""
        request.status = RequestStatus.RUNNING
        request.ever_scheduled = True
        self.running.append(request)

    def _take_from_waiting(self, request: Request) -> None:
        self.waiting.remove(request)
        if request.deadline_ms is not None:
            self._num_waiting_with_deadline -= 1

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End one request (see finish_many)."""
        self.finish_many(((request, reason),))

    def finish_many(self, ended: Sequence[tuple[Request, FinishReason]]) -> None:
        """The one way a request ends: status FINISHED and its reason set, taken out of waiting or
        running (running ones in one pass over the running list), its KV blocks released, and named
        in the next SchedulerOutput's `finished`. A request the scheduler never held (refused at
        add) only takes the status and reason."""
        left_running = False
        for req, reason in ended:
            if req.status is RequestStatus.RUNNING:
                left_running = True
            elif req.status is RequestStatus.WAITING and req in self.waiting:
                self._take_from_waiting(req)
            self.bm.release(req.kv)
            req.status = RequestStatus.FINISHED
            req.finish_reason = reason
            self._finished.append(req)
        if left_running:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def preempt_all(self) -> list[Request]:
        """Send every running request back to waiting, as a preemption by recompute (the engine's
        fault isolation: after a failed step, and when a probation group is cleared): blocks
        released, computed tokens dropped; the next output names them in `preempted`, so the
        model runner frees their rows."""
        victims, self.running = self.running, []
        for req in victims:
            self._preempt(req)
        self._preempted.extend(victims)
        return victims

    @property
    def num_unreported(self) -> int:
        """Ended or preempted requests the next output will name (0 after any schedule())."""
        return len(self._finished) + len(self._preempted)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.bm

        # 1. Running requests, in priority order; preempt from the back when blocks run out.
        running = self.running
        running.sort(key=_sort_key)
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:  # nothing to compute (cannot happen for a live request; be safe)
                i += 1
                continue
            allocated = bm.allocate(req.kv, req.num_computed_tokens + n)
            while not allocated:
                victim = running.pop()  # lowest priority, newest: the end of the sorted list
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
                allocated = bm.allocate(req.kv, req.num_computed_tokens + n)
            if not allocated:
                break
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n
            i += 1

        # 2. Expire waiting requests whose deadline passed before they started.
        if self._num_waiting_with_deadline:
            now_ms = self.clock() * 1000.0
            for req in list(self.waiting):
                if req.deadline_ms is not None and not req.ever_scheduled and now_ms > req.deadline_ms:
                    self.finish(req, FinishReason.EXPIRED)
                    out.expired.append(req)

        # 3. Admit waiting requests (not in a step that had to preempt: memory is short).
        if not out.preempted and self.waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            budget = self._admit(out, budget)

        if out.preempted:
            log.debug("preempted %d request(s)", len(out.preempted))
        if self._finished:
            out.finished, self._finished = self._finished, []
        if self._preempted:
            out.preempted[:0], self._preempted = self._preempted, []
        return out

    def _preempt(self, req: Request) -> None:
        self.bm.release(req.kv)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.append(req)  # its early arrival sorts it to the front of waiting
        if req.deadline_ms is not None:
            self._num_waiting_with_deadline += 1

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        cfg = self.config
        bm = self.bm
        bs = bm.block_size
        caching = bm.enable_prefix_caching
        self.waiting.sort(key=_sort_key)
        # A request preempted while its last token was in flight waits until the id is known: its
        # prompt + output cannot be hashed or recomputed before that.
        waiting = self.waiting if self.only is None else [r for r in self.waiting if r in self.only]
        window = [r for r in waiting[: cfg.admission_window] if not r.has_pending_token]

        # Longest cached prefix first within a priority class; long-deferred requests go first.
        hits: dict[int, list[int]] = {}
        if caching:
            for req in window:
                hits[id(req)] = bm.find_cached_prefix(req.kv, req.prefix_cache_limit)
            window.sort(
                key=lambda r: (
                    r.priority,
                    r.deferred_steps < cfg.max_defer_steps,
                    -len(hits[id(r)]),
                    r.arrival_time,
                    r.arrival_seq,
                )
            )
            pending = self._hashes_being_computed()
        admitted: list[Request] = []
        evictions_seen = bm.num_evictions
        for req in window:
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            hit: list[int] = []
            if caching:
                hit = hits[id(req)]
                if bm.num_evictions != evictions_seen:  # an admission above evicted blocks: look again
                    hit = bm.find_cached_prefix(req.kv, req.prefix_cache_limit)
                if req.deferred_steps < cfg.max_defer_steps:
                    hashes = req.kv.block_hashes
                    usable = req.prefix_cache_limit // bs  # blocks it could ever take from the cache
                    if len(hit) < usable and hashes[len(hit)] in pending:
                        continue  # a running request is computing this block right now: wait for it
            num_cached = len(hit) * bs
            n = min(req.num_tokens - num_cached, budget)
            if not bm.allocate(req.kv, num_cached + n, hit):
                break  # no room: later requests wait too, so the order stays fair
            req.num_computed_tokens = num_cached
            if not req.ever_scheduled:
                req.ever_scheduled = True
                req.num_cached_prompt_tokens = min(num_cached, req.num_prompt_tokens)
                req.first_scheduled_time = self.clock()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n
            if caching:
                pending.update(req.kv.block_hashes[len(hit) :])
        for req in admitted:
            self._take_from_waiting(req)
        for req in window:
            if req.status is RequestStatus.WAITING:
                req.deferred_steps += 1  # passed over with room to spare or not: it ages
        return budget

    def _hashes_being_computed(self) -> set[bytes]:
        """Hashes of full blocks that running requests have not computed yet (prefills in flight)."""
        pending: set[bytes] = set()
        bs = self.bm.block_size
        for req in self.running:
            start = req.num_computed_tokens // bs
            hashes = req.kv.block_hashes
            if start < len(hashes):
                pending.update(hashes[start:])
        return pending

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The step's forward ran: its tokens are computed; cache the blocks that became full."""
        register = self.bm.register_computed if self.bm.enable_prefix_caching else None
        for req, n in zip(out.requests, out.num_new_tokens, strict=True):
            if req.status is RequestStatus.FINISHED:
                continue  # finished while the step ran (async scheduling): its blocks are released
            req.num_computed_tokens += n
            if register is not None:
                register(req.kv, req.num_computed_tokens)


def _sort_key(r: Request) -> tuple[int, float, int]:
    return (r.priority, r.arrival_time, r.arrival_seq)
