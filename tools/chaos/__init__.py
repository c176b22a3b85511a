"""`tokenmill chaos`: named fault scenarios against a real broker and real worker processes.

`tools.chaos.scenarios.run_scenario(ChaosConfig(...))` starts a local broker (or uses a given
one), creates fresh topics, starts `tokenmill worker` processes, sends jobs, injects the
scenario's faults (kills, a broker restart, an outage, a rebalance storm) and returns a
`ChaosReport`: jobs lost, duplicated and not ok, the time to drain, and what the duplicates are
bounded by. The files: `scenarios.py` (the run and the scenarios), `fleet.py` (worker
processes), `ledger.py` (jobs sent, Results read, commit lag), `broker.py` (the broker).

This file holds only names, so the command line can list them without importing the rest.
"""

SCENARIOS = ("kill", "broker-restart", "rebalance-storm", "outage")
NEEDS_OWN_BROKER = ("broker-restart", "outage")  # they stop and start the broker

# Small engine and quick group settings: several workers share a few CPU cores.
DEFAULT_WORKER_ARGS = ("--max-num-seqs 16 --max-num-batched-tokens 512 --kv-cache-gb 0.05 --commit-interval 0.5 "
                       "--session-timeout-ms 6000 --drain-timeout 20")
