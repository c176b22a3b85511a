"""The engine's side of structured output.

- Requests with a constraint wait here, outside the scheduler, until their compile is done
  (compiler.py); then they get a matcher of their own and go to the scheduler, or they fail
  with the compiler's reason.
- Each step, the constrained rows that sample get their bitmask rows filled on the backend's
  threads while the forward runs (`start_step`); the mask is applied to the logits before
  sampling (`StepMask.apply`: cpu_mask.py on the CPU, kernels/token_bitmask.py on CUDA), or greedy
  rows take their masked argmax without it (`StepMask.argmax`), or the greedy screen reads the
  bitmask in its C kernel over its bfloat16 screen of the LM head (`StepMask.allowed`) and no
  logits are made at all.
- Each token taken in advances its request's matcher (`accept`); a complete grammar ends the
  request (`finished`). The matcher lives on the Request, so preemption and recompute keep it:
  recompute rebuilds KV only, the output tokens it has consumed stay.

Constrained requests keep steps synchronous (overlap.py): the mask of step N+1 needs step N's
token on the host.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.sampler import greedy_argmax
from tokenmill.engine.structured.compiler import CompileEntry, ConstraintCompiler
from tokenmill.engine.structured.cpu_mask import apply_bitmask, masked_argmax
from tokenmill.engine.structured.llguidance_backend import LLGuidanceBackend

if TYPE_CHECKING:
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import SchedulerOutput


class StepMask:
    """The bitmask of one step's constrained rows, being filled while the forward runs.

    Its users: the sampler masks the logits (`apply`), or takes the greedy rows' masked argmax
    without writing the mask at all (`argmax`); the greedy screen reads the bitmask rows of its own
    rows (`allowed`, kernels/cpu/greedy_screen.py), part by part in a step run in parts
    (`first_row`). On the CPU both go through cpu_mask.py, on CUDA through the Triton
    kernel. The fill and every use of one step count as one entry of the mask metrics.
    """

    def __init__(self, fill: Future, bitmask: torch.Tensor, rows: list[int], metrics: EngineMetrics) -> None:
        self._fill = fill
        self._bitmask = bitmask  # [len(rows), W] int32, row k for sampling row rows[k]
        self.rows = rows
        self._metrics = metrics
        # (row k of the bitmask, another sampling row it also masks): forked choices of an n > 1
        # request sample from their parent's logits row under its mask (sample_groups.py).
        self._repeats: list[tuple[int, int]] = []
        self._entry: int | None = None  # this step's index in the mask metrics, once recorded
        self._entries: list[float] | None = None  # the metrics' list it is in
        self._fill_s = 0.0
        self._lock = threading.Lock()  # the parts of a step in parts mask their screens side by side

    def wait_filled(self) -> None:
        """Until the helper thread is done with the matchers (before one is copied)."""
        self._fill.result()

    def repeat_row(self, row: int, new_row: int) -> None:
        """Sampling row `new_row` (appended after the step's own rows) takes row `row`'s mask."""
        if row in self.rows:
            self._repeats.append((self.rows.index(row), new_row))

    def of_rows(self, rows: list[int]) -> StepMaskRows:
        """The mask of the sampling rows `rows` only, row i of a tensor being sampling row rows[i]: a
        step whose greedy rows take the screen and whose other rows take the full head (SomeIds)."""
        return StepMaskRows(self, rows)

    def apply(self, logits: torch.Tensor, first_row: int = 0, view: dict[int, int] | None = None) -> None:
        """Wait for the fill, then mask the disallowed ids to -inf in place; row i of `logits` is
        sampling row first_row + i (a part of a step in parts gives its own first row). `view`
        (StepMaskRows): sampling row -> tensor row, for a tensor of some of the rows."""
        self._wait()
        t0 = time.perf_counter()
        bitmask, rows = self._rows_within(first_row, logits.shape[0], logits.device, view)
        if logits.device.type == "cpu":
            apply_bitmask(logits, bitmask, rows)
        else:
            from tokenmill.kernels.token_bitmask import apply_token_bitmask

            apply_token_bitmask(logits, bitmask, rows)
        self._record(t0)

    def argmax(self, logits: torch.Tensor, view: dict[int, int] | None = None) -> torch.Tensor:
        """int64 [N]: every row's greedy token under its mask (rows without one: the plain argmax),
        the same as apply + argmax; on the CPU the logits are left as they are."""
        if logits.device.type != "cpu":
            self.apply(logits, view=view)
            return greedy_argmax(logits)
        self._wait()
        t0 = time.perf_counter()
        bitmask, rows = self._rows_within(0, logits.shape[0], logits.device, view)
        ids = masked_argmax(logits, bitmask, rows)
        self._record(t0)
        return ids

    def allowed(self, count: int, first_row: int = 0, view: dict[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For the greedy screen (kernels/cpu/greedy_screen.py: AllowedIds), which masks in its C
        kernel and writes nothing: (the bitmask, int64 [count]: the bitmask row of each sampling row
        first_row ... first_row + count - 1, -1 for a row without a constraint), once filled."""
        self._wait()
        t0 = time.perf_counter()
        which = [-1] * count
        for k, row in self._pairs(view):
            if first_row <= row < first_row + count:
                which[row - first_row] = k
        rows = torch.tensor(which, dtype=torch.long)
        self._record(t0)
        return self._bitmask, rows

    def _wait(self) -> None:
        self._fill_s = self._fill.result()

    def _pairs(self, view: dict[int, int] | None) -> list[tuple[int, int]]:
        """(bitmask row, the tensor row it masks): the sampling row itself, or where `view` maps it."""
        pairs = [*enumerate(self.rows), *self._repeats]
        return pairs if view is None else [(k, view[row]) for k, row in pairs if row in view]

    def _rows_within(self, first: int, count: int, device: torch.device,
                     view: dict[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mask rows, the rows of a tensor of sampling rows first ... first + count - 1 they mask);
        rows None: mask row i for tensor row i."""
        pairs = self._pairs(view)
        if view is None and first == 0 and not self._repeats and len(self.rows) == count and self.rows[-1] == count - 1:
            return self._bitmask, None  # rows 0 ... count - 1 (they are ascending): every row, in order
        pairs = [(k, row - first) for k, row in pairs if first <= row < first + count]
        index = torch.tensor([k for k, _ in pairs], dtype=torch.long)
        rows = torch.tensor([row for _, row in pairs], dtype=torch.long, device=device)
        return self._bitmask.index_select(0, index), rows

    def _record(self, t0: float) -> None:
        """This step's fill time and the time of this use, in one entry of the mask metrics."""
        used = time.perf_counter() - t0
        m = self._metrics
        with self._lock:
            if self._entry is None:
                self._entry, self._entries = len(m.mask_s), m.mask_s
                m.mask_s.append(self._fill_s + used)
                m.mask_rows.append(len(self.rows) + len(self._repeats))
            elif m.mask_s is self._entries:  # (not drained since: the entry is still there)
                m.mask_s[self._entry] += used


class StepMaskRows:
    """A StepMask seen through a tensor of some of the step's sampling rows (StepMask.of_rows): row i
    of the tensor is sampling row rows[i]; the same uses, one entry of the mask metrics with the
    step's own."""

    def __init__(self, mask: StepMask, rows: list[int]) -> None:
        self._mask = mask
        self._view = {row: i for i, row in enumerate(rows)}

    def apply(self, logits: torch.Tensor, first_row: int = 0) -> None:
        self._mask.apply(logits, first_row, self._view)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._mask.argmax(logits, self._view)

    def allowed(self, count: int, first_row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self._mask.allowed(count, first_row, self._view)


class Constraints:
    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids, *, timeout_s: float, threads: int, max_rows: int,
        metrics: EngineMetrics,
    ) -> None:
        self.backend = LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
        self.compiler = ConstraintCompiler(self.backend, timeout_s=timeout_s, threads=threads,
                                           on_compile=lambda seconds: metrics.compile_s.append(seconds))
        self.waiting: dict[Request, CompileEntry] = {}  # in arrival order
        # Requests that hold a matcher (until they end): a step without any needs no mask pass.
        self.active: set[Request] = set()
        self._metrics = metrics
        self._vocab_size = vocab_size
        self._max_rows = max_rows
        self._bitmask: torch.Tensor | None = None
        self._fill_pool: ThreadPoolExecutor | None = None

    # -- requests waiting for their compile ----------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, req: Request) -> None:
        self.waiting[req] = self.compiler.submit(req.sampling.structured_outputs)

    def forget(self, req: Request) -> None:
        self.waiting.pop(req, None)
        self.active.discard(req)

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose compile ended: (ready, each with its matcher; failed, with the reason)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        for req, entry in list(self.waiting.items()):
            outcome = self.compiler.outcome(entry, now)
            if outcome is None:
                continue
            del self.waiting[req]
            if outcome.error is not None:
                failed.append((req, outcome.error))
            else:
                req.matcher = self.backend.new_matcher(outcome.grammar)
                self.active.add(req)
                ready.append(req)
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Nothing else to do: block until a compile ends (or `timeout_s`)."""
        self.compiler.wait_any(list(self.waiting.values()), timeout_s)

    # -- one step -------------------------------------------------------------------------------
    def start_step(self, out: SchedulerOutput) -> StepMask | None:
        """Start filling the bitmask of the constrained rows that sample in `out` (None if none).
        A row samples when its tokens catch up with the request (the model runner's rule)."""
        if not self.active:
            return None
        matchers: list[tuple[object, int]] = []
        rows: list[int] = []
        row = 0
        for req, n in zip(out.requests, out.num_new_tokens, strict=True):
            if req.num_computed_tokens + n != req.num_tokens or req.sampling.max_tokens == 0:
                continue  # no sampling row: a prefill chunk, or a score-only request
            if req.matcher is not None:
                matchers.append((req.matcher, len(rows)))
                rows.append(row)
            row += 1
        if not rows:
            return None
        bitmask = self._step_bitmask(len(rows))
        fill = self._pool().submit(self._fill, matchers, bitmask)
        return StepMask(fill, bitmask, rows, self._metrics)

    def _fill(self, matchers, bitmask: torch.Tensor) -> float:
        t0 = time.perf_counter()
        self.backend.fill_bitmask(matchers, bitmask)
        return time.perf_counter() - t0

    def _pool(self) -> ThreadPoolExecutor:
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-mask")
        return self._fill_pool

    def _step_bitmask(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of one reused int32 buffer (pinned when CUDA is there)."""
        if self._bitmask is None:
            words = (self._vocab_size + 31) // 32
            pin = torch.cuda.is_available()
            self._bitmask = torch.empty((self._max_rows, words), dtype=torch.int32, pin_memory=pin)
        return self._bitmask[:rows]

    # -- tokens taken in ------------------------------------------------------------------------
    def accept(self, req: Request, token_id: int) -> None:
        """Advance the request's matcher; raises when the token breaks the constraint (it cannot,
        the mask forbids it: this is a bug, and fails the request alone)."""
        if not self.backend.accept(req.matcher, token_id):
            raise RuntimeError(f"token {token_id} is not allowed by the constraint: {self.backend.error(req.matcher)}")

    def fork(self, parent: Request, child: Request) -> None:
        """A forked choice of an n > 1 request starts from its parent's matcher state."""
        child.matcher = self.backend.copy_matcher(parent.matcher)
        self.active.add(child)

    def finished(self, req: Request) -> bool:
        return self.backend.is_finished(req.matcher)

