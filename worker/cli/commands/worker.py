"""`tokenmill worker`: a consumer-group member that runs jobs from Kafka until SIGTERM/SIGINT."""

from __future__ import annotations

from tokenmill.cli import preflight
from tokenmill.cli.commands._kafka_client import add_kafka_security_args, kafka_security_from_args
from tokenmill.cli.commands._registry_client import add_schema_registry_args, registry_settings_from_args
from tokenmill.cli.engine_options import (
    add_engine_options,
    engine_config_from_args,
    non_negative_float,
    positive_int,
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run jobs from the jobs topic and publish Results (until SIGTERM/SIGINT, then drain)",
        description=(
            "Consume Jobs from Kafka, run them on the engine, publish TokenEvents and Results, commit input "
            "offsets only once Results are durable. Every flag also reads TOKENMILL_<FLAG>."
        ),
    )
    k = p.add_argument_group("Kafka")
    k.add_argument("--bootstrap-servers", required=True, help="host:port[,host:port...]")
    k.add_argument("--group-id", default="tokenmill", help="consumer group (default: tokenmill)")
    k.add_argument("--jobs-topic", default="tokenmill.jobs")
    k.add_argument("--results-topic", default="tokenmill.results")
    k.add_argument("--tokens-topic", default="tokenmill.tokens")
    k.add_argument("--dlq-topic", default="tokenmill.dlq")
    k.add_argument(
        "--exactly-once", action="store_true",
        help="Result and input offset in one transaction (read_committed readers see one Result per job)",
    )
    k.add_argument("--instance-id", default=None, help="static group membership id (no rebalance on restart)")
    k.add_argument("--worker-name", default=None, help="name in Results and attempt ids (default host-pid)")
    k.add_argument("--session-timeout-ms", type=positive_int, default=10_000)
    k.add_argument("--commit-interval", type=float, default=1.0, help="seconds between watermark commits")
    k.add_argument("--broker-wait-timeout", type=non_negative_float, default=300.0,
                   help="seconds to wait for a broker at start before exiting (code 5; default 300)")

    d = p.add_argument_group("Delivery")
    d.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                   help="seconds in-flight jobs get to finish on shutdown (default 30)")
    d.add_argument("--revoke-grace", type=non_negative_float, default=0.0,
                   help="seconds a revoked partition's in-flight jobs get to finish before its commit (default 0: "
                        "the work is kept until the new assignment, and aborted only where the partition moved)")
    d.add_argument("--max-inflight-per-partition", type=positive_int, default=1024,
                   help="cap on offsets between a partition's commit point and its fetch position")
    d.add_argument("--max-inflight-per-tenant", type=int, default=0,
                   help="jobs of one tenant running at once (0 = no cap)")
    d.add_argument("--max-engine-jobs", type=int, default=None,
                   help="jobs in the engine at once; the rest wait in the worker and go in round-robin across "
                        "tenants (default 2 x --max-num-seqs; 0 = no bound)")
    d.add_argument("--max-crash-attempts", type=int, default=3,
                   help="dead-letter a job (crashed_worker) that was in flight this many times when a worker died "
                        "(0 = off; default 3)")
    d.add_argument("--bad-input-ratio", type=float, default=0.9,
                   help="stop the worker when this share of the last --bad-input-window inputs was bad")
    d.add_argument("--bad-input-window", type=positive_int, default=200)
    d.add_argument("--backpressure-waiting-high", type=positive_int, default=None,
                   help="pause fetching above this many waiting requests (default 2 x --max-num-seqs)")
    d.add_argument("--backpressure-kv-high", type=float, default=0.95, help="pause fetching above this KV usage")

    add_engine_options(p, model_required=True)

    o = p.add_argument_group("Operations")
    o.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics, /healthz, /readyz on this port (0 = any free port)")
    o.add_argument("--metrics-host", default="0.0.0.0")
    o.add_argument("--log-level", default="INFO")

    add_kafka_security_args(p.add_argument_group("Security (SSL, SASL PLAIN / SCRAM)"))
    r = p.add_argument_group("Schema Registry (opt in)")
    add_schema_registry_args(r, what="outputs in Confluent's wire format, framed Jobs read too")
    r.add_argument("--result-format", default="json", choices=("json", "avro"),
                   help="Results as JSON Schema or Avro on the registry (default json)")
    p.set_defaults(func=run)


def settings_from_args(args):
    from tokenmill.config import WorkerSettings
    from tokenmill.kafka.backpressure import BackpressurePolicy

    engine = engine_config_from_args(args, args.model)
    waiting_high = args.backpressure_waiting_high or 2 * args.max_num_seqs
    kv_high = args.backpressure_kv_high
    backpressure = BackpressurePolicy(
        waiting_high=waiting_high,
        waiting_low=waiting_high // 2,
        kv_high=kv_high,
        kv_low=max(0.0, kv_high - 0.15),
    )
    security = kafka_security_from_args(args)
    registry = registry_settings_from_args(args, result_format=args.result_format)
    settings = WorkerSettings(
        bootstrap_servers=args.bootstrap_servers,
        engine=engine,
        group_id=args.group_id,
        jobs_topic=args.jobs_topic,
        results_topic=args.results_topic,
        tokens_topic=args.tokens_topic,
        dlq_topic=args.dlq_topic,
        exactly_once=args.exactly_once,
        instance_id=args.instance_id,
        drain_timeout_s=args.drain_timeout,
        revoke_grace_s=args.revoke_grace,
        commit_interval_s=args.commit_interval,
        broker_wait_timeout_s=args.broker_wait_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        max_inflight_per_partition=args.max_inflight_per_partition,
        max_inflight_per_tenant=args.max_inflight_per_tenant,
        max_engine_jobs=args.max_engine_jobs,
        max_crash_attempts=args.max_crash_attempts,
        bad_input_ratio=args.bad_input_ratio,
        bad_input_window=args.bad_input_window,
        session_timeout_ms=args.session_timeout_ms,
        heartbeat_interval_ms=max(100, args.session_timeout_ms // 3),
        backpressure=backpressure,
        security=security,
        registry=registry,
    )
    if args.worker_name:
        settings.worker_name = args.worker_name
    elif args.instance_id:
        settings.worker_name = args.instance_id
    settings.validate()
    return settings


def run(args) -> int:
    import asyncio
    import sys

    from tokenmill.logging import configure_logging

    try:
        configure_logging(args.log_level)
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"tokenmill worker: {exc}", file=sys.stderr)
        return 2
    # The model folder (or s3:// prefix) before anything loads; the broker is not checked here: a
    # worker that starts before Kafka waits for it (--broker-wait-timeout) while its model loads.
    problems = (preflight.model(args.model, backend=args.backend)
                or preflight.remote_model(args.model, backend=args.backend))
    if problems:
        return preflight.fail("tokenmill worker", problems)

    from tokenmill.kafka.worker import KafkaWorker

    worker = KafkaWorker(settings)
    code = asyncio.run(worker.run())
    if code != 0 and worker.fatal_error:
        print(f"tokenmill worker: {worker.fatal_error}", file=sys.stderr)
    return code
