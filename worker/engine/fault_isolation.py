"""Fault isolation: an exception in a step fails only the requests that cause it.

A request can make a step raise (a kernel that fails on one shape, a tokenizer edge case, a bug
reached by one sampling setting). Stopping the engine would fail every request in it, and the job
redelivered to the next worker would stop that one too. So the engine blames, recovers and
isolates instead (Engine.step):

Blame, by phase:

- the scheduler's own failure has no request to blame: it propagates and the engine stops;
- launching a step (the runner's inputs and forward, sampling), taking in a whole step (the wait
  for its tokens) and the step's end (prefix-cache registration): every live request of that step
  is a suspect (`blame` turns the exception into a `StepFault` that names them);
- taking in one row (append, detokenize, stop rule, logprobs): that row's request alone fails, at
  once (the engine guards each row; no search is needed).

Recovery (Engine._recover): the step in flight of the overlapped mode is dropped and every
placeholder taken out (its tokens were never taken in, so nothing of it was emitted), and every
running request is preempted by recompute through the scheduler (Scheduler.preempt_all): its
blocks go back, the next step's output names it so the runner frees its row, and it recomputes
its prompt and output later (mostly prefix-cache hits). Nothing a request emitted is lost or sent
twice, and seeded sampling gives the same tokens again (its randomness depends on the step index).

Finding the culprit (`FaultIsolation`), by bisection in rounds. A failure while no round is open
opens one:

1. The failed step's live requests are the suspects; each one's round count goes up. They are
   split in two groups, put first in line.
2. One group at a time is on probation, alone: only its requests are admitted; everything else
   (the other groups, the requests that were not in the failed step, new arrivals) waits. A
   group whose every live member has run `clear_steps` steps without a failure is cleared: it
   goes back to waiting (Engine.step preempts it), and the next group's probation starts. The
   round ends when no group is left, and the engine admits everything again.
3. A failure during probation blames the group's requests in the failed step: a single one is
   failed (FinishReason.ERROR, ErrorKind.INTERNAL, the exception's type and message in `error`);
   several are split in two groups again, put first; the group's members that were not in the
   failed step go back in line as a group of their own.

So a request is failed only when a step that held it alone raised, on probation; a fault that
strikes once (a transient error) fails nobody. A request that raises in every step it is in is
found in 1 + log2(batch size) failed steps, and a round lasts about 2 * clear_steps steps per
level of the bisection.

A broken device fails every step, whoever is in it: after `max_failures_in_a_row` failed steps
with no step passing in between (more than any bisection needs), the error propagates and the
engine stops. The requests found alone at fault on the way are not failed yet then (the engine
hands out their final deltas only once a step runs), so their jobs go to another worker too.

Loops: a fault that comes back only later in a request's output (after its probation) opens a
new round each time it strikes. A suspect whose round count reaches `max_rounds` is no longer
cleared after a few steps: its group stays on probation until all its members finish (splitting
when it raises), so it either fails alone or finishes. That costs throughput while it runs
(everything else waits), but bounds every loop by the suspects' remaining tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.engine.request import Request, RequestStatus


class StepFault(Exception):
    """A step's phase raised; `suspects` are the requests it ran for."""

    def __init__(self, error: Exception, suspects: Sequence[Request], phase: str) -> None:
        super().__init__(f"{phase}: {describe(error)}")
        self.error = error
        self.suspects = list(suspects)
        self.phase = phase


def describe(error: BaseException) -> str:
    """The exception's type and message, as a failed request's `error` says it."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class blame:
    """`with blame(phase, requests):` any exception raised inside becomes a StepFault that blames
    `requests`. A class, not a generator context manager: the engine enters three of these per
    step on its host path, where a generator's set-up cost several times as much."""

    __slots__ = ("phase", "requests")

    def __init__(self, phase: str, requests: Sequence[Request]) -> None:
        self.phase, self.requests = phase, requests

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, StepFault) or not isinstance(exc, Exception):
            return False  # nothing raised, already blamed, or not an error (KeyboardInterrupt): as it is
        raise StepFault(exc, self.requests, self.phase) from exc


def _live(requests: Sequence[Request]) -> list[Request]:
    return [r for r in requests if r.status is not RequestStatus.FINISHED]


@dataclass
class _Group:
    members: list[Request]
    until_finished: bool = False  # repeat suspects: on probation until they all finish


@dataclass
class FaultIsolation:
    """The suspects of failed steps, their probation, and the requests the failures convict."""

    clear_steps: int = 2  # steps each member of a probation group runs without failure to clear it
    max_rounds: int = 3  # rounds a request may be suspect in before its probation lasts to its end
    max_failures_in_a_row: int = 12  # failed steps with none passing between them: the engine stops
    groups: deque[_Group] = field(default_factory=deque)  # in line for probation
    probation: _Group | None = None
    _passed: dict[Request, int] = field(default_factory=dict)  # probation steps run without failure
    _rounds: dict[Request, int] = field(default_factory=dict)  # rounds each live request was suspect in
    _failures_in_a_row: int = 0

    @property
    def num_tracked(self) -> int:
        """Requests this object holds (0 once no round is open and its suspects ended)."""
        held = set(self._rounds) | set(self._passed)
        for group in self.groups:
            held.update(group.members)
        if self.probation is not None:
            held.update(self.probation.members)
        return len(held)

    # ------------------------------------------------------------------ each step
    def admissible(self) -> set[Request] | None:
        """The requests the scheduler may admit this step (None: any). Starts the next group's
        probation when none runs; the round ends when no group is left."""
        while self.probation is None and self.groups:
            group = self.groups.popleft()
            group.members = _live(group.members)
            if group.members:
                self.probation = group
                self._passed.update((r, 0) for r in group.members)
        return None if self.probation is None else set(self.probation.members)

    def step_passed(self, requests: Sequence[Request]) -> bool:
        """A step over `requests` ran without failure. True when it cleared the probation group:
        the caller sends it back to waiting (it is all that runs), for the next group's turn."""
        if requests:
            self._failures_in_a_row = 0
        group = self.probation
        if group is None:
            return False
        passed = self._passed
        for r in requests:
            if r in passed:
                passed[r] += 1
        live = _live(group.members)
        if group.until_finished:
            if live:
                return False
        elif any(passed.get(r, 0) < self.clear_steps for r in live):
            return False
        for r in group.members:
            passed.pop(r, None)
        self.probation = None
        return bool(live)

    # ------------------------------------------------------------------ a failed step
    def on_fault(self, fault: StepFault) -> list[Request]:
        """Take in a failed step's suspects; returns the requests to fail now. Raises the step's
        error when it has no live request to blame, or when too many steps failed in a row."""
        live = _live(fault.suspects)
        self._failures_in_a_row += 1
        if not live or self._failures_in_a_row > self.max_failures_in_a_row:
            raise fault.error
        group = self.probation
        if group is None or not set(live) <= set(group.members):
            # No round open (or, rarely, a step launched before this probation failed late).
            self._open_round(live)
            return []
        rest = self._end_probation(live)
        if rest is not None:  # still suspects of the earlier failure: at the end of the line
            self.groups.append(rest)
        if len(live) == 1:
            return live
        self._queue(live, until_finished=group.until_finished)
        return []

    def _end_probation(self, failed: list[Request]) -> _Group | None:
        """The probation group failed; returns its members that were not in the failed step, as a
        group to put back in line (None if there are none)."""
        group, self.probation = self.probation, None
        for r in group.members:
            self._passed.pop(r, None)
        named = set(failed)
        rest = [r for r in group.members if r not in named]
        return _Group(rest, group.until_finished) if rest else None

    def _open_round(self, suspects: list[Request]) -> None:
        if self.probation is not None:
            rest = self._end_probation(suspects)
            if rest is not None:  # first in line after the new suspects
                self.groups.appendleft(rest)
        rounds = self._rounds
        for r in suspects:
            rounds[r] = rounds.get(r, 0) + 1
        self._queue([r for r in suspects if rounds[r] < self.max_rounds])
        self._queue([r for r in suspects if rounds[r] >= self.max_rounds], until_finished=True)

    def _queue(self, suspects: list[Request], until_finished: bool = False) -> None:
        """Put suspects first in line, in two halves."""
        half = (len(suspects) + 1) // 2
        for part in (suspects[half:], suspects[:half]):
            if part:
                self.groups.appendleft(_Group(part, until_finished))

    # ------------------------------------------------------------------ requests leave
    def forget(self, request: Request) -> None:
        """A request ended: drop what is kept about it (groups drop their finished members lazily)."""
        self._rounds.pop(request, None)
        self._passed.pop(request, None)

    def reset(self) -> None:
        """Nothing is left in the engine: close any open round."""
        self.groups.clear()
        self.probation = None
        self._passed.clear()
        self._rounds.clear()
        self._failures_in_a_row = 0
