"""The engine: add requests, step, get deltas. Continuous batching over a paged KV cache.

One step = end what was aborted or refused -> schedule (scheduler.py) -> one batched forward over
every scheduled token (model_runner.py) and sampling of the rows that finish their tokens
(overlap.py: synchronous, or overlapped with the next step) -> take the tokens in: append them,
detokenize, apply the stop rule (stop_rule.py) -> end what finished (Scheduler.finish_many) and
build the deltas (outputs.py). Set-up decisions are in sizing.py, benchmark counters in metrics.py.

A step that raises fails only the requests that caused it (fault_isolation.py): a row whose
take-in raises fails its own request; a launch or take-in that raises for the whole step brings
the engine back to a consistent state (the step in flight dropped, every running request
preempted) and the failed step's requests are re-run in smaller groups until the culprit is
found and failed. Only a failure with no request to blame (the scheduler's own), or one in
every step (a broken device), propagates.
When nothing is left to run, a step also frees what the last finished requests held (their rows,
the scheduler's list naming them), so an idle engine holds no request.

A request with a constraint (structured output) waits outside the scheduler until its compile
is done (structured/constraints.py), then runs like any other; its sampling row is masked, and
each token it takes advances its matcher; a complete grammar finishes it with STOP.

A request with prompt_logprobs has its prompt scored as the prompt is computed (scoring.py; its
prefix-cache lookup stops before the first position to score); with max_tokens 0 it samples no
token and ends with LENGTH once its prompt is computed.

A request with `n` > 1 is a group of n choices (sample_groups.py): choice 0 computes the prompt, the
others fork its KV blocks in the step it samples its first token, and decode as rows of their own.

Imports nothing from Kafka, pydantic schemas or boto3: it must run alone on a GPU machine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from operator import attrgetter
from pathlib import Path

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.cpu.host_memory import keep_freed_memory, large_tensors_on_huge_pages
from tokenmill.engine.cpu.step_parts import StepPartPool, default_parts, head_weight, key_weight, layer_params
from tokenmill.engine.cpu.threads import apply_cpu_threads
from tokenmill.engine.fault_isolation import FaultIsolation, StepFault, blame, describe
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.outputs import final_delta, token_delta, token_logprobs
from tokenmill.engine.overlap import LaunchedStep, Overlap, launch_sampling
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.sample_groups import (
    SampleGroup,
    check_group_params,
    end_unforked,
    fork_choices,
    new_group,
)
from tokenmill.engine.sampler import SampledToken
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.engine.sizing import (
    resolve_async_scheduling,
    resolve_device,
    resolve_graph_mode,
    size_kv_cache,
)
from tokenmill.engine.stop_rule import check_stop, is_stop_token, stop_strings_count
from tokenmill.engine.structured.constraints import Constraints
from tokenmill.engine.token_texts import TokenTexts
from tokenmill.engine.types import (
    EngineRequest,
    EngineStats,
    ErrorKind,
    FinishReason,
    RequestDelta,
    TokenLogprob,
)
from tokenmill.kernels.cpu.paths import CpuPaths, resolve_cpu_paths

log = logging.getLogger(__name__)

_max_tokens = attrgetter("sampling.max_tokens")

# How long an engine with nothing to run but compiles in progress blocks in one step.
COMPILE_WAIT_S = 0.05


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.engine.attention import get_attention_backend
        from tokenmill.engine.loader import load_model
        from tokenmill.engine.sampler import Sampler
        from tokenmill.engine.tokenizer import load_tokenizer

        self.config = config
        self.device = resolve_device(config.device)
        self.cpu_threads: int | None = None
        self.cpu_paths = CpuPaths()  # on CUDA no CPU kernel takes a tensor
        if self.device.type != "cpu" and config.batch_invariant == "on":
            raise ValueError("batch_invariant=on: only the CPU engine is batch invariant so far (on a GPU the "
                             "attention kernel is, the GEMMs are not; docs/engine.md, Batch invariance)")
        if self.device.type == "cpu":
            keep_freed_memory(config.malloc_tuning)  # steps stop re-faulting their activations' pages
            large_tensors_on_huge_pages(config.huge_pages)  # weights and activations on 2 MiB pages, before loading
            self.cpu_threads, why = apply_cpu_threads(config.cpu_threads)
            log.info("CPU engine computes with %d thread(s): %s", self.cpu_threads, why)
            self.cpu_paths = resolve_cpu_paths(config)  # which CPU kernels the model and the backend take
            log.info("CPU paths: %s", self.cpu_paths)
        backend = get_attention_backend(config.attention_backend, self.device, self.cpu_paths)
        self.model, self.model_config = load_model(
            config.model, dtype=config.dtype, device=self.device, attention_backend=backend,
            cpu_paths=self.cpu_paths,
        )
        self.attention_backend = backend
        graph_mode = resolve_graph_mode(config.cuda_graphs, self.device, backend.name)
        self.tokenizer = load_tokenizer(config.model)
        self.served_model_name = config.served_model_name or Path(str(config.model).rstrip("/")).name
        mc = self.model_config
        # Every Result the same bits whatever it is batched with: a float32 CPU engine on those paths.
        self.batch_invariant = self.cpu_paths.batch_invariant and str(mc.dtype) == "torch.float32"
        if config.batch_invariant == "on" and not self.batch_invariant:
            raise ValueError(f"batch_invariant=on: the batch-invariant paths take float32 weights, not {mc.dtype}")
        kv = size_kv_cache(config, mc, self.device, graph_mode)
        self.max_model_len = kv.max_model_len
        self.eos_token_ids = list(mc.eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)

        bs = config.block_size
        self.block_manager = BlockManager(kv.num_blocks, bs, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs),
            self.block_manager,
        )
        per_layer = layer_params(mc)  # weights of one layer's projections: the unit of a step part's work
        self.runner = ModelRunner(
            self.model, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            dtype=mc.dtype, device=self.device, num_blocks=kv.num_blocks, block_size=bs,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens, graph_mode=graph_mode,
            step_parts=self._step_part_pool(config), key_weight=key_weight(mc.kv_size, per_layer),
            head_weight=head_weight(mc.vocab_size, mc.hidden_size, mc.num_layers, per_layer),
        )
        # Graphs are captured now: the KV cache exists and no real step has run.
        self.runner.capture_graphs(fall_back=config.cuda_graphs == "auto")
        self.sampler = Sampler(seed=config.seed, cpu_kernels=self.cpu_paths.sampling)
        self.overlap = Overlap(resolve_async_scheduling(config.async_scheduling, self.device))
        self.requests: dict[str, Request] = {}  # by request id; for n > 1 the group's choice 0
        self.groups: dict[str, SampleGroup] = {}  # the n > 1 requests, by request id
        self._token_texts = TokenTexts(self.tokenizer)  # token id -> its text alone (logprob records)
        self._finish_next: dict[Request, FinishReason] = {}  # aborts and refusals, ended at the next step
        # More failed steps in a row than a bisection of a full batch needs: the device is broken.
        self.faults = FaultIsolation(max_failures_in_a_row=3 + config.max_num_seqs.bit_length())
        self._convicted: list[RequestDelta] = []  # final deltas of failed requests, out after a step runs
        self._stats = EngineStats(kv_blocks_total=kv.num_blocks)
        self.metrics = EngineMetrics()
        self.constraints = Constraints(
            self.tokenizer, mc.vocab_size, self.eos_token_ids, timeout_s=config.structured_compile_timeout_s,
            threads=config.structured_compile_threads, max_rows=config.max_num_seqs, metrics=self.metrics,
        )
        log.info(
            "engine ready: model=%s device=%s dtype=%s kv_blocks=%d (block %d, %.2f GiB) max_model_len=%d "
            "cuda_graphs=%s async_scheduling=%s",
            self.served_model_name, self.device, mc.dtype, kv.num_blocks, bs,
            kv.num_blocks * kv.bytes_per_block / 1024**3, self.max_model_len, self.graph_mode,
            self.async_scheduling,
        )

    def _step_part_pool(self, config: EngineConfig) -> StepPartPool | None:
        """The threads a CPU step's parts run on (cpu/step_parts.py), or None for whole steps."""
        if self.device.type != "cpu" or self.cpu_threads is None:
            return None
        parts = default_parts(self.cpu_threads) if config.cpu_step_parts is None else config.cpu_step_parts
        parts = min(parts, self.cpu_threads)
        if parts < 2:
            return None
        share, extra = divmod(self.cpu_threads, parts)
        log.info("CPU steps run as %d parts of %d thread(s) where their work splits evenly", parts, share)
        return StepPartPool([share + (i < extra) for i in range(parts)])

    @property
    def graph_mode(self) -> str:
        """How decode steps run: "on" (CUDA graphs), "eager" (their padded path, no capture) or "off"."""
        return self.runner.graph_mode

    @property
    def async_scheduling(self) -> bool:
        """Steps overlap when no request needs its token history on the host."""
        return self.overlap.enabled

    # ------------------------------------------------------------------ requests in
    def count_prompt_tokens(self, request: EngineRequest) -> int:
        return len(self._encode(request))

    def _encode(self, request: EngineRequest) -> list[int]:
        from tokenmill.engine.tokenizer import encode_request

        ids = encode_request(
            self.tokenizer,
            prompt=request.prompt,
            messages=request.messages,
            prompt_token_ids=request.prompt_token_ids,
        )
        return [int(t) for t in ids]

    def add(self, request: EngineRequest) -> None:
        """Queue a request. Raises ValueError for a bad one; an over-long prompt finishes as ERROR.
        A `final_only` request gets no token deltas, only its final one (EngineRequest)."""
        from tokenmill.engine.detokenizer import IncrementalDetokenizer

        if request.request_id in self.requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}: it is still in the engine")
        params = request.sampling
        if params.n > 1:
            check_group_params(params)
        ids = self._encode(request)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if params.prompt_logprobs is not None and params.score_from >= len(ids):
            raise ValueError(
                f"score_from ({params.score_from}) must be less than the prompt's length ({len(ids)} tokens): "
                "nothing would be scored"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        final_only = request.final_only

        def make(r: EngineRequest) -> Request:
            detokenizer = IncrementalDetokenizer(self.tokenizer, ids, r.sampling.stop, deferred=final_only)
            return Request(r, ids, eos_token_ids=self.eos_token_ids, detokenizer=detokenizer, final_only=final_only)

        if params.n > 1:
            group = new_group(request, make)
            self.groups[request.request_id] = group
            for member in group.members:
                self.overlap.track(member)
            req = group.parent
        else:
            req = make(request)
            self.overlap.track(req)
        self.requests[req.request_id] = req
        self._stats.prompt_tokens_total += len(ids)
        if len(ids) > self.max_model_len:
            message = f"the prompt has {len(ids)} tokens, the engine allows at most {self.max_model_len}"
            req.set_error(ErrorKind.PROMPT_TOO_LONG, message)
            self._finish_next[req] = FinishReason.ERROR
            return
        if req.sampling.structured_outputs is not None:
            self.constraints.add(req)  # to the scheduler once its constraint has compiled
            return
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Finish the request with ABORTED at the next step (unknown or finished ids are ignored)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        group = self.groups.get(request_id)
        members = (req,) if group is None else (group.parent, *group.live_children())
        for member in members:  # a choice that ended already keeps its end
            if member.status is not RequestStatus.FINISHED:
                self._finish_next.setdefault(member, FinishReason.ABORTED)

    def has_work(self) -> bool:
        return self._has_runnable_work() or bool(self.constraints.num_waiting)

    def _has_runnable_work(self) -> bool:
        return bool(self._finish_next) or self.scheduler.has_work() or self.overlap.in_flight is not None

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestDelta]:
        """One step; returns the deltas it produced, in the order they came."""
        t_start = time.perf_counter()
        self._admit_constrained()
        now = time.time()
        deltas = self._end_queued(now)  # aborted, refused or not compiled since the last step
        try:
            passed = self._step(deltas, now, t_start)
        except StepFault as fault:
            self._recover(fault)
            passed = False
        idle = not self.has_work()
        if (passed or idle) and self._convicted:
            # A step ran, so the device works: the failures were the requests' own.
            deltas += self._convicted
            self._convicted = []
        if idle:
            self._release_idle()
        return deltas

    def _step(self, deltas: list[RequestDelta], now: float, t_start: float) -> bool:
        """Take in, schedule, launch, take in; appends the deltas to `deltas` as they come, so a
        phase that fails later loses none of them. True when it ran requests."""
        self.scheduler.only = self.faults.admissible()
        overlapped = self.overlap.active
        # A synchronous step first takes in the step the overlapped mode left in flight.
        drained = None if overlapped else self.overlap.drain()
        deltas.extend(self._take_in(drained))
        out = self.scheduler.schedule()  # a failure here has no request to blame: it propagates
        deltas.extend(self._ended(r, FinishReason.EXPIRED, now) for r in out.expired)
        with blame("launch", out.requests):
            launched = self._launch(out, overlapped)
        if overlapped:
            # This step runs while the previous one's tokens come in; only then are the blocks
            # that became full hashed (from real ids, no placeholders).
            previous = self.overlap.swap(launched)
            deltas.extend(self._take_in(previous))
            with blame("step end", out.requests):
                self._step_done(out)
            taken = (previous,)
        else:
            with blame("step end", out.requests):
                self._step_done(out)
            deltas.extend(self._take_in(launched))
            taken = (drained, launched)
        deltas.extend(self._end_scored(out, now))
        if self.faults.step_passed(out.requests):
            self.scheduler.preempt_all()  # a cleared probation group waits for the round's end
        model_s = sum(s.model_seconds() for s in taken if s is not None)
        if launched is None and not out.is_empty:
            model_s += self.runner.last_forward_s  # no row sampled: the forward alone
        self.metrics.record_step(out, time.perf_counter() - t_start, model_s)
        return not out.is_empty

    def _end_scored(self, out: SchedulerOutput, now: float) -> list[RequestDelta]:
        """End the score-only requests (max_tokens 0) whose prompt is now computed, with LENGTH:
        they sample no token (model_runner.py leaves them out of the sampling rows)."""
        if 0 not in map(_max_tokens, out.requests):  # in C: most steps have none
            return []
        done = [
            r for r in out.requests
            if r.sampling.max_tokens == 0 and r.status is RequestStatus.RUNNING
            and r.num_computed_tokens >= r.num_prompt_tokens
        ]
        if not done:
            return []
        self.scheduler.finish_many([(r, FinishReason.LENGTH) for r in done])
        return [self._ended(r, FinishReason.LENGTH, now) for r in done]

    def _recover(self, fault: StepFault) -> None:
        """A step failed: back to a consistent state, then end the requests the failure convicts
        (fault_isolation.py). Their final deltas wait for the next step that runs: should every
        step fail (a broken device), the engine stops before it has failed anyone, and their jobs
        go to another worker. Raises the step's error when no request is to blame, or then."""
        log.warning("engine step failed in %s for %d request(s); isolating the cause: %s",
                    fault.phase, len(fault.suspects), describe(fault.error), exc_info=fault.error)
        convicted = self.faults.on_fault(fault)
        self.overlap.drop(self._live_requests())
        self.scheduler.preempt_all()
        self.scheduler.finish_many([(req, FinishReason.ERROR) for req in convicted])
        now = time.time()
        self._convicted += [self._failed(req, fault.error, now) for req in convicted]

    def _live_requests(self) -> Iterable[Request]:
        """Every request in the engine, the forked choices of n > 1 requests included."""
        yield from self.requests.values()
        for group in self.groups.values():
            yield from group.live_children()

    def _failed(self, req: Request, error: Exception, now: float) -> RequestDelta:
        """The final delta of a request the engine failed on (ERROR, INTERNAL, the exception in
        `error`); the caller ends it in the scheduler."""
        req.set_error(ErrorKind.INTERNAL, f"the engine failed on this request: {describe(error)}")
        log.error("request %s failed: %s", req.request_id, req.error, exc_info=error)
        return self._ended(req, FinishReason.ERROR, now)

    def _release_idle(self) -> None:
        """Nothing left to run: an empty schedule names the last ended requests, and the runner
        frees their rows; the fault isolation forgets its suspects."""
        if self.scheduler.num_unreported:
            self.runner.execute(self.scheduler.schedule())
        self.faults.reset()

    def _admit_constrained(self) -> None:
        """Requests whose constraint compiled go to the scheduler; those whose constraint failed
        end at this step. With nothing else to run, wait a little for a compile first."""
        constraints = self.constraints
        if not constraints.num_waiting:
            return
        if not self._has_runnable_work():
            constraints.wait(COMPILE_WAIT_S)
        ready, failed = constraints.poll()
        for req in ready:
            self.scheduler.add(req)
        for req, reason in failed:
            req.set_error(ErrorKind.INVALID_CONSTRAINT, reason)
            self._finish_next.setdefault(req, FinishReason.ERROR)
            self.metrics.constraint_failures += 1

    def _end_queued(self, now: float) -> list[RequestDelta]:
        """End the requests aborted or refused since the last step."""
        if not self._finish_next:
            return []
        queued, self._finish_next = list(self._finish_next.items()), {}
        self.scheduler.finish_many(queued)
        return [self._ended(req, reason, now) for req, reason in queued]

    def _launch(self, out: SchedulerOutput, overlapped: bool) -> LaunchedStep | None:
        """Forward + sampling of a scheduled step; None when nothing ran or no row samples."""
        runner = self.runner
        # Constrained rows get their masks filled on other threads while the forward runs.
        token_mask = None if overlapped else self.constraints.start_step(out)
        # Without a fork to feed (choices of an n > 1 request waiting for their parent's first
        # sample), plain greedy rows need their argmax only (GreedyIds); constrained ones too, their
        # mask applied to the greedy screen.
        argmax_ok = not any(group.unforked for group in self.groups.values())
        logits, step_in = runner.execute(out, self.overlap.pending if overlapped else None, argmax_ok, token_mask)
        if step_in is None:
            return None
        self.metrics.record_kv_use(step_in, self.block_manager.num_used_blocks)
        if logits is None:
            return None
        if self.groups:  # choices waiting for their parent's first sample fork now
            logits = fork_choices(step_in, logits, self.scheduler, self.block_manager, self.runner,
                                  self.config.max_num_seqs, self.constraints, token_mask)
        return launch_sampling(
            self.sampler, logits, step_in.sample_requests, forward_start=runner.forward_start,
            forward_s=runner.last_forward_s, overlapped=overlapped, token_mask=token_mask,
        )

    def _step_done(self, out: SchedulerOutput) -> None:
        """The step's forward ran: its tokens are computed."""
        if not out.is_empty:
            self.scheduler.on_step_done(out)
            self._stats.steps += 1

    def _take_in(self, launched: LaunchedStep | None) -> list[RequestDelta]:
        """Put a launched step's tokens into their requests, apply the stop rule, end the requests
        it finishes; returns the deltas. Rows of requests that ended before their token came in
        (overlapped steps) are discarded; a row whose take-in raises fails its own request."""
        if launched is None:
            return []
        with blame("take-in", launched.requests):
            sampled = launched.host_tokens()
        now = time.time()
        deltas: list[RequestDelta] = []
        ended: list[tuple[Request, FinishReason]] = []
        taken = 0
        overlapped = launched.overlapped
        for req, s in zip(launched.requests, sampled, strict=True):
            if req.status is RequestStatus.FINISHED:
                continue  # finished (or aborted) before this token: computed for nothing
            tok = s.token_id
            try:
                reason, text, logprobs = self._take_token(req, s, overlapped, now)
            except Exception as exc:  # this request's own failure: it alone ends
                ended.append((req, FinishReason.ERROR))
                deltas.append(self._failed(req, exc, now))
                continue
            taken += 1
            if reason is None:
                if not req.final_only:
                    deltas.append(token_delta(req, tok, text, logprobs))
            else:
                ended.append((req, reason))
                deltas.append(self._ended(req, reason, now, [tok], text, logprobs))
        self._stats.generated_tokens_total += taken
        if ended:
            self.scheduler.finish_many(ended)
        return deltas

    def _take_token(
        self, req: Request, s: SampledToken, pending: bool, now: float
    ) -> tuple[FinishReason | None, str, list[TokenLogprob] | None]:
        """One row's token into its request: append it (or resolve its placeholder), detokenize,
        apply the stop rule, record its logprobs; returns (finish reason or None, text, logprobs)."""
        tok = s.token_id
        if pending:
            req.resolve_pending(tok, now)
        else:
            req.append_output(tok, now)
        if req.matcher is not None:
            self.constraints.accept(req, tok)
        params = req.sampling
        n_out = len(req.output_token_ids)
        stop_token = is_stop_token(tok, n_out, params, self._eos)
        if stop_token:
            text, stop_string = "", False  # the stop token adds no text
        else:
            text, stop_string = req.detokenizer.add(tok, check_stop=stop_strings_count(n_out, params))
        reason = check_stop(
            n_out, req.num_prompt_tokens, params, self.max_model_len, stop_token=stop_token, stop_string=stop_string
        )
        if req.matcher is not None and reason is not FinishReason.STOP and self.constraints.finished(req):
            reason = FinishReason.STOP  # the grammar is complete: nothing more may follow
        logprobs = None
        if params.logprobs is not None:
            logprobs = token_logprobs(tok, s, self._token_text)
            req.add_logprobs(logprobs)
        if reason is not None:
            text += req.detokenizer.flush()  # held-back text (nothing after a stop string)
        return reason, text, logprobs

    def _ended(
        self, req: Request, reason: FinishReason, now: float, new_ids: list[int] | None = None, text: str = "",
        logprobs: list[TokenLogprob] | None = None,
    ) -> RequestDelta:
        """The engine's part of a request's end: forget it, count it, build its final delta (for a
        choice of an n > 1 request: the group's delta, see SampleGroup.record)."""
        self.overlap.forget(req)
        self.constraints.forget(req)
        self.faults.forget(req)
        delta = final_delta(req, reason, now, new_ids, text, logprobs)
        for record in delta.prompt_logprobs or ():  # the records' token texts, for the Result
            record.token = self._token_text(record.token_id)
            record.top_tokens = [self._token_text(i) for i, _ in record.top_logprobs]
        group = req.group
        if group is None:
            self.requests.pop(req.request_id, None)
            self._stats.cached_prompt_tokens_total += req.num_cached_prompt_tokens
            return delta
        if req.choice == 0:
            self._stats.cached_prompt_tokens_total += req.num_cached_prompt_tokens
            for child in end_unforked(group, req, reason):  # they never ran: they end alike
                self.overlap.forget(child)
                group.record(child.choice, final_delta(child, reason, now))
        out = group.record(req.choice, delta)
        if group.done:
            self.requests.pop(req.request_id, None)
            del self.groups[req.request_id]
        return out

    def _token_text(self, token_id: int) -> str:
        return self._token_texts.text(token_id)

    # ------------------------------------------------------------------ stats
    def held_state(self) -> dict[str, int]:
        """What the engine holds for requests, as counts; all 0 when it is idle (every request
        ended and its end named in a step): a leak shows here."""
        return {
            "requests": len(self.requests),
            "sample_groups": len(self.groups),
            "queued_ends": len(self._finish_next),
            "compiling": self.constraints.num_waiting,
            "constrained": len(self.constraints.active),
            "waiting": self.scheduler.num_waiting,
            "running": self.scheduler.num_running,
            "unreported_ends": self.scheduler.num_unreported,
            "steps_in_flight": int(self.overlap.in_flight is not None),
            "host_history": len(self.overlap.needs_host_history),
            "runner_rows": self.runner.num_rows_in_use,
            "kv_blocks": self.block_manager.num_used_blocks,
            "suspects": self.faults.num_tracked,
            "failures_held": len(self._convicted),
        }

    def stats(self, drain_observations: bool = False) -> EngineStats:
        """A snapshot; with `drain_observations` it also carries (and forgets) the structured-output
        timings observed since the last drain (EngineMetrics.drain_structured)."""
        s = self._stats
        compile_s, mask_s = self.metrics.drain_structured() if drain_observations else ([], [])
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_used=self.block_manager.num_used_blocks,
            prompt_tokens_total=s.prompt_tokens_total,
            cached_prompt_tokens_total=s.cached_prompt_tokens_total,
            generated_tokens_total=s.generated_tokens_total,
            steps=s.steps,
            compile_s=compile_s,
            mask_s=mask_s,
        )

    # ------------------------------------------------------------------ blocking helper
    def generate(self, requests: Iterable[EngineRequest], progress: bool = False) -> dict[str, RequestDelta]:
        """Run requests to completion; returns each request's final delta by request_id."""
        requests = list(requests)
        for r in requests:
            self.add(replace(r, final_only=True))  # only the final deltas are returned
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
