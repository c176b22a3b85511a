"""The engine: add requests, step, get deltas. Continuous batching over a paged KV cache.

One step = schedule (scheduler.py) -> one batched forward over every scheduled token
(model_runner.py) -> sample the rows that finish their tokens (sampler.py) -> append tokens,
detokenize, check finish rules -> release what finished.

Finish rules (checked in this order after each new token):
  EOS (unless ignore_eos; only once min_tokens are out) and stop_token_ids -> STOP, the token is
  kept in output_token_ids but adds no text; a stop string -> STOP, text ends before it;
  max_tokens -> LENGTH; the sequence reached the engine's max_model_len -> LENGTH.

Imports nothing from Kafka, pydantic schemas or boto3: it must run alone on a GPU machine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.engine.block_manager import BlockManager
from worker.engine.config import CPU_DEFAULT_KV_GB, EngineConfig
from worker.engine.cuda_graphs import graph_memory_bytes
from worker.engine.host_memory import keep_freed_memory
from worker.engine.model_runner import ModelRunner, StepInputs
from worker.engine.request import Request, RequestStatus
from worker.engine.sampler import SampledToken, has_penalties
from worker.engine.scheduler import PENDING_TOKEN, Scheduler, SchedulerConfig, SchedulerOutput
from worker.engine.types import (
    EngineRequest,
    EngineStats,
    ErrorKind,
    FinishReason,
    RequestDelta,
    Timing,
    TokenLogprob,
    Usage,
)

log = logging.getLogger(__name__)

# Head-room kept free on CUDA for activations of the largest step, on top of the memory fraction.
CUDA_ACTIVATION_RESERVE_BYTES = 512 * 1024**2


@dataclass
class EngineMetrics:
    """Counters beyond EngineStats, for benchmarks and tests."""

    num_preemptions: int = 0
    prompt_tokens_computed: int = 0  # prefill work actually done (recomputes included)
    output_tokens: int = 0
    # KV slot utilization at the step with the most blocks in use.
    peak_blocks_used: int = 0
    kv_slot_utilization_at_peak: float = 0.0
    # Step wall time split over the steps with the most running sequences (summed over those steps).
    peak_running: int = 0
    peak_steps: int = 0
    peak_step_wall_s: float = 0.0
    peak_step_model_s: float = 0.0  # forward + LM head + sampling
    step_wall_s_total: float = 0.0
    step_model_s_total: float = 0.0
    last_step: dict = field(default_factory=dict)

    @property
    def overhead_fraction_at_peak(self) -> float:
        if self.peak_step_wall_s <= 0:
            return 0.0
        return max(0.0, self.peak_step_wall_s - self.peak_step_model_s) / self.peak_step_wall_s


def resolve_graph_mode(mode: str, device: torch.device, backend_name: str) -> str:
    """EngineConfig.cuda_graphs -> the model runner's graph mode ("on", "off" or "eager")."""
    if mode == "auto":
        return "on" if device.type == "cuda" and backend_name == "triton" else "off"
    if mode == "on" and device.type != "cuda":
        raise ValueError(
            f"cuda_graphs='on' needs a CUDA device (the engine runs on {device}); "
            "'eager' runs the same padded decode path without capture"
        )
    if mode in ("on", "eager") and backend_name != "triton":
        raise ValueError(
            f"cuda_graphs={mode!r} needs the triton attention backend (it reads only device tensors), "
            f"not {backend_name!r}"
        )
    return mode


def resolve_async_scheduling(mode: str, device: torch.device) -> bool:
    return device.type == "cuda" if mode == "auto" else mode == "on"


@dataclass
class _LaunchedStep:
    """A step whose forward and sampling were launched; its tokens may still be on the device."""

    requests: list[Request]  # the rows that sample, in row order
    sampled: list[SampledToken] | None = None  # the tokens, when already on the host (synchronous step)
    host_ids: torch.Tensor | None = None  # otherwise: where the ids arrive (pinned on CUDA)
    ready: torch.cuda.Event | None = None  # recorded after the copy into host_ids (CUDA)
    forward_start: torch.cuda.Event | None = None  # CUDA timing of forward + sampling
    sampled_end: torch.cuda.Event | None = None
    host_model_s: float = 0.0  # forward + sampling wall time (what the CPU spent running them)

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return dev


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from worker.engine.attention import get_attention_backend
        from worker.engine.loader import load_model
        from worker.engine.sampler import Sampler
        from worker.engine.tokenizer import load_tokenizer

        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # steps stop re-faulting their activations' pages (see host_memory)
        backend = get_attention_backend(config.attention_backend, self.device)
        self.model, self.model_config = load_model(
            config.model, dtype=config.dtype, device=self.device, attention_backend=backend
        )
        self.attention_backend = backend
        self.graph_mode = resolve_graph_mode(config.cuda_graphs, self.device, backend.name)
        self.async_scheduling = resolve_async_scheduling(config.async_scheduling, self.device)
        self.tokenizer = load_tokenizer(config.model)
        self.served_model_name = config.served_model_name or Path(str(config.model).rstrip("/")).name
        mc = self.model_config

        max_len = mc.max_model_len
        if config.max_model_len is not None:
            if config.max_model_len > mc.max_model_len:
                raise ValueError(
                    f"max_model_len {config.max_model_len} exceeds the model's limit {mc.max_model_len}"
                )
            max_len = config.max_model_len
        bs = config.block_size
        per_block = ModelRunner.kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, bs)
        num_blocks = self._num_kv_blocks(per_block, max_len, self._graph_reserve_bytes())
        # A single sequence must always fit in the pool, or it could never finish.
        self.max_model_len = min(max_len, num_blocks * bs)
        self.eos_token_ids = list(mc.eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)

        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(
            self.model,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=mc.dtype,
            device=self.device,
            num_blocks=num_blocks,
            block_size=bs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            graph_mode=self.graph_mode,
        )
        # Graphs are captured now: the KV cache exists and no real step has run.
        self._capture_graphs()
        self.sampler = Sampler(seed=config.seed)
        self._in_flight: _LaunchedStep | None = None  # async scheduling: the step whose ids are on the way
        # Requests whose sampling needs their token history on the host every step (penalties,
        # logprobs): while any is in the engine, steps run synchronously.
        self._needs_host_history: set[str] = set()
        self.requests: dict[str, Request] = {}
        self._finish_next: list[Request] = []  # errors and aborts reported at the next step
        self._stats = EngineStats(kv_blocks_total=num_blocks)
        self.metrics = EngineMetrics()
        log.info(
            "engine ready: model=%s device=%s dtype=%s kv_blocks=%d (block %d, %.2f GiB) max_model_len=%d "
            "cuda_graphs=%s async_scheduling=%s",
            self.served_model_name, self.device, mc.dtype, num_blocks, bs,
            num_blocks * per_block / 1024**3, self.max_model_len, self.graph_mode, self.async_scheduling,
        )

    # ------------------------------------------------------------------ set-up
    def _capture_graphs(self) -> None:
        """Capture the decode graphs. When they were only chosen by "auto", a capture that fails
        (e.g. an op that cannot be captured on this GPU) leaves the engine running without graphs,
        with a warning; asked for explicitly ("on"), the failure is raised."""
        try:
            self.runner.capture_graphs()
        except Exception:
            if self.config.cuda_graphs != "auto":
                raise
            log.warning("CUDA graph capture failed; decode steps run without graphs", exc_info=True)
            self.runner.graph_runner = None
            self.graph_mode = "off"

    def _graph_reserve_bytes(self) -> int:
        """GPU memory the decode graphs will hold (0 without captured graphs)."""
        if self.graph_mode != "on":
            return 0
        mc = self.model_config
        return graph_memory_bytes(
            self.config.max_num_seqs, mc.vocab_size, mc.hidden_size, mc.intermediate_size or 4 * mc.hidden_size,
            torch.empty((), dtype=mc.dtype).element_size(),
        )

    def _num_kv_blocks(self, bytes_per_block: int, max_len: int, graph_reserve: int = 0) -> int:
        cfg = self.config
        if cfg.kv_cache_gb is not None:
            budget = cfg.kv_cache_gb * 1024**3
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - cfg.gpu_memory_fraction) * total - CUDA_ACTIVATION_RESERVE_BYTES - graph_reserve
        else:
            budget = CPU_DEFAULT_KV_GB * 1024**3
        num_blocks = int(budget // bytes_per_block)
        # More than every sequence at full length could use is wasted memory.
        useful = cfg.max_num_seqs * -(-max_len // cfg.block_size) + 1
        if cfg.kv_cache_gb is None:
            num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget / 1024**3:.3f} GiB) holds no block of "
                f"{bytes_per_block} bytes; raise kv_cache_gb or gpu_memory_fraction"
            )
        return num_blocks

    # ------------------------------------------------------------------ requests in
    def count_prompt_tokens(self, request: EngineRequest) -> int:
        return len(self._encode(request))

    def _encode(self, request: EngineRequest) -> list[int]:
        from worker.engine.tokenizer import encode_request

        ids = encode_request(
            self.tokenizer,
            prompt=request.prompt,
            messages=request.messages,
            prompt_token_ids=request.prompt_token_ids,
        )
        return [int(t) for t in ids]

    def add(self, request: EngineRequest) -> None:
        """Queue a request. Raises ValueError for a bad one; an over-long prompt finishes as ERROR."""
        from worker.engine.detokenizer import IncrementalDetokenizer
        from worker.engine.sampler import SamplingInputs

        if request.request_id in self.requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}: it is still in the engine")
        ids = self._encode(request)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        req = Request(request, ids)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, request.sampling.stop)
        req.sampling_inputs = SamplingInputs(
            params=request.sampling,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,  # the live list: grows as tokens come
            eos_token_ids=self.eos_token_ids,
        )
        self.requests[req.request_id] = req
        if _needs_host_history(request.sampling):
            self._needs_host_history.add(req.request_id)
        self._stats.prompt_tokens_total += len(ids)
        if len(ids) > self.max_model_len:
            req.finish_reason = FinishReason.ERROR
            req.error_kind = ErrorKind.PROMPT_TOO_LONG
            req.error = f"the prompt has {len(ids)} tokens, the engine allows at most {self.max_model_len}"
            self._finish_next.append(req)
            return
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Finish the request with ABORTED at the next step (unknown or finished ids are ignored)."""
        req = self.requests.get(request_id)
        if req is None or req.finish_reason is not None:
            return
        req.finish_reason = FinishReason.ABORTED
        self._finish_next.append(req)

    def has_work(self) -> bool:
        return bool(self._finish_next) or self.scheduler.has_work() or self._in_flight is not None

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestDelta]:
        t_start = time.perf_counter()
        now = time.time()
        deltas: list[RequestDelta] = []
        if self._finish_next:
            for req in self._finish_next:
                self.scheduler.remove(req)
                self.runner.release(req)
                deltas.append(self._finish(req, req.finish_reason, now, new_ids=[], text=""))
            self._finish_next = []

        if self.async_scheduling and not self._needs_host_history:
            out, model_s = self._step_overlapped(now, deltas)
        else:
            model_s = self._drain(deltas)
            out, more = self._step_synchronous(now, deltas)
            model_s += more
        wall = time.perf_counter() - t_start
        self._record_step_time(out, wall, model_s)
        return deltas

    def _schedule(self, now: float, deltas: list[RequestDelta]) -> SchedulerOutput:
        out = self.scheduler.schedule()
        for req in out.expired:
            deltas.append(self._finish(req, FinishReason.EXPIRED, now, new_ids=[], text=""))
        for req in out.preempted:
            self.runner.release(req)
        if out.preempted:
            self.metrics.num_preemptions += len(out.preempted)
            log.debug("preempted %d request(s)", len(out.preempted))
        return out

    def _step_synchronous(self, now: float, deltas: list[RequestDelta]) -> tuple[SchedulerOutput, float]:
        """Schedule, run and process one step; its tokens are on the host before it returns."""
        out = self._schedule(now, deltas)
        if out.is_empty:
            return out, 0.0
        launched = self._launch(out, overlapped=False)
        self.scheduler.on_step_done(out)
        self._stats.steps += 1
        if launched is None:
            return out, self.runner.last_forward_s
        self._process_samples(launched.requests, launched.sampled, time.time(), deltas, pending=False)
        return out, launched.model_seconds()

    def _step_overlapped(self, now: float, deltas: list[RequestDelta]) -> tuple[SchedulerOutput, float]:
        """Async scheduling: launch step N+1, then take in step N's tokens while N+1 runs.

        The scheduler sees each token of step N as pending (counted, id unknown: PENDING_TOKEN on
        the host) and N+1's decode rows read it from N's sampled ids on the device. A request that
        finishes at N has one token computed in N+1 for nothing: it is discarded, never emitted
        nor counted.
        """
        out = self._schedule(now, deltas)
        launched = self._launch(out, overlapped=True) if not out.is_empty else None
        previous, self._in_flight = self._in_flight, launched
        if launched is None:
            self.runner.set_pending_samples(None, [])
        model_s = 0.0
        if previous is not None:
            model_s = self._take_in(previous, deltas)
        if not out.is_empty:
            # After N's tokens are in the requests: blocks that became full are hashed from real ids.
            self.scheduler.on_step_done(out)
            self._stats.steps += 1
            if launched is None:
                model_s += self.runner.last_forward_s
        return out, model_s

    def _drain(self, deltas: list[RequestDelta]) -> float:
        """Take in the tokens of a step still in flight (before a synchronous step)."""
        previous, self._in_flight = self._in_flight, None
        self.runner.set_pending_samples(None, [])
        return self._take_in(previous, deltas) if previous is not None else 0.0

    def _launch(self, out: SchedulerOutput, *, overlapped: bool) -> _LaunchedStep | None:
        """Forward + sampling of a scheduled step; None when no row samples.

        Synchronous: the tokens come back to the host (the step's one synchronisation).
        Overlapped: the ids stay on the device for the next step's inputs; a non-blocking copy to
        the host is started, and each sampling request gets a PENDING_TOKEN placeholder.
        """
        logits, step_in = self.runner.execute(out.requests, out.num_new_tokens)
        self._record_kv_use(step_in)
        if overlapped:
            self.runner.set_pending_samples(None, [])  # consumed by this step's inputs
        if logits is None:
            return None
        launched = _LaunchedStep(requests=step_in.sample_requests, forward_start=self.runner.forward_start)
        t0 = time.perf_counter()
        with torch.inference_mode():  # logits are inference tensors; the sampler edits them
            if overlapped:
                self._sample_on_device(logits, launched)
            else:
                self._sample_to_host(logits, launched)
        launched.host_model_s = self.runner.last_forward_s + time.perf_counter() - t0
        return launched

    def _sample_to_host(self, logits: torch.Tensor, launched: _LaunchedStep) -> None:
        inputs = [r.sampling_inputs for r in launched.requests]
        if any(inp.params.logprobs is not None for inp in inputs):
            launched.sampled = self.sampler(logits, inputs)
            launched.mark_sampled()
            return
        ids = self.sampler.sample_ids(logits, inputs)
        launched.mark_sampled()
        launched.sampled = [SampledToken(t) for t in ids.tolist()]  # waits for the GPU

    def _sample_on_device(self, logits: torch.Tensor, launched: _LaunchedStep) -> None:
        reqs = launched.requests
        ids = self.sampler.sample_ids(logits, [r.sampling_inputs for r in reqs])
        launched.mark_sampled()
        self.runner.set_pending_samples(ids, reqs)  # the next step's decode inputs
        if ids.device.type == "cuda":
            launched.host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            launched.host_ids.copy_(ids, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        else:
            launched.host_ids = ids
        for r in reqs:
            r.kv.token_ids.append(PENDING_TOKEN)
            r.sampling_inputs.num_pending_tokens += 1

    def _take_in(self, launched: _LaunchedStep, deltas: list[RequestDelta]) -> float:
        """Wait for an overlapped step's ids (the only wait on the GPU) and process its tokens."""
        if launched.ready is not None:
            launched.ready.synchronize()
        sampled = [SampledToken(t) for t in launched.host_ids.tolist()]
        for r in launched.requests:
            r.sampling_inputs.num_pending_tokens -= 1
        self._process_samples(launched.requests, sampled, time.time(), deltas, pending=True)
        return launched.model_seconds()

    def _process_samples(self, reqs, sampled, now: float, deltas: list[RequestDelta], *, pending: bool) -> None:
        """Append each row's token and apply the finish rules. With pending=True the token replaces
        its PENDING_TOKEN placeholder, and rows of requests that already finished are discarded."""
        eos = self._eos
        max_len = self.max_model_len
        finished: list[Request] = []
        num_taken = 0
        for req, s in zip(reqs, sampled, strict=True):
            tok = s.token_id
            if pending:
                if req.status is RequestStatus.FINISHED:
                    continue  # finished (or aborted) before this token: computed for nothing
                _resolve_pending(req, tok)
            else:
                req.append_output(tok)
            num_taken += 1
            if req.first_token_time is None:
                req.first_token_time = now
            params = req.sampling
            n_out = len(req.output_token_ids)
            reason = None
            text = ""
            if n_out >= params.min_tokens and (
                (tok in eos and not params.ignore_eos) or tok in params.stop_token_ids
            ):
                reason = FinishReason.STOP  # the stop token itself adds no text
            else:
                # vLLM's rule: stop strings end a request only once min_tokens tokens are out.
                text, stop_hit = req.detokenizer.add(tok, check_stop=n_out > params.min_tokens)
                if stop_hit:
                    reason = FinishReason.STOP
                elif n_out >= params.max_tokens or n_out + req.num_prompt_tokens >= max_len:
                    reason = FinishReason.LENGTH
            logprobs = None
            if params.logprobs is not None:
                logprobs = self._logprobs(tok, s)
                req.output_logprobs.extend(logprobs)
            if reason is None:
                deltas.append(
                    RequestDelta(
                        request_id=req.request_id, new_token_ids=[tok], text_delta=text, logprobs=logprobs,
                        usage=Usage(req.num_prompt_tokens, n_out, req.num_cached_prompt_tokens),
                    )
                )
            else:
                if reason is not FinishReason.STOP or not req.detokenizer.stopped:
                    text += req.detokenizer.flush()
                if req.status is RequestStatus.WAITING:
                    # Preempted while this token was in flight (async scheduling): it leaves the queue.
                    self.scheduler.remove(req)
                    self.runner.release(req)
                else:
                    finished.append(req)
                deltas.append(self._finish(req, reason, now, new_ids=[tok], text=text, logprobs=logprobs))
        self._stats.generated_tokens_total += num_taken
        self.metrics.output_tokens += num_taken
        if finished:
            self.scheduler.remove_finished(finished)
            for req in finished:
                self.runner.release(req)

    def _logprobs(self, tok: int, s) -> list[TokenLogprob]:
        decode = self._token_text
        return [
            TokenLogprob(
                token_id=tok,
                token=decode(tok),
                logprob=float(s.logprob) if s.logprob is not None else 0.0,
                top_logprobs=[(int(i), decode(int(i)), float(lp)) for i, lp in s.top_logprobs],
            )
        ]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _finish(
        self, req: Request, reason: FinishReason, now: float, *, new_ids: list[int], text: str, logprobs=None
    ) -> RequestDelta:
        req.finish_reason = reason
        req.finish_time = now
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
        self._needs_host_history.discard(req.request_id)
        self._stats.cached_prompt_tokens_total += req.num_cached_prompt_tokens
        arrival = req.arrival_time
        first_sched = req.first_scheduled_time if req.first_scheduled_time is not None else now
        first_tok = req.first_token_time
        timing = Timing(
            queue_ms=max(0.0, (first_sched - arrival) * 1000.0),
            ttft_ms=max(0.0, (first_tok - arrival) * 1000.0) if first_tok is not None else 0.0,
            decode_ms=max(0.0, (now - first_tok) * 1000.0) if first_tok is not None else 0.0,
            total_ms=max(0.0, (now - arrival) * 1000.0),
        )
        return RequestDelta(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text_delta=text,
            finished=True,
            finish_reason=reason,
            logprobs=logprobs,
            usage=Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_prompt_tokens),
            timing=timing,
            error_kind=req.error_kind if reason is FinishReason.ERROR else None,
            error=req.error if reason is FinishReason.ERROR else None,
            output_token_ids=list(req.output_token_ids),
            output_text=req.detokenizer.text if req.detokenizer is not None else "",
            output_logprobs=list(req.output_logprobs) if req.output_logprobs is not None else None,
        )

    # ------------------------------------------------------------------ stats
    def _record_kv_use(self, step_in: StepInputs) -> None:
        used = self.block_manager.num_used_blocks
        m = self.metrics
        m.prompt_tokens_computed += step_in.prompt_tokens_computed
        if used > m.peak_blocks_used and step_in.slots_allocated:
            m.peak_blocks_used = used
            m.kv_slot_utilization_at_peak = step_in.live_tokens / step_in.slots_allocated

    def _record_step_time(self, out: SchedulerOutput, wall: float, model_s: float) -> None:
        m = self.metrics
        m.step_wall_s_total += wall
        m.step_model_s_total += model_s
        running = len(out.requests)
        m.last_step = {"seqs": running, "tokens": out.num_batched_tokens, "wall_s": wall, "model_s": model_s}
        if running > m.peak_running:
            m.peak_running, m.peak_steps, m.peak_step_wall_s, m.peak_step_model_s = running, 0, 0.0, 0.0
        if running == m.peak_running:
            m.peak_steps += 1
            m.peak_step_wall_s += wall
            m.peak_step_model_s += model_s

    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_used=self.block_manager.num_used_blocks,
            prompt_tokens_total=s.prompt_tokens_total,
            cached_prompt_tokens_total=s.cached_prompt_tokens_total,
            generated_tokens_total=s.generated_tokens_total,
            steps=s.steps,
        )

    # ------------------------------------------------------------------ blocking helper
    def generate(self, requests: Iterable[EngineRequest], progress: bool = False) -> dict[str, RequestDelta]:
        """Run requests to completion; returns each request's final delta by request_id."""
        requests = list(requests)
        for r in requests:
            self.add(r)
        wanted = {r.request_id for r in requests}
        results: dict[str, RequestDelta] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(wanted), unit="req", desc="generate")
        try:
            while self.has_work() and len(results) < len(wanted):
                for d in self.step():
                    if d.finished and d.request_id in wanted:
                        results[d.request_id] = d
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return results


def _needs_host_history(params) -> bool:
    """Sampling that reads the request's token history or per-token host results every step."""
    return params.logprobs is not None or has_penalties(params)


def _resolve_pending(req: Request, token_id: int) -> None:
    """Put an overlapped step's token in place of its placeholder (the first one left)."""
    index = req.num_prompt_tokens + len(req.output_token_ids)
    if req.kv.token_ids[index] != PENDING_TOKEN:
        raise RuntimeError(f"request {req.request_id!r}: no pending token at position {index}")
    req.kv.token_ids[index] = token_id
    req.output_token_ids.append(token_id)
