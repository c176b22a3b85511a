"""Launched steps and the overlapped mode (async scheduling).

A launched step is a forward + sampling whose tokens the engine has not taken in yet. Synchronous,
its tokens come to the host at once (the step's one synchronisation). Overlapped, step N+1 is
launched before step N's tokens are on the host:

- N's sampled ids stay on the device as the PendingTokens of N+1's inputs; a non-blocking copy to
  the host is started, and every request that sampled gets a placeholder (Request.add_pending), so
  the scheduler counts the token (its id unknown) and N+1 computes it;
- once N+1 is launched, N's ids are taken in (the only wait on the GPU) and each replaces its
  placeholder (Request.resolve_pending) while N+1 runs;
- a request that finishes at N has one token computed in N+1 for nothing: it is discarded, never
  emitted nor counted.

Requests whose sampling reads their token history on the host every step (penalties, logprobs,
a constraint: its mask for step N+1 needs step N's token in its matcher) keep the engine
synchronous while they are in it: the step left in flight is drained first. On a GPU a batch
with constrained rows therefore runs without the overlap (docs/engine.md, "Structured output").
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tokenmill.engine.model_runner import GreedyIds, PendingTokens, SomeIds
from tokenmill.engine.request import Request
from tokenmill.engine.sampler import SampledToken, Sampler, SamplingInputs, TokenMask, has_penalties
from tokenmill.engine.types import SamplingParams


@dataclass
class LaunchedStep:
    """A step whose forward and sampling were launched; its tokens may still be on the device."""

    requests: list[Request]  # the rows that sample, in row order
    sampled: list[SampledToken] | None = None  # the tokens, when already on the host (synchronous step)
    pending: PendingTokens | None = None  # overlapped: the ids on the device (the next step's inputs)
    host_ids: torch.Tensor | None = None  # overlapped: where the ids arrive (pinned on CUDA)
    ready: torch.cuda.Event | None = None  # recorded after the copy into host_ids (CUDA)
    forward_start: torch.cuda.Event | None = None  # CUDA timing of forward + sampling
    sampled_end: torch.cuda.Event | None = None
    host_model_s: float = 0.0  # forward + sampling wall time (what the CPU spent running them)

    @property
    def overlapped(self) -> bool:
        """Its requests hold placeholders for its tokens."""
        return self.pending is not None

    def mark_sampled(self) -> None:
        """Sampling is launched: close the CUDA timing (nothing to do on the CPU)."""
        if self.forward_start is not None:
            self.sampled_end = torch.cuda.Event(enable_timing=True)
            self.sampled_end.record()

    def model_seconds(self) -> float:
        """Forward + sampling time; on CUDA GPU time from events (complete once the ids are in)."""
        if self.forward_start is not None and self.sampled_end is not None:
            return self.forward_start.elapsed_time(self.sampled_end) / 1000.0
        return self.host_model_s

    def host_tokens(self) -> list[SampledToken]:
        """The tokens on the host, row by row; an overlapped step's wait for its ids (the only
        wait on the GPU)."""
        if self.sampled is not None:
            return self.sampled
        if self.ready is not None:
            self.ready.synchronize()
        return [SampledToken(t) for t in self.host_ids.tolist()]


def launch_sampling(
    sampler: Sampler, logits: torch.Tensor | GreedyIds | SomeIds, requests: list[Request], *,
    forward_start: torch.cuda.Event | None,
    forward_s: float, overlapped: bool, token_mask: TokenMask | None = None,
) -> LaunchedStep:
    """Sample a launched forward's logits. Synchronous: the tokens come back to the host.
    Overlapped: the ids stay on the device, their copy to the host is started, and each request
    gets a placeholder. `token_mask` masks the constrained rows (always a synchronous step)."""
    launched = LaunchedStep(requests=requests, forward_start=forward_start)
    t0 = time.perf_counter()
    with torch.inference_mode():  # logits are inference tensors; the sampler edits them
        if isinstance(logits, GreedyIds):  # the forward found the tokens already (no mask here)
            _take_ids(logits.ids, launched, overlapped)
        elif isinstance(logits, SomeIds):  # some rows' tokens found already, the others' logits
            _sample_some(sampler, logits, launched, overlapped)
        elif overlapped:
            _sample_on_device(sampler, logits, launched)
        else:
            _sample_to_host(sampler, logits, launched, token_mask)
    launched.host_model_s = forward_s + time.perf_counter() - t0
    return launched


def _sample_to_host(
    sampler: Sampler, logits: torch.Tensor, launched: LaunchedStep, token_mask: TokenMask | None
) -> None:
    launched.sampled = _tokens_to_host(sampler, logits, [r.sampling_inputs for r in launched.requests], token_mask)
    launched.mark_sampled()


def _tokens_to_host(
    sampler: Sampler, logits: torch.Tensor, inputs: list[SamplingInputs], token_mask: TokenMask | None
) -> list[SampledToken]:
    """The rows' tokens on the host: with their logprobs where a row asks (the sampler's host work
    per row), else the sampled ids brought over at once (waits for the GPU)."""
    if any(inp.params.logprobs is not None for inp in inputs):
        return sampler(logits, inputs, token_mask)
    return [SampledToken(t) for t in sampler.sample_ids(logits, inputs, token_mask).tolist()]


def _take_ids(ids: torch.Tensor, launched: LaunchedStep, overlapped: bool) -> None:
    """Tokens the forward computed itself (GreedyIds, on the CPU)."""
    launched.mark_sampled()
    if overlapped:
        _leave_pending(ids, launched)
    else:
        launched.sampled = [SampledToken(t) for t in ids.tolist()]


def _sample_some(sampler: Sampler, some: SomeIds, launched: LaunchedStep, overlapped: bool) -> None:
    """SomeIds: the logits rows sampled (with their logprobs where asked), the screened rows' ids put
    beside them in the step's row order."""
    reqs = launched.requests
    inputs = [reqs[i].sampling_inputs for i in some.logit_rows]
    if overlapped:  # no logprobs row here, nor a mask: steps with one are synchronous
        ids = torch.empty(len(reqs), dtype=torch.int64)
        ids[some.id_rows] = some.ids
        ids[some.logit_rows] = sampler.sample_ids(some.logits, inputs, some.mask).to(torch.int64)
        launched.mark_sampled()
        _leave_pending(ids, launched)
        return
    sampled = _tokens_to_host(sampler, some.logits, inputs, some.mask)
    launched.mark_sampled()
    tokens: list[SampledToken | None] = [None] * len(reqs)
    for row, token_id in zip(some.id_rows, some.ids.tolist(), strict=True):
        tokens[row] = SampledToken(token_id)
    for row, token in zip(some.logit_rows, sampled, strict=True):
        tokens[row] = token
    launched.sampled = tokens


def _sample_on_device(sampler: Sampler, logits: torch.Tensor, launched: LaunchedStep) -> None:
    ids = sampler.sample_ids(logits, [r.sampling_inputs for r in launched.requests])
    launched.mark_sampled()
    _leave_pending(ids, launched)


def _leave_pending(ids: torch.Tensor, launched: LaunchedStep) -> None:
    """The ids stay where they are, as the next step's inputs; their copy to the host is started."""
    reqs = launched.requests
    launched.pending = PendingTokens(ids, reqs)
    if ids.device.type == "cuda":
        launched.host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        launched.host_ids.copy_(ids, non_blocking=True)
        launched.ready = torch.cuda.Event()
        launched.ready.record()
    else:
        launched.host_ids = ids
    for r in reqs:
        r.add_pending()


def needs_host_history(params: SamplingParams) -> bool:
    """Sampling that reads the request's token history or per-token host results every step."""
    return (
        params.logprobs is not None or has_penalties(params) or params.structured_outputs is not None
        or params.prompt_logprobs is not None  # its scores are read on the host in the step (scoring.py)
    )


class Overlap:
    """The overlapped mode's state: the step in flight, and the requests that keep steps synchronous."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # async scheduling asked for (or chosen by "auto")
        self.in_flight: LaunchedStep | None = None  # the step whose ids are on the way
        self.needs_host_history: set[Request] = set()  # requests for which steps run synchronously

    @property
    def active(self) -> bool:
        """This step overlaps with the next."""
        return self.enabled and not self.needs_host_history

    @property
    def pending(self) -> PendingTokens | None:
        """The in-flight step's ids, for the inputs of the step launched now."""
        return self.in_flight.pending if self.in_flight is not None else None

    def track(self, request: Request) -> None:
        """A request entered the engine."""
        if needs_host_history(request.sampling):
            self.needs_host_history.add(request)

    def forget(self, request: Request) -> None:
        """A request left the engine."""
        self.needs_host_history.discard(request)

    def swap(self, launched: LaunchedStep | None) -> LaunchedStep | None:
        """`launched` goes in flight; the step that was in flight comes out, to be taken in."""
        previous, self.in_flight = self.in_flight, launched
        return previous

    def drain(self) -> LaunchedStep | None:
        """The step in flight, to be taken in before a synchronous step."""
        return self.swap(None)

    def drop(self, requests: Iterable[Request]) -> None:
        """After a failed step: forget the step in flight (its tokens were never taken in, so
        nothing of it was emitted) and take every placeholder out of `requests`."""
        self.in_flight = None
        for r in requests:
            r.drop_pending()
