"""`tokenmill chaos SCENARIO`: faults against a real broker and real workers, and what they cost.

Starts a local Kafka (or uses --bootstrap-servers), fresh topics and `tokenmill worker`
processes, sends --jobs small jobs and injects the scenario's faults: `kill` (SIGKILL workers
mid-run, with --broker-restarts the broker restarted between the kills), `broker-restart`, `outage` (the broker away for --outage-seconds) or `rebalance-storm`
(workers joining and leaving every --step-seconds through the sizes of --schedule). Prints the
jobs lost, duplicated and not ok, whether every job answered twice got the same answer
(duplicates_identical: token ids, text, logprobs; the jobs include seeded sampled ones with
logprobs), the time to drain and the bound on duplicates; --json writes the report, with every
worker's exit (killed, or its exit code). Exit 0 when nothing was lost, every duplicate repeats
its answer and every worker that was not killed exited 0; 1 when a job has no Result, a job's
answers differ or such a worker failed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse

from tokenmill.cli.engine_options import non_negative_float, non_negative_int, positive_int

HELP = "run a fault scenario (kill, broker-restart, outage, rebalance-storm) and report lost and duplicated jobs"


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fleet sizes like 1,4,1,3, got {text!r}") from None
    return sizes


def register(subparsers) -> None:
    from tokenmill.tools.chaos import DEFAULT_WORKER_ARGS, SCENARIOS

    p = subparsers.add_parser("chaos", help=HELP, description=__doc__.split("\n\n", 1)[1])
    p.add_argument("scenario", choices=SCENARIOS)
    p.add_argument("--jobs", type=positive_int, default=2000, help="jobs to send (default 2000)")
    p.add_argument("--workers", type=positive_int, default=2,
                   help="worker processes (kill, broker-restart, outage; default 2)")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the tiny test model)")
    p.add_argument("--bootstrap-servers", default=None,
                   help="an existing broker for kill and rebalance-storm (default: start a local one)")
    p.add_argument("--partitions", type=positive_int, default=8, help="partitions of the jobs topic (default 8)")
    p.add_argument("--max-tokens", type=positive_int, default=8, help="output tokens per job (default 8)")
    p.add_argument("--kills", type=positive_int, default=3, help="kill: how many SIGKILLs (default 3)")
    p.add_argument("--broker-restarts", type=non_negative_int, default=0,
                   help="kill: also restart the broker this many times, between the kills (default 0)")
    p.add_argument("--outage-seconds", type=non_negative_float, default=120.0,
                   help="outage: how long the broker stays away (default 120)")
    p.add_argument("--schedule", type=_sizes, default=(1, 4, 1, 3),
                   help="rebalance-storm: fleet sizes to walk through, one worker per step (default 1,4,1,3)")
    p.add_argument("--step-seconds", type=float, default=7.5,
                   help="rebalance-storm: seconds between joins and departures (default 7.5)")
    p.add_argument("--produce-over", type=non_negative_float, default=None, metavar="SECONDS",
                   help="rebalance-storm: send the jobs over this long (default: the whole storm; 0: all first, "
                        "a backlog that keeps every engine busy, so idle time is the rebalances')")
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds to wait after the last fault for every Result and commit lag 0 (default 300)")
    p.add_argument("--worker-args", default=DEFAULT_WORKER_ARGS,
                   help=f"flags for every worker, as one string (default: {DEFAULT_WORKER_ARGS!r})")
    p.add_argument("--work-dir", default=None, help="keep the worker logs (and the local broker's data) here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import logging
    import sys
    from pathlib import Path

    from tokenmill.tools.chaos.scenarios import ChaosConfig, run_scenario

    # The run's own clients lose the broker on purpose: their reconnect noise is not news.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    config = ChaosConfig(
        scenario=args.scenario, jobs=args.jobs, workers=args.workers, model=args.model,
        bootstrap=args.bootstrap_servers, partitions=args.partitions, max_tokens=args.max_tokens, kills=args.kills,
        broker_restarts=args.broker_restarts,
        outage_s=args.outage_seconds, schedule=args.schedule, step_s=args.step_seconds,
        produce_over_s=args.produce_over,
        drain_timeout_s=args.drain_timeout, worker_args=args.worker_args,
        work_dir=Path(args.work_dir) if args.work_dir else None, seed=args.seed,
    )
    try:
        config.validate()
    except ValueError as exc:
        print(f"tokenmill chaos: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(run_scenario(config))
    print(report.format())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.ok else 1
