"""Settings of one `tokenmill worker` process (filled from flags / TOKENMILL_* variables).

The engine's settings are the engine's own EngineConfig (worker/engine/config.py, torch-free),
embedded, not copied."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from tokenmill.engine.config import EngineConfig
from tokenmill.kafka.backpressure import BackpressurePolicy
from tokenmill.kafka.registry import RegistrySettings
from tokenmill.kafka.security import KafkaSecurity


@dataclass
class WorkerSettings:
    bootstrap_servers: str
    engine: EngineConfig
    group_id: str = "tokenmill"
    jobs_topic: str = "tokenmill.jobs"
    results_topic: str = "tokenmill.results"
    tokens_topic: str = "tokenmill.tokens"
    dlq_topic: str = "tokenmill.dlq"
    exactly_once: bool = False
    instance_id: str | None = None  # static group membership (group.instance.id)
    worker_name: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    drain_timeout_s: float = 30.0
    # How long a revoked partition's in-flight jobs may finish before its commit; 0: the work is
    # kept until the new assignment (rebalance.py), so waiting would only hold the group up.
    revoke_grace_s: float = 0.0
    commit_interval_s: float = 1.0
    # How long a broker may be away at start (and for a call an assignment cannot do without)
    # before the worker gives up; an outage while running is waited out for as long as it lasts.
    broker_wait_timeout_s: float = 300.0
    metrics_port: int | None = None  # None = no HTTP server; 0 = any free port
    metrics_host: str = "0.0.0.0"
    max_inflight_per_partition: int = 1024
    max_inflight_per_tenant: int = 0  # 0 = no cap
    # Jobs handed to the engine at once (running or waiting there); the rest wait in the worker
    # and are handed over round-robin across tenants (kafka/tenants.py). None = 2 x max_num_seqs,
    # 0 = no bound (every job goes to the engine when fetched).
    max_engine_jobs: int | None = None
    # A job in the engine each time a worker died this many times is dead-lettered (crashed_worker)
    # instead of run again; 0 = off (no counting, no write-ahead commit before a start).
    max_crash_attempts: int = 3
    bad_input_ratio: float = 0.9
    bad_input_window: int = 200
    fetch_max_records: int = 256
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    backpressure: BackpressurePolicy = field(default_factory=BackpressurePolicy)
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    registry: RegistrySettings | None = None  # --schema-registry: framed outputs, framed Jobs read too

    def rebalance_allowance_s(self) -> float:
        """How long joining the group may take before it counts as an outage: a dead member's
        session expires, then the incumbents have the rebalance timeout to rejoin."""
        return (self.session_timeout_ms + self.max_poll_interval_ms) / 1000

    def engine_jobs_bound(self) -> int:
        """max_engine_jobs, or its default: 2 x the engine's max_num_seqs (0 = no bound)."""
        return 2 * self.engine.max_num_seqs if self.max_engine_jobs is None else self.max_engine_jobs

    def validate(self) -> None:
        problems = []
        if not self.bootstrap_servers:
            problems.append("--bootstrap-servers is required")
        if not self.engine.model:
            problems.append("--model is required")
        for name in ("jobs_topic", "results_topic", "tokens_topic", "dlq_topic", "group_id"):
            if not getattr(self, name):
                problems.append(f"--{name.replace('_', '-')} must not be empty")
        if len({self.jobs_topic, self.results_topic, self.tokens_topic, self.dlq_topic}) != 4:
            problems.append("the jobs, results, tokens and dead-letter topics must all differ")
        if self.drain_timeout_s < 0:
            problems.append("--drain-timeout must be >= 0")
        if self.max_inflight_per_partition < 1:
            problems.append("--max-inflight-per-partition must be >= 1")
        if self.max_inflight_per_tenant < 0:
            problems.append("--max-inflight-per-tenant must be >= 0")
        if self.max_engine_jobs is not None and self.max_engine_jobs < 0:
            problems.append("--max-engine-jobs must be >= 0")
        if self.max_crash_attempts < 0:
            problems.append("--max-crash-attempts must be >= 0")
        if not 0 < self.bad_input_ratio <= 1:
            problems.append("--bad-input-ratio must be in (0, 1]")
        if self.bad_input_window < 1:
            problems.append("--bad-input-window must be >= 1")
        if self.commit_interval_s <= 0:
            problems.append("--commit-interval must be > 0")
        if self.broker_wait_timeout_s < 0:
            problems.append("--broker-wait-timeout must be >= 0")
        if self.registry is not None:
            problems += self.registry.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.security.validate()
