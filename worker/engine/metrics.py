"""EngineMetrics: counters beyond EngineStats, for benchmarks and tests, and how a step records them.

Per step the engine records the KV use of the batch it launched (record_kv_use) and, at the end,
the step's wall and model time (record_step). Model time is forward + LM head + sampling: on the
CPU its wall time, on CUDA GPU time from events (see docs/engine.md, "Statistics on a GPU").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.model_runner import StepInputs
    from tokenmill.engine.scheduler import SchedulerOutput


@dataclass
class EngineMetrics:
    """Counters beyond EngineStats, for benchmarks and tests."""

    num_preemptions: int = 0
    prompt_tokens_computed: int = 0  # prefill work actually done (recomputes included)
    # KV slot utilization at the step with the most blocks in use.
    peak_blocks_used: int = 0
    kv_slot_utilization_at_peak: float = 0.0
    # Step wall time split over the steps with the most running sequences (summed over those steps).
    peak_running: int = 0
    peak_steps: int = 0
    peak_step_wall_s: float = 0.0
    peak_step_model_s: float = 0.0  # forward + LM head + sampling
    last_step: dict = field(default_factory=dict)  # seqs, tokens, wall_s, model_s of the last step
    # Structured output (worker/engine/structured/): one entry per compile that ran (cache hits
    # are not compiles), one per step with constrained rows (bitmask fill + its uses, host seconds,
    # with the rows it masked), and the requests failed for a constraint that did not compile.
    compile_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)
    mask_rows: list[int] = field(default_factory=list)
    constraint_failures: int = 0

    def drain_structured(self) -> tuple[list[float], list[float]]:
        """(compile seconds, mask seconds) observed since the last drain, and forget them: a
        long-running owner drains every step so the lists stay short."""
        compile_s, mask_s = self.compile_s, self.mask_s
        self.compile_s, self.mask_s, self.mask_rows = [], [], []
        return compile_s, mask_s

    @property
    def overhead_fraction_at_peak(self) -> float:
        if self.peak_step_wall_s <= 0:
            return 0.0
        return max(0.0, self.peak_step_wall_s - self.peak_step_model_s) / self.peak_step_wall_s

    def record_kv_use(self, step_in: StepInputs, used_blocks: int) -> None:
        """A batch was launched while `used_blocks` KV blocks are in use."""
        self.prompt_tokens_computed += step_in.prompt_tokens_computed
        if used_blocks > self.peak_blocks_used and step_in.slots_allocated:
            self.peak_blocks_used = used_blocks
            self.kv_slot_utilization_at_peak = step_in.live_tokens / step_in.slots_allocated

    def record_step(self, out: SchedulerOutput, wall_s: float, model_s: float) -> None:
        """A step ended: what it scheduled, its wall time and the model time taken in with it."""
        self.num_preemptions += len(out.preempted)
        running = len(out.requests)
        self.last_step = {"seqs": running, "tokens": out.num_batched_tokens, "wall_s": wall_s, "model_s": model_s}
        if running > self.peak_running:
            self.peak_running, self.peak_steps, self.peak_step_wall_s, self.peak_step_model_s = running, 0, 0.0, 0.0
        if running == self.peak_running:
            self.peak_steps += 1
            self.peak_step_wall_s += wall_s
            self.peak_step_model_s += model_s
