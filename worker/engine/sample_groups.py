"""`n` samples of one prompt (sampling.n > 1): one prefill, n decoding rows.

A request with n > 1 becomes a SampleGroup of n engine Requests, one per choice, all with the
caller's request id. Choice 0, the group's parent, is the only one that enters the scheduler: it
computes the prompt like any request. The other choices wait in the group. In the step where the
parent samples its first token (its prompt is computed), they fork from it:

- each child takes the parent's full prompt blocks by reference (the block manager's ref counts)
  and a copy of its last, partly filled block (a child writes its own tokens there), so the
  prompt's K/V is computed once and held once, whatever n is;
- the parent's sampling row is repeated once per child, so each child's first token is drawn
  from the same logits with its own seed (seed + i when a seed is given);
- the children join the running batch with the whole prompt computed; from then on every choice
  is an ordinary running request (decode, preemption by recompute, fault isolation).

When the pool has no free block for a child's copy, that child enters the scheduler as a plain
waiting request instead: it finds the prompt's full blocks in the prefix cache and recomputes
only the last block. Nothing is lost; only the sharing is smaller.

A choice that ends gives a non-final delta (its last tokens, `choice` set); the group's final
delta comes when its last choice ends, with every choice's output in `choices`. A parent that ends
before the fork (refused, aborted, expired, failed) ends its waiting children the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.types import (
    ChoiceOutput,
    EngineRequest,
    FinishReason,
    RequestDelta,
    SamplingParams,
    Timing,
    Usage,
)

if TYPE_CHECKING:
    from tokenmill.engine.block_manager import BlockManager
    from tokenmill.engine.model_runner import ModelRunner, StepInputs
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.engine.structured.constraints import Constraints, StepMask

# A group's finish reason when its choices disagree: the worst one wins (an error fails the job).
_SEVERITY = {
    FinishReason.ERROR: 4, FinishReason.ABORTED: 3, FinishReason.EXPIRED: 2,
    FinishReason.LENGTH: 1, FinishReason.STOP: 1,
}


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling of choice `index`: n = 1, and seed + index when a seed is given."""
    seed = params.seed + index if params.seed is not None else None
    return replace(params, n=1, seed=seed)


@dataclass
class SampleGroup:
    """The choices of one n > 1 request and the final deltas of those that ended."""

    request_id: str
    members: list[Request]  # by choice index; members[0] is the parent
    unforked: list[Request]  # children still waiting for the parent's first sample
    finals: dict[int, RequestDelta] = field(default_factory=dict)

    @property
    def parent(self) -> Request:
        return self.members[0]

    @property
    def done(self) -> bool:
        return len(self.finals) == len(self.members)

    def live_children(self) -> Iterator[Request]:
        """Children that forked and have not ended."""
        waiting = set(map(id, self.unforked))
        for i, m in enumerate(self.members[1:], start=1):
            if i not in self.finals and id(m) not in waiting:
                yield m

    def record(self, choice: int, final: RequestDelta) -> RequestDelta:
        """Choice `choice` ended with `final` (its own final delta). Returns what the engine emits:
        the group's final delta when this was the last choice, else a non-final delta carrying the
        choice's last tokens."""
        self.finals[choice] = final
        if not self.done:
            return RequestDelta(
                request_id=self.request_id, new_token_ids=final.new_token_ids, text_delta=final.text_delta,
                logprobs=final.logprobs, usage=final.usage, choice=choice,
            )
        return self._final(choice, final)

    def _final(self, last_choice: int, last: RequestDelta) -> RequestDelta:
        finals = [self.finals[i] for i in range(len(self.members))]
        first = finals[0]
        reason = max((f.finish_reason for f in finals), key=lambda r: _SEVERITY[r])
        if _SEVERITY[reason] <= 1:
            reason = first.finish_reason  # all generated: the Result's own reason is choice 0's
        failed = next((f for f in finals if f.finish_reason is reason and f.error_kind is not None), None)
        usage = first.usage or Usage()
        choices = [
            ChoiceOutput(
                index=i, token_ids=list(f.output_token_ids or ()), text=f.output_text or "",
                finish_reason=f.finish_reason, logprobs=f.output_logprobs,
                completion_tokens=len(f.output_token_ids or ()),
            )
            for i, f in enumerate(finals)
        ]
        return replace(
            first,
            new_token_ids=last.new_token_ids,
            text_delta=last.text_delta,
            logprobs=last.logprobs,
            finish_reason=reason,
            error_kind=failed.error_kind if failed is not None else None,
            error=failed.error if failed is not None else None,
            usage=Usage(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=sum(c.completion_tokens for c in choices),
                cached_prompt_tokens=usage.cached_prompt_tokens,
            ),
            timing=_group_timing(finals),
            choice=last_choice,
            choices=choices,
        )


def _group_timing(finals: list[RequestDelta]) -> Timing | None:
    """Queue and first-token times of choice 0 (it ran the prefill); decode and total up to the
    last choice's end."""
    timings = [f.timing for f in finals if f.timing is not None]
    if not timings:
        return None
    return replace(
        timings[0], decode_ms=max(t.decode_ms for t in timings), total_ms=max(t.total_ms for t in timings)
    )


def check_group_params(params: SamplingParams) -> None:
    """What n > 1 does not combine with (ValueError: the caller refuses the request)."""
    if params.max_tokens == 0:
        raise ValueError("n > 1 needs max_tokens >= 1: a score-only request (max_tokens 0) has one answer")


def new_group(request: EngineRequest, make: Callable[[EngineRequest], Request]) -> SampleGroup:
    """The n choices of `request` (make builds one engine Request from an EngineRequest)."""
    n = request.sampling.n
    members = []
    for i in range(n):
        member = make(replace(request, sampling=choice_params(request.sampling, i)))
        member.choice = i
        members.append(member)
    group = SampleGroup(request.request_id, members, unforked=members[1:])
    for member in members:
        member.group = group
    return group


def end_unforked(group: SampleGroup, parent: Request, reason: FinishReason) -> list[Request]:
    """The parent ends before its first sample: its waiting children end with it (the same error,
    when it failed). Returns them, already taken out of the group's waiting list."""
    children, group.unforked = group.unforked, []
    for child in children:
        child.status = RequestStatus.FINISHED
        child.finish_reason = reason
        if parent.error_kind is not None:
            child.set_error(parent.error_kind, parent.error or "")
    return children


def fork_choices(
    step: StepInputs, logits: torch.Tensor, scheduler: Scheduler, block_manager: BlockManager,
    runner: ModelRunner, max_num_seqs: int, constraints: Constraints, token_mask: StepMask | None = None,
) -> torch.Tensor:
    """Fork the waiting children of every parent that samples its first token in this step (see
    the module's docstring); returns the logits with one more row per forked child (the parent's,
    repeated), and step.sample_requests gains the children in the same order. A constrained
    parent's children get copies of its matcher (nothing consumed yet) and its row's mask."""
    rows: list[int] = []
    forked: list[Request] = []
    copies: list[tuple[int, int]] = []
    for row, parent in enumerate(step.sample_requests):
        group = parent.group
        if group is None or not group.unforked or parent.choice != 0:
            continue
        children, group.unforked = group.unforked, []
        num_tokens = parent.num_tokens  # the prompt: the parent has sampled nothing yet
        for child in children:
            if parent.matcher is not None:
                if token_mask is not None:
                    token_mask.wait_filled()  # the mask fill reads the parent's matcher until then
                constraints.fork(parent, child)
            if scheduler.num_running >= max_num_seqs or not block_manager.can_fork(num_tokens):
                scheduler.add(child)  # no room to fork: it runs alone, its prompt mostly cached
                continue
            copy = block_manager.fork(parent.kv, child.kv, num_tokens)
            if copy is not None:
                copies.append(copy)
            child.num_computed_tokens = num_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            scheduler.add_running(child)
            if token_mask is not None:
                token_mask.repeat_row(row, len(step.sample_requests) + len(forked))
            rows.append(row)
            forked.append(child)
    if not forked:
        return logits
    runner.copy_blocks(copies)
    index = torch.tensor([*range(len(step.sample_requests)), *rows], dtype=torch.int64, device=logits.device)
    step.sample_requests = [*step.sample_requests, *forked]
    return logits.index_select(0, index)
