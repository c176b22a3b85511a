"""VllmEngine: vLLM V1's LLMEngine behind tokenmill's engine interface (add, abort, step -> deltas).

The engine core runs in this process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless
the environment says otherwise): the caller's step is vLLM's step, as with tokenmill's own engine,
and on a GPU the model's tensor-parallel workers are vLLM's own processes either way. With the
variable set to 1 the core runs in a child process of vLLM's.

What the adapter keeps itself, because vLLM does not:
- Requests refused before they reach vLLM (a field it cannot honour, requests.py; a prompt longer
  than the model allows; a constraint vLLM's guidance backend does not compile) end at the next
  step with an error delta, as on tokenmill's own engine: ``invalid_job`` (add raises ValueError),
  ``prompt_too_long`` and ``invalid_constraint``.
- Aborts: vLLM gives an aborted request no final output, so abort() ends it at the next step with
  what it had produced, as ABORTED.
- Deadlines: a request whose deadline passes before vLLM has given anything for it is aborted in
  vLLM and ends EXPIRED (tokenmill's own engine expires requests not yet scheduled).
- A request vLLM forgot (none of its outputs finished it, and vLLM holds nothing) ends with an
  internal error instead of leaving its caller waiting.
- Steps run under a watchdog (watchdog.py): vLLM's EngineDeadError, a dead core or a step that does
  not return raises EngineDied, which ends the worker.

Statistics (running, waiting, KV use, tokens generated, prefill computed) come from vLLM's own step
statistics through a stat logger of ours; prompt and cached-prompt token totals from the requests.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill.engine.backends.errors import EngineDied
from tokenmill.engine.backends.vllm.outputs import Tracked
from tokenmill.engine.backends.vllm.requests import Capabilities, refusals, vllm_prompt, vllm_sampling
from tokenmill.engine.backends.vllm.settings import engine_args_kwargs
from tokenmill.engine.backends.vllm.watchdog import StepWatchdog
from tokenmill.engine.config import CPU_DEFAULT_KV_GB, EngineConfig
from tokenmill.engine.metrics import EngineMetrics
from tokenmill.engine.types import EngineRequest, EngineStats, ErrorKind, FinishReason, RequestDelta

log = logging.getLogger(__name__)

# A step that has not returned in this long is taken for a stuck core (a GPU step takes milliseconds to
# a few seconds; the first ones of a new shape may compile).
STEP_TIMEOUT_S = 600.0
# After a step is given up, the longest the process may take to exit by itself.
EXIT_GRACE_S = 60.0

# vLLM's own defaults for running inside a worker, unless the environment sets them: the core in this
# process, no usage report to vLLM's servers, and its log at WARNING (VLLM_LOGGING_LEVEL=INFO shows
# its start-up report: the model, the KV cache size, the attention backend).
ENVIRONMENT_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


@dataclass
class StepStats:
    """What vLLM's stat loggers report after each step, kept for stats() (a stat logger of ours)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    generated_tokens: int = 0
    prefill_tokens_computed: int = 0
    preemptions: int = 0
    peak_running: int = 0
    steps: int = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.kv_usage = scheduler_stats.kv_cache_usage
            self.peak_running = max(self.peak_running, self.running)
        if iteration_stats is not None:
            self.steps += 1
            self.generated_tokens += iteration_stats.num_generation_tokens
            self.prefill_tokens_computed += iteration_stats.prompt_token_stats.computed
            self.preemptions += iteration_stats.num_preempted_reqs

    def logger_factory(self):
        """A factory vLLM's StatLoggerManager calls once per engine core."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Reader(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
                stats.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return Reader


def prepare_environment() -> None:
    for name, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)


def build_engine_args(kwargs: dict[str, Any]):
    """vLLM's EngineArgs from keyword arguments: an unknown key is named (with the nearest ones), and a
    dict given for one of vLLM's config objects (structured_outputs_config=...) becomes that object."""
    import dataclasses
    import difflib

    from vllm import EngineArgs

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        hints = [f"{k} (did you mean {', '.join(close)}?)" if (close := difflib.get_close_matches(k, fields, 3)) else k
                 for k in unknown]
        raise ValueError(f"vLLM has no engine argument {', '.join(hints)} (--vllm-arg)")
    given = dict(kwargs)
    for key, value in kwargs.items():
        default = fields[key].default
        if default is dataclasses.MISSING and fields[key].default_factory is not dataclasses.MISSING:
            default = fields[key].default_factory()
        if isinstance(value, dict) and default is not None and not isinstance(default, dict) \
                and hasattr(type(default), "__dataclass_fields__"):
            given[key] = type(default)(**value)
    return EngineArgs(**given)


class VllmEngine:
    """See the module's docstring. One per process at a time: vLLM keeps its distributed state (the
    model-parallel groups) in module globals, which an engine's shutdown tears down; so a new engine
    first closes the one before it, if that is still open (run one after the other, as bench does)."""

    backend = "vllm"
    _live: weakref.ref | None = None  # the engine of this process that vLLM's globals belong to

    def __init__(self, config: EngineConfig, *, step_timeout_s: float = STEP_TIMEOUT_S,
                 exit_grace_s: float | None = EXIT_GRACE_S) -> None:
        if config.backend != "vllm":
            raise ValueError(f"VllmEngine runs backend vllm, the config says {config.backend!r}")
        self.config = config
        prepare_environment()
        from tokenmill.engine.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(config.model)
        # vLLM computes on the watchdog's thread only, its construction included (watchdog.py says why).
        self.watchdog = StepWatchdog(step_timeout_s, exit_grace_s=exit_grace_s)
        self.cpu_threads: int | None = None
        self.llm, self.vllm_config = self.watchdog.run(lambda: self._start_vllm(config), limit_s=None)
        vllm_config = self.vllm_config
        self.max_model_len: int = vllm_config.model_config.max_model_len
        self.served_model_name = config.served_model_name or Path(str(config.model).rstrip("/")).name
        so = vllm_config.structured_outputs_config
        self.capabilities = Capabilities(
            whitespace="compact" if so.disable_any_whitespace else "flexible",
            priority_scheduling=vllm_config.scheduler_config.policy == "priority",
            max_logprobs=vllm_config.model_config.max_logprobs,
        )
        self.kv_blocks_total = int(vllm_config.cache_config.num_gpu_blocks or 0)
        resources = getattr(self.llm.engine_core, "resources", None)  # a core in a child process
        self.watchdog.is_dead = lambda: bool(resources is not None and resources.engine_dead)
        self._metrics = EngineMetrics()
        self._metrics_from = replace(self.step_stats)
        self._tracked: dict[str, Tracked] = {}  # in vLLM, by request id
        self._ended: list[RequestDelta] = []  # final deltas decided outside vLLM, out at the next step
        self._token_texts: dict[int, str] = {}
        self._prompt_tokens_total = 0
        self._cached_prompt_tokens_total = 0
        log.info("vLLM engine ready: model=%s max_model_len=%d kv_blocks=%d in_process=%s", self.served_model_name,
                 self.max_model_len, self.kv_blocks_total, resources is None)

    def _start_vllm(self, config: EngineConfig):
        """(LLMEngine, VllmConfig), made on the watchdog's thread."""
        from vllm.platforms import current_platform
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        on_cpu = current_platform.is_cpu()
        if on_cpu:  # in this process vLLM keeps torch's thread count as it finds it
            from tokenmill.engine.cpu.threads import apply_cpu_threads

            self.cpu_threads, why = apply_cpu_threads(config.cpu_threads)
            log.info("vLLM on the CPU computes with %d thread(s): %s", self.cpu_threads, why)
            if config.cpu_threads is not None:
                os.environ.setdefault("OMP_NUM_THREADS", str(config.cpu_threads))  # a core in a child process
        kwargs = engine_args_kwargs(config, on_cpu=on_cpu, cpu_default_kv_gb=CPU_DEFAULT_KV_GB)
        try:
            vllm_config = build_engine_args(kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT)
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise ValueError(f"vLLM refused the engine arguments: {exc}") from exc
        previous = VllmEngine._live() if VllmEngine._live is not None else None
        if previous is not None and previous is not self:
            log.warning("closing the previous vLLM engine of this process first (vLLM runs one at a time)")
            previous.close()
        self.step_stats = StepStats()
        llm = LLMEngine.from_vllm_config(vllm_config, stat_loggers=[self.step_stats.logger_factory()])
        VllmEngine._live = weakref.ref(self)
        atexit.register(_close_live_engine)  # once: atexit keeps one entry per function
        _first_step(llm)
        return llm, vllm_config

    # ------------------------------------------------------------------ requests in
    def count_prompt_tokens(self, request: EngineRequest) -> int:
        return len(self._encode(request))

    def _encode(self, request: EngineRequest) -> list[int]:
        from tokenmill.engine.tokenizer import encode_request

        return encode_request(self.tokenizer, prompt=request.prompt, messages=request.messages,
                              prompt_token_ids=request.prompt_token_ids)

    def add(self, request: EngineRequest) -> None:
        """Queue a request. ValueError for one the backend refuses (each field it cannot honour is
        named); a prompt too long or a constraint that does not compile ends it at the next step."""
        rid = request.request_id
        if rid in self._tracked or any(d.request_id == rid for d in self._ended):
            raise ValueError(f"duplicate request_id {rid!r}: it is still in the engine")
        ids = self._encode(request)
        params = request.sampling
        if params.prompt_logprobs is not None and params.score_from >= len(ids):
            raise ValueError(
                f"score_from ({params.score_from}) must be less than the prompt's length ({len(ids)} tokens): "
                "nothing would be scored"
            )
        refused = refusals(request, self.capabilities)
        if refused:
            raise ValueError("; ".join(refused))
        now = time.time()
        tracked = Tracked(request, ids, emit_tokens=not request.final_only, added_at=now)
        self._prompt_tokens_total += len(ids)
        if len(ids) > self.max_model_len:
            message = f"the prompt has {len(ids)} tokens, the engine allows at most {self.max_model_len}"
            self._ended.append(tracked.final(FinishReason.ERROR, now, error_kind=ErrorKind.PROMPT_TOO_LONG,
                                             error=message))
            return
        # A request with a deadline is watched step by step (has it started?) even when its caller
        # reads only the end.
        every_token = not request.final_only or request.deadline_ms is not None
        sampling = vllm_sampling(params, every_token=every_token)
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            self.llm.add_request(rid, vllm_prompt(ids, request.tenant), sampling, arrival_time=request.arrival_time,
                                 priority=request.priority)
        except EngineDeadError as exc:
            raise EngineDied(f"vLLM's engine core is dead: {exc}") from exc
        except VLLMValidationError as exc:
            if params.structured_outputs is not None and _about_the_constraint(exc):
                self._ended.append(tracked.final(FinishReason.ERROR, now, error_kind=ErrorKind.INVALID_CONSTRAINT,
                                                 error=f"the structured_outputs constraint does not compile: {exc}"))
                return
            raise ValueError(f"refused by the vllm backend: {exc}") from exc
        self._tracked[rid] = tracked

    def abort(self, request_id: str) -> None:
        """End the request with ABORTED at the next step, with what it produced so far."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.llm.abort_request([request_id])
        self._ended.append(tracked.final(FinishReason.ABORTED, time.time()))

    def has_work(self) -> bool:
        return bool(self._ended) or bool(self._tracked)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestDelta]:
        """One vLLM step (when it holds requests); the deltas it gave, after those of requests ended
        outside vLLM since the last step. EngineDied when the engine cannot go on."""
        now = time.time()
        deltas, self._ended = self._ended, []
        deltas += self._expire(now)
        if not self._tracked:
            return deltas
        try:
            outputs = self.watchdog.run(self.llm.step)
        except EngineDied:
            raise
        except Exception as exc:
            from vllm.v1.engine.exceptions import EngineDeadError

            if isinstance(exc, EngineDeadError):
                raise EngineDied(f"vLLM's engine core is dead: {exc}") from exc
            raise
        now = time.time()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue  # aborted since: its end was given already
            for delta in tracked.take(output, now, self._token_text):
                if delta.finished:
                    self._finished(tracked)
                deltas.append(delta)
        if self._tracked and not self.llm.has_unfinished_requests():
            deltas += self._forgotten(now)
        return deltas

    def _expire(self, now: float) -> list[RequestDelta]:
        """End the requests whose deadline passed before vLLM gave anything for them."""
        late = [t for t in self._tracked.values()
                if t.request.deadline_ms is not None and not t.started and now * 1000.0 > t.request.deadline_ms]
        if not late:
            return []
        self.llm.abort_request([t.request_id for t in late])
        for t in late:
            del self._tracked[t.request_id]
        return [t.final(FinishReason.EXPIRED, now) for t in late]

    def _forgotten(self, now: float) -> list[RequestDelta]:
        """Requests vLLM no longer holds but never finished: they end with an internal error."""
        lost, self._tracked = list(self._tracked.values()), {}
        log.error("vLLM holds none of %d request(s) it never finished", len(lost))
        return [t.final(FinishReason.ERROR, now, error="vLLM dropped the request without finishing it") for t in lost]

    def _finished(self, tracked: Tracked) -> None:
        del self._tracked[tracked.request_id]
        self._cached_prompt_tokens_total += tracked.cached_tokens

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    # ------------------------------------------------------------------ stats
    @property
    def metrics(self) -> EngineMetrics:
        """The benchmark counters vLLM's statistics give (prefill computed, preemptions, peak running),
        counted since the metrics were last replaced (a bench replaces them after its warm-up)."""
        s, base, m = self.step_stats, self._metrics_from, self._metrics
        m.prompt_tokens_computed = s.prefill_tokens_computed - base.prefill_tokens_computed
        m.num_preemptions = s.preemptions - base.preemptions
        m.peak_running = s.peak_running
        return m

    @metrics.setter
    def metrics(self, value: EngineMetrics) -> None:
        self._metrics = value
        self.step_stats.peak_running = 0
        self._metrics_from = replace(self.step_stats)

    def stats(self, drain_observations: bool = False) -> EngineStats:
        s = self.step_stats
        return EngineStats(
            running=s.running,
            waiting=s.waiting,
            kv_blocks_total=self.kv_blocks_total,
            kv_blocks_used=round(s.kv_usage * self.kv_blocks_total),
            prompt_tokens_total=self._prompt_tokens_total,
            cached_prompt_tokens_total=self._cached_prompt_tokens_total,
            generated_tokens_total=s.generated_tokens,
            steps=s.steps,
        )

    @property
    def request_ids(self) -> list[str]:
        """The requests in the engine, by id (diagnostics and tests)."""
        return list(self._tracked)

    def held_state(self) -> dict[str, int]:
        """What the adapter and vLLM hold for requests; all 0 when idle (a leak shows here)."""
        return {
            "requests": len(self._tracked),
            "queued_ends": len(self._ended),
            "vllm_unfinished": self.llm.get_num_unfinished_requests(),
        }

    # ------------------------------------------------------------------ blocking helper
    def generate(self, requests: Iterable[EngineRequest], progress: bool = False) -> dict[str, RequestDelta]:
        """Run requests to completion; each request's final delta by request_id."""
        requests = list(requests)
        for r in requests:
            self.add(replace(r, final_only=True))
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

    def __del__(self) -> None:
        # vLLM's own finalizer would shut the engine down on whichever thread collects it; its CPU
        # worker must be shut down on the thread it was made on, or the process aborts at exit.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at collection time
            pass

    def close(self) -> None:
        """Shut vLLM's engine down now (its weights, its KV cache, vLLM's distributed state), on the
        thread that made it, and end that thread; the engine takes nothing after. Idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        watchdog = getattr(self, "watchdog", None)
        if llm is not None and watchdog is not None:
            try:
                if watchdog.on_its_thread:
                    llm.engine_core.shutdown()
                else:
                    watchdog.run(llm.engine_core.shutdown, limit_s=60.0)
            except Exception:  # noqa: BLE001 - a core that died has nothing left to shut down
                log.warning("vLLM's shutdown failed", exc_info=True)
        if watchdog is not None:
            watchdog.close()


def _close_live_engine() -> None:
    """At exit, shut the process's vLLM engine down while the interpreter still runs: left to the
    interpreter's teardown, vLLM's distributed state (torch.distributed's gloo threads) dies with
    "terminate called without an active exception" and the process exits 134, whatever it did."""
    engine = VllmEngine._live() if VllmEngine._live is not None else None
    if engine is not None:
        engine.close()


def _first_step(llm: Any) -> None:
    """One token of a two-token prompt, at start: a model vLLM loads but cannot run here (vLLM's CPU
    attention refuses head sizes under 32, say) fails the start, not the first job, which would
    count it a crash attempt."""
    from vllm import SamplingParams

    try:
        llm.add_request("tokenmill-first-step", {"prompt_token_ids": [0, 0]}, SamplingParams(max_tokens=1))
        while llm.has_unfinished_requests():
            llm.step()
    except Exception as exc:
        raise RuntimeError(f"vLLM loaded the model but cannot run a step with it here: {exc}") from exc


def _about_the_constraint(exc: Exception) -> bool:
    """A VLLMValidationError that says the request's constraint does not compile (vLLM's guidance
    backend: "Grammar error: ...", "Invalid grammar specification: ...", or one naming the parameter)."""
    text = str(exc)
    return getattr(exc, "parameter", None) == "structured_outputs" or "rammar" in text or "schema" in text.lower()
