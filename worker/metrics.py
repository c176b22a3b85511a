"""Prometheus metrics and the worker's HTTP endpoints: /metrics, /healthz, /readyz.

Each worker has its own CollectorRegistry (tests run several in one process). The HTTP server
runs in a daemon thread so a busy event loop never makes a probe time out; /healthz checks that
the event loop has ticked recently, /readyz that the model is loaded, the group joined and a broker
reachable (an outage makes the worker not ready, never unhealthy: it keeps its engine and waits).
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tokenmill.engine.types import EngineStats, Timing

_LATENCY_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)
_TPOT_BUCKETS_MS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 250, 500, 1000, 2500)
_CONSTRAINT_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.jobs_in = Counter("tokenmill_jobs_in", "Input records fetched", registry=r)
        self.jobs_ok = Counter("tokenmill_jobs_ok", "Jobs answered with status ok", registry=r)
        self.jobs_error = Counter("tokenmill_jobs_error", "Jobs answered with status error", ["code"], registry=r)
        self.jobs_dead_lettered = Counter(
            "tokenmill_jobs_dead_lettered", "Inputs written to the dead-letter topic", ["code"], registry=r
        )
        self.jobs_expired = Counter("tokenmill_jobs_expired", "Jobs answered with status expired", registry=r)
        self.output_tokens = Counter("tokenmill_output_tokens", "Generated tokens", registry=r)
        self.output_tokens_per_s = Gauge(
            "tokenmill_output_tokens_per_second", "Generated tokens per second (recent)", registry=r
        )
        self.running = Gauge("tokenmill_engine_running", "Requests running in the engine", registry=r)
        self.waiting = Gauge("tokenmill_engine_waiting", "Requests waiting in the engine", registry=r)
        self.kv_usage = Gauge("tokenmill_kv_cache_usage", "Fraction of KV cache blocks in use", registry=r)
        self.prefix_hit_rate = Gauge(
            "tokenmill_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens", registry=r
        )
        self.ttft = Histogram(
            "tokenmill_ttft_ms", "Time to first token (ms)", buckets=_LATENCY_BUCKETS_MS, registry=r
        )
        self.tpot = Histogram(
            "tokenmill_tpot_ms", "Time per output token after the first (ms)", buckets=_TPOT_BUCKETS_MS, registry=r
        )
        self.commit_lag = Gauge(
            "tokenmill_commit_lag",
            "Records between the committed offset and the fetch position, per partition",
            ["topic", "partition"],
            registry=r,
        )
        self.oldest_job_age = Gauge(
            "tokenmill_oldest_unfinished_job_age_seconds",
            "Age (now minus the record's timestamp) of the oldest input record this worker has taken and not yet "
            "answered, per partition; 0 when every record taken is answered",
            ["topic", "partition"],
            registry=r,
        )
        self.paused = Gauge("tokenmill_fetch_paused", "1 while fetching is paused by backpressure", registry=r)
        self.broker_reachable = Gauge(
            "tokenmill_broker_reachable", "1 while a broker answers the worker's probe, 0 during an outage", registry=r
        )
        self.broker_reachable.set(1)
        self.partitions_assigned = Gauge(
            "tokenmill_partitions_assigned", "Partitions of the jobs topic assigned to this worker", registry=r
        )
        self.partitions_paused = Gauge(
            "tokenmill_partitions_paused", "Assigned partitions whose fetching is paused now", registry=r
        )
        self.uncommitted = Gauge(
            "tokenmill_uncommitted_offsets",
            "Offsets fetched and not yet committed, all partitions: what another worker would read again "
            "if this one died now",
            registry=r,
        )
        # Output sizes (worker/kafka/sizing.py) and records the broker refused for good (publisher.py).
        self.records_cut = Counter(
            "tokenmill_records_cut", "Answers cut down to fit their topic's max.message.bytes", ["how"], registry=r
        )
        self.token_events_dropped = Counter(
            "tokenmill_token_events_dropped", "TokenEvents left out of the stream (too large, or refused for good)",
            ["reason"], registry=r,
        )
        self.publish_refused = Counter(
            "tokenmill_publish_refused", "Sends the broker refused for good", ["reason"], registry=r
        )
        self.jobs_held = Gauge(
            "tokenmill_jobs_held", "Jobs fetched and waiting in the worker for a place in the engine", registry=r
        )
        # Structured output (constraint failures are counted in jobs_error{code="invalid_constraint"}).
        self.constraint_compile = Histogram(
            "tokenmill_constraint_compile_seconds", "Compile time of each structured_outputs constraint "
            "(cache hits are not compiles)", buckets=_CONSTRAINT_BUCKETS_S, registry=r,
        )
        self.constraint_mask = Histogram(
            "tokenmill_constraint_mask_seconds", "Token-mask fill + apply time of each step with constrained rows",
            buckets=_CONSTRAINT_BUCKETS_S, registry=r,
        )
        # What a rebalance (or a stop) costs: engine time with nothing to do, and work thrown away.
        self.engine_idle = Counter(
            "tokenmill_engine_idle_seconds", "Seconds the engine had no request, running or waiting", registry=r
        )
        self.discarded_tokens = Counter(
            "tokenmill_discarded_tokens",
            "Tokens computed (prompt tokens prefilled and output tokens) for jobs whose work was thrown away: "
            "aborted in the engine, or finished with an answer that was dropped; by the job's input partition "
            "and why (rebalance, stopping, lost, answer_dropped)",
            ["partition", "reason"], registry=r,
        )
        self.jobs_discarded = Counter(
            "tokenmill_jobs_discarded", "Jobs whose work in the engine was thrown away (see tokenmill_discarded_tokens)",
            ["partition", "reason"], registry=r,
        )
        self._idle_at: float | None = None  # when the engine was last seen idle (None: it was busy)
        self._tok_window: list[tuple[float, int]] = []

    def count_cuts(self, records) -> None:
        """Count the records of one answer that were cut down to fit (their `cut` says how)."""
        for rec in records:
            if rec.cut:
                self.records_cut.labels(rec.cut).inc()

    def count_answer(self, outcome: str, code: str | None) -> None:
        """Count one answered input: ok, expired, or an error that was dead-lettered as well."""
        if outcome == "ok":
            self.jobs_ok.inc()
        elif outcome == "expired":
            self.jobs_expired.inc()
        else:  # dead_letter (bad input) or error (the engine's): both are dead-lettered errors
            self.jobs_dead_lettered.labels(code or "internal").inc()
            self.jobs_error.labels(code or "internal").inc()

    def count_discarded(self, partition: int, reason: str, tokens: int) -> None:
        """One job's work thrown away: `tokens` computed for it (see tokenmill_discarded_tokens)."""
        self.jobs_discarded.labels(str(partition), reason).inc()
        self.discarded_tokens.labels(str(partition), reason).inc(max(0, tokens))

    def observe_engine(self, stats: EngineStats, now: float | None = None) -> None:
        # The engine thread reports after every step and every 0.25 s while idle, so an idle spell
        # is counted from the report that found no request to the one after work came back (one
        # step too long at most).
        now = time.monotonic() if now is None else now
        if self._idle_at is not None:
            self.engine_idle.inc(max(0.0, now - self._idle_at))
        self._idle_at = now if stats.running + stats.waiting == 0 else None
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)
        for seconds in stats.compile_s:
            self.constraint_compile.observe(seconds)
        for seconds in stats.mask_s:
            self.constraint_mask.observe(seconds)

    def observe_latency(self, timing: Timing, output_tokens: int) -> None:
        """Time to first token, and time per output token after the first, of one ok job."""
        self.ttft.observe(timing.ttft_ms)
        if output_tokens > 1:
            self.tpot.observe(timing.decode_ms / (output_tokens - 1))

    def observe_tokens(self, n: int, now: float | None = None) -> None:
        """Count generated tokens and keep a 10-second rate."""
        now = time.monotonic() if now is None else now
        if n:
            self.output_tokens.inc(n)
            self._tok_window.append((now, n))
        while self._tok_window and self._tok_window[0][0] < now - 10.0:
            self._tok_window.pop(0)
        if self._tok_window:
            span = max(now - self._tok_window[0][0], 1.0)
            self.output_tokens_per_s.set(sum(k for _, k in self._tok_window) / span)
        else:
            self.output_tokens_per_s.set(0.0)


class HealthState:
    """What the probes report; written from the event loop, read from the HTTP thread."""

    def __init__(self, stall_after_s: float = 30.0) -> None:
        self.model_loaded = False
        self.group_joined = False
        self.joining_since: float | None = None  # monotonic time the consumer subscribed, until it joined
        self.draining = False
        self.broker_reachable = True  # False while the broker watch's probe fails (broker_watch.py)
        self.stall_after_s = stall_after_s
        self._last_tick = time.monotonic()

    def tick(self) -> None:
        self._last_tick = time.monotonic()

    def healthy(self) -> tuple[bool, str]:
        age = time.monotonic() - self._last_tick
        if age > self.stall_after_s:
            return False, f"event loop has not ticked for {age:.0f}s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if not self.model_loaded:
            return False, "model not loaded"
        if not self.group_joined:
            if self.joining_since is not None:
                return False, f"joining the consumer group ({time.monotonic() - self.joining_since:.0f}s)"
            return False, "consumer group not joined"
        if self.draining:
            return False, "draining"
        if not self.broker_reachable:
            return False, "no broker reachable"
        return True, "ok"


class MetricsServer:
    """Serves /metrics, /healthz and /readyz from a daemon thread."""

    def __init__(self, metrics: WorkerMetrics, health: HealthState, host: str = "0.0.0.0", port: int = 0):
        registry = metrics.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, status, ctype = generate_latest(registry), 200, CONTENT_TYPE_LATEST
                elif path in ("/healthz", "/readyz"):
                    ok, why = health.healthy() if path == "/healthz" else health.ready()
                    body, status, ctype = (why + "\n").encode(), 200 if ok else 503, "text/plain"
                else:
                    body, status, ctype = b"not found\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # probes every few seconds would flood the log
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
