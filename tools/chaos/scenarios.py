"""The chaos scenarios, and the run around them: broker, topics, workers, jobs, report.

Every run: a broker (one started here, or the one given), fresh topics (the jobs topic with
`partitions` partitions), worker processes, `jobs` small greedy jobs, a reader of every Result,
and a probe of each worker's /readyz every second. Then one scenario injects its faults:

- `kill`: `workers` workers; all jobs produced; each time another 1/(kills+1) of the jobs has a
  Result, a random worker is killed with SIGKILL and a new one started in its place. With
  `broker_restarts`, the broker is also restarted that many times, spread between the kills
  (the replacements then join a group still settling from the restart).
- `broker-restart`: the broker is stopped (cleanly) once a tenth of the jobs has a Result and
  started again at once.
- `outage`: the same, but the broker stays away for `outage_s` seconds.
- `rebalance-storm`: the fleet walks through the sizes of `schedule` (1 -> 4 -> 1 -> 3: one
  worker joins or leaves every `step_s` seconds), jobs produced all along (or over
  `produce_over_s`; 0 sends them all first, a backlog that keeps every engine busy); departures
  alternate SIGKILL and SIGTERM (a drain), starting with a SIGKILL. Each step reports what it
  cost the incumbents (the workers there before and after it), from their /metrics: seconds
  their engine had nothing to do, tokens they computed and threw away, and the part of those
  that belonged to partitions they kept (`step_costs`; with a backlog, idle time is the
  rebalance's).

The run ends when every job has a Result and the group's commit lag is 0 (or `drain_timeout_s`
passed), then the last workers' assignments are checked and they are stopped with SIGTERM.

Every worker's exit is reported: a killed one's signal, every other one's code. A worker that
was not killed must exit 0 (a drain on SIGTERM); one that exits on its own, or with another
code, fails the run as a lost job does.

Every report also counts the tokens the workers computed and the tokens of work thrown away
(aborted in the engine, or an answer dropped because its partition had moved).

Duplicates are bounded by what was uncommitted when work changed hands: each killed worker's
`tokenmill_uncommitted_offsets` just before the kill, plus what workers logged as given up
uncommitted (in a rebalance, or at the end of a drain). The report gives that bound, and the
part of it that belongs to the workers that left.

Duplicates must also be the same answer: for every job answered `ok` more than once, the report
says whether all its Results carry the same token ids, text and logprobs (`duplicates_identical`
of `duplicated_jobs`; the jobs include seeded sampled ones with logprobs). A job whose answers
differ fails the run ("DUPLICATES DIFFER"), as a lost job does.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenmill.tools.chaos import DEFAULT_WORKER_ARGS, NEEDS_OWN_BROKER, SCENARIOS
from tokenmill.tools.chaos.broker import Broker
from tokenmill.tools.chaos.fleet import Costs, Fleet, WorkerProc
from tokenmill.tools.chaos.ledger import ChaosTopics, Ledger, make_jobs


@dataclass
class ChaosConfig:
    scenario: str
    jobs: int = 2000
    workers: int = 2  # kill, broker-restart, outage (the storm follows its schedule)
    model: str | None = None  # None: the tiny test model (tools/tiny_models.py)
    bootstrap: str | None = None  # None: start a local broker for the run
    partitions: int = 8
    max_tokens: int = 8
    kills: int = 3
    broker_restarts: int = 0  # kill: broker restarts spread between the kills
    outage_s: float = 120.0
    schedule: tuple[int, ...] = (1, 4, 1, 3)
    step_s: float = 7.5
    produce_over_s: float | None = None  # rebalance-storm: jobs spread over this long (None: the whole storm)
    drain_timeout_s: float = 300.0
    worker_args: str = DEFAULT_WORKER_ARGS
    work_dir: Path | None = None  # worker logs (and the local broker's data); None: a temporary folder
    seed: int = 0

    def validate(self) -> None:
        problems = []
        if self.scenario not in SCENARIOS:
            problems.append(f"unknown scenario {self.scenario!r}: one of {', '.join(SCENARIOS)}")
        if (self.scenario in NEEDS_OWN_BROKER or self.broker_restarts) and self.bootstrap:
            problems.append(f"{self.scenario} stops and starts the broker, so it needs one it starts itself: "
                            "leave out --bootstrap-servers")
        for name in ("jobs", "workers", "partitions", "max_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be >= 1")
        if self.kills < 1:
            problems.append("--kills must be >= 1")
        if self.broker_restarts < 0:
            problems.append("--broker-restarts must be >= 0")
        if self.broker_restarts and self.scenario != "kill":
            problems.append("--broker-restarts goes with the kill scenario")
        if self.outage_s < 0 or self.step_s <= 0 or self.drain_timeout_s <= 0:
            problems.append("--outage-seconds must be >= 0, --step-seconds and --drain-timeout > 0")
        if len(self.schedule) < 2 or min(self.schedule) < 1:
            problems.append("--schedule needs at least two fleet sizes, each >= 1")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class ChaosReport:
    scenario: str
    jobs: int
    lost: int
    duplicated: int
    not_ok: int
    drain_s: float | None  # last fault -> every job answered and commit lag 0 (None: not within the timeout)
    commit_lag: int | None
    duplicate_bound: int  # uncommitted offsets when work changed hands (see the module docstring)
    duplicate_bound_departed: int  # the part of the bound that belongs to workers that left
    first_result_s: float | None  # last fault -> first Result after it
    tokens_computed: int = 0  # output tokens every worker generated (read before each one stopped)
    discarded_tokens: int = 0  # tokens computed for work thrown away (aborted, or answers dropped)
    unexpected_exits: list[tuple[str, int]] = field(default_factory=list)
    exit_codes: dict[str, int | None] = field(default_factory=dict)  # of the last workers, stopped at the end
    details: dict = field(default_factory=dict)
    lost_ids: list[str] = field(default_factory=list)  # the first few
    # Every worker of the run: "killed" (SIGKILL, by the scenario) or its exit code (None: had to be
    # killed after not stopping in time).
    worker_exits: dict[str, int | str | None] = field(default_factory=dict)
    duplicated_jobs: int = 0  # jobs answered ok more than once
    duplicates_identical: int = 0  # of those, the jobs whose ok Results are all the same answer
    duplicates_differing_ids: list[str] = field(default_factory=list)  # the first few of the others

    @property
    def duplicates_all_identical(self) -> bool:
        return self.duplicates_identical == self.duplicated_jobs

    @property
    def failed_exits(self) -> dict[str, int | str | None]:
        """Workers that were not killed and did not exit 0."""
        return {name: code for name, code in self.worker_exits.items() if code not in ("killed", 0)}

    @property
    def ok(self) -> bool:
        return self.lost == 0 and not self.failed_exits and not self.unexpected_exits and self.duplicates_all_identical

    def to_json(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        def seconds(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f} s"

        rows = [("lost", str(self.lost)),
                ("duplicated", f"{self.duplicated} (bound {self.duplicate_bound}: uncommitted when work changed "
                               f"hands; {self.duplicate_bound_departed} of it by workers that left)"),
                ("duplicates identical", f"{self.duplicates_identical} of {self.duplicated_jobs} jobs answered more "
                                         "than once (token ids, text, logprobs)"
                                         + (f"; differ: {', '.join(self.duplicates_differing_ids)}"
                                            if self.duplicates_differing_ids else "")),
                ("not ok", str(self.not_ok)),
                ("tokens", f"{self.tokens_computed} computed, {self.discarded_tokens} discarded (work thrown away: "
                           "aborted in the engine or answers dropped)"),
                ("drain", f"{seconds(self.drain_s)} (last fault -> every job answered, commit lag 0)"),
                ("first Result", f"{seconds(self.first_result_s)} after the last fault"),
                ("commit lag", "-" if self.commit_lag is None else str(self.commit_lag)),
                ("worker exits", ", ".join(f"{n}: {c}" for n, c in self.worker_exits.items()) or "-"),
                ("unexpected exits", ", ".join(f"{n}: {c}" for n, c in [*self.unexpected_exits,
                                                                      *self.failed_exits.items()]) or "none")]
        rows += [(k.replace("_", " "), _fmt(v)) for k, v in self.details.items()]
        width = max(len(k) for k, _ in rows)
        verdict = ("OK" if self.ok else "JOBS LOST" if self.lost else "WORKER FAILED"
                   if self.failed_exits or self.unexpected_exits else "DUPLICATES DIFFER")
        head = f"chaos {self.scenario}: {self.jobs} jobs -> {verdict}"
        return "\n".join([head, *(f"  {k:<{width}}  {v}" for k, v in rows)])


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.1f}"
    if isinstance(v, list) and len(v) > 12:
        return f"{v[:12]} ... ({len(v)} in all)"
    return str(v)


@dataclass
class Run:
    """What a scenario works with."""

    config: ChaosConfig
    broker: Broker
    fleet: Fleet
    ledger: Ledger
    rng: random.Random
    jobs: list[dict]
    readiness: list[tuple[float, str, bool]] = field(default_factory=list)  # (time, worker, ready)

    async def start_workers(self, n: int) -> list[WorkerProc]:
        workers = [self.fleet.start() for _ in range(n)]
        await asyncio.gather(*(self.fleet.wait_ready(w) for w in workers))
        return workers

    async def until(self, what: str, predicate: Callable[[], bool], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            self.fleet.check_exits()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
            await asyncio.sleep(0.05)

    async def busy_worker(self, timeout_s: float = 10.0) -> WorkerProc:
        """A random worker that is running jobs (something fetched and not committed), or any
        live one if none is within the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = self.fleet.live()
            busy = [w for w in live if (await self.fleet.gauge(w, "tokenmill_uncommitted_offsets") or 0) > 0]
            if busy:
                return self.rng.choice(busy)
            await asyncio.sleep(0.05)
        return self.rng.choice(self.fleet.live())

    async def sample_readiness(self) -> None:
        while True:
            for w in self.fleet.live():
                self.readiness.append((time.monotonic(), w.name, await self.fleet.ready(w)))
            await asyncio.sleep(1.0)


# -- the scenarios: each returns when its last fault is over, with when that was and its details ---------
Scenario = Callable[[Run], Awaitable[tuple[float, dict]]]


async def _kill(run: Run) -> tuple[float, dict]:
    c = run.config
    await run.start_workers(c.workers)
    await run.ledger.produce(run.jobs)
    kills, restarts = [], []
    # Restarts go after evenly spread kills: with 6 kills and 1 restart, after the third.
    restart_after = {round((r + 1) * c.kills / (c.broker_restarts + 1)) for r in range(c.broker_restarts)}
    for k in range(c.kills):
        target = len(run.jobs) * (k + 1) // (c.kills + 1)
        await run.until(f"{target} Results", lambda t=target: run.ledger.answered() >= t)
        victim = await run.busy_worker()
        d = await run.fleet.depart(victim, "SIGKILL")
        kills.append({"worker": d.worker, "uncommitted": d.uncommitted, "answered_before": run.ledger.answered()})
        run.fleet.start()  # its replacement joins when ready
        if k + 1 in restart_after:
            t0 = time.monotonic()
            await run.broker.stop()
            await run.broker.start()
            restarts.append({"after_kill": k + 1, "answered_before": run.ledger.answered(),
                             "restart_s": round(time.monotonic() - t0, 1)})
    details: dict = {"kills": kills}
    if restarts:
        details["broker_restarts"] = restarts
    return time.monotonic(), details


async def _broker_away(run: Run, away_s: float) -> tuple[float, dict]:
    c = run.config
    await run.start_workers(c.workers)
    await run.ledger.produce(run.jobs)
    await run.until("a tenth of the Results", lambda: run.ledger.answered() >= max(1, len(run.jobs) // 10))
    # What the workers hold when the broker goes: it must all survive the outage.
    uncommitted = [await run.fleet.gauge(w, "tokenmill_uncommitted_offsets") or 0 for w in run.fleet.live()]
    stop_called = time.monotonic()
    await run.broker.stop()
    stopped = time.monotonic()
    answered_at_stop = run.ledger.answered()
    while time.monotonic() < stopped + away_s:
        run.fleet.check_exits()
        await asyncio.sleep(min(1.0, max(0.0, stopped + away_s - time.monotonic())))
    start_called = time.monotonic()
    await run.broker.start()
    back = time.monotonic()
    details = {"answered_at_stop": answered_at_stop, "uncommitted_at_stop": int(sum(uncommitted)),
               "broker_stop_s": stopped - stop_called,
               "broker_away_s": start_called - stopped, "broker_start_s": back - start_called,
               "_stopped": stopped, "_start_called": start_called}
    return back, details


async def _broker_restart(run: Run) -> tuple[float, dict]:
    return await _broker_away(run, 0.0)


async def _outage(run: Run) -> tuple[float, dict]:
    return await _broker_away(run, run.config.outage_s)


def storm_sizes(schedule: tuple[int, ...]) -> list[int]:
    """The fleet sizes, one worker joining or leaving per step: (1, 4, 1, 3) -> 1 2 3 4 3 2 1 2 3."""
    sizes = [schedule[0]]
    for target in schedule[1:]:
        while sizes[-1] != target:
            sizes.append(sizes[-1] + (1 if target > sizes[-1] else -1))
    return sizes


@dataclass
class StepWindow:
    """One storm step, from the change to the next one: what it cost the workers that stayed."""

    step: str
    incumbents: list[WorkerProc]  # members before the change that are members after it
    before: dict[str, Costs] = field(default_factory=dict)
    owned: dict[str, set[int]] = field(default_factory=dict)  # their partitions at the change

    @classmethod
    async def open(cls, run: Run, step: str, incumbents: list[WorkerProc]) -> StepWindow:
        window = cls(step, list(incumbents))
        for w in incumbents:
            window.before[w.name] = await run.fleet.costs(w)
            window.owned[w.name] = run.fleet.partitions_of(w)
        return window

    async def close(self, run: Run) -> dict:
        """Per incumbent: engine idle seconds, tokens discarded, and the part of them that belongs to
        partitions it owned before the change and owns after it (work that stayed put)."""
        idle, discarded, stayed = {}, {}, {}
        for w in self.incumbents:
            if not w.alive():
                continue
            cost = (await run.fleet.costs(w)).since(self.before[w.name])
            kept = self.owned[w.name] & run.fleet.partitions_of(w)
            idle[w.name] = round(cost.idle_s, 2)
            discarded[w.name] = cost.discarded_tokens
            stayed[w.name] = int(sum(v for p, v in cost.discarded.items() if p in kept))
        return {"step": self.step, "idle_s": idle, "discarded_tokens": discarded, "discarded_tokens_stayed": stayed}


async def _storm(run: Run) -> tuple[float, dict]:
    c = run.config
    sizes = storm_sizes(c.schedule)
    members = await run.start_workers(sizes[0])
    over_s = c.step_s * len(sizes) if c.produce_over_s is None else c.produce_over_s
    producing = asyncio.create_task(run.ledger.produce(run.jobs, over_s=over_s))
    leaving: list[asyncio.Task] = []
    steps, departures, costs = [], 0, []
    window: StepWindow | None = None
    for size in sizes[1:]:
        await asyncio.sleep(c.step_s)
        run.fleet.check_exits()
        if window is not None:
            costs.append(await window.close(run))
        if size > len(members):
            incumbents = list(members)
            window = await StepWindow.open(run, "", incumbents)
            members.append(run.fleet.start())
            steps.append(f"+{members[-1].name}")
        else:
            victim = members.pop(run.rng.randrange(len(members)))
            window = await StepWindow.open(run, "", members)
            departures += 1
            how = "SIGKILL" if departures % 2 == 1 else "SIGTERM"
            leaving.append(asyncio.create_task(run.fleet.depart(victim, how)))
            steps.append(f"-{victim.name} ({how})")
        window.step = steps[-1]
    last = time.monotonic()
    # The last step's window closes once its joiner is in the group (or its leaver gone) and the
    # group had a moment to settle.
    await asyncio.gather(*(run.fleet.wait_ready(w) for w in members if w.ready_at is None))
    await asyncio.gather(*leaving)
    await asyncio.sleep(min(c.step_s, 5.0))
    if window is not None:
        costs.append(await window.close(run))
    await producing
    idle = [v for step in costs for v in step["idle_s"].values()]
    return last, {"steps": steps, "sizes": sizes, "step_costs": costs,
                  "incumbent_idle_s_max": max(idle, default=0.0),
                  "discarded_tokens_stayed": sum(sum(step["discarded_tokens_stayed"].values()) for step in costs)}


SCENARIO_RUNS: dict[str, Scenario] = {"kill": _kill, "broker-restart": _broker_restart,
                                      "rebalance-storm": _storm, "outage": _outage}


# -- after the faults ------------------------------------------------------------------------------------
async def settle(fleet: Fleet, partitions: int, timeout_s: float = 60.0) -> dict:
    """Once every live worker is ready, wait until each partition has exactly one owner (a
    worker's death shows only after the session timeout); the last assignment seen."""
    t0 = time.monotonic()
    await asyncio.gather(*(fleet.wait_ready(w) for w in fleet.live()))
    while True:
        state = await final_assignment(fleet, partitions)
        complete = not state["unowned_partitions"] and not state["shared_partitions"]
        if complete and state["assigned_partitions"] == partitions or time.monotonic() - t0 > timeout_s:
            state["settle_s"] = time.monotonic() - t0
            return state
        await asyncio.sleep(0.5)


async def final_assignment(fleet: Fleet, partitions: int) -> dict:
    """Who owns which partition now (each member's last "partitions assigned" log line), and how
    many are paused (the members' gauges)."""
    owners: dict[int, list[str]] = {}
    paused = assigned_gauge = 0
    for w in fleet.live():
        events = [e for e in fleet.log_events("partitions assigned") if e.get("worker") == w.name]
        for p in (events[-1]["partitions"] if events else []):
            owners.setdefault(p, []).append(w.name)
        paused += int(await fleet.gauge(w, "tokenmill_partitions_paused") or 0)
        assigned_gauge += int(await fleet.gauge(w, "tokenmill_partitions_assigned") or 0)
    return {"unowned_partitions": [p for p in range(partitions) if p not in owners],
            "shared_partitions": sorted(p for p, o in owners.items() if len(o) > 1),
            "paused_partitions": paused, "assigned_partitions": assigned_gauge}


def duplicate_bounds(fleet: Fleet, leavers: set[str]) -> tuple[int, int]:
    """(all, departed): kills' uncommitted readings plus what workers logged as given up."""
    total = departed = 0
    for d in fleet.departures:
        if d.how == "SIGKILL":
            total += d.uncommitted
            departed += d.uncommitted
    for event in ("partitions given up", "drained"):
        for e in fleet.log_events(event):
            n = int(e.get("uncommitted") or 0)
            total += n
            if e.get("worker") in leavers:
                departed += n
    return total, departed


async def ready_seen_after(run: Run, back: float, timeout_s: float) -> None:
    """The broker scenarios: a fleet can answer every job before a worker's next readiness probe
    (every 2 s) has seen the broker back; sampling goes on until each live worker was seen ready
    since `back`, or `timeout_s`, so that "ready again" is measured, not cut off by a fast drain."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = {name for t, name, ready in run.readiness if t >= back and ready}
        if seen >= {w.name for w in run.fleet.live()}:
            return
        await asyncio.sleep(0.2)


def readiness_details(run: Run, details: dict, back: float) -> None:
    """For the broker scenarios: readiness while the broker was away and after it was back."""
    stopped, start_called = details.pop("_stopped", None), details.pop("_start_called", None)
    if stopped is None:
        return
    # The probe runs every 2 s and a refused connection fails at once: allow 5 s to notice.
    during = [ready for t, _, ready in run.readiness if stopped + 5.0 <= t <= start_called]
    details["readiness_samples_during_outage"] = len(during)
    details["ready_samples_during_outage"] = sum(during)
    first_not_ready = next((t for t, _, ready in run.readiness if t >= stopped and not ready), None)
    details["not_ready_after_s"] = None if first_not_ready is None else first_not_ready - stopped
    after = {}
    for t, name, ready in run.readiness:
        if t >= back and ready and name not in after:
            after[name] = t - back
    live = {w.name for w in run.fleet.live()}
    details["ready_again_s"] = max(after.values()) if after and set(after) >= live else None


async def run_scenario(config: ChaosConfig, broker: Broker | None = None) -> ChaosReport:
    """Run one scenario end to end; `broker` overrides config.bootstrap (and is left running)."""
    config.validate()
    temp = config.work_dir is None
    work_dir = Path(tempfile.mkdtemp(prefix="tokenmill-chaos-")) if temp else Path(config.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    model = config.model
    if model is None:
        from tokenmill.tools.tiny_models import cached_tiny_model

        model = str(cached_tiny_model("test-llama"))
    own = broker is None
    tasks: list[asyncio.Task] = []
    fleet: Fleet | None = None
    try:
        if broker is None:
            broker = Broker.given(config.bootstrap) if config.bootstrap else await Broker.start_local(work_dir)
        if (config.scenario in NEEDS_OWN_BROKER or config.broker_restarts) and not broker.can_restart:
            raise ValueError(f"{config.scenario} needs a broker it can stop and start")
        topics = await ChaosTopics.create(broker.bootstrap, config.partitions)
        ledger = Ledger(broker.bootstrap, topics)
        fleet = Fleet(broker.bootstrap, topics.flags(), model, work_dir, config.worker_args)
        run = Run(config, broker, fleet, ledger, random.Random(config.seed),
                  make_jobs(config.jobs, config.max_tokens, f"chaos-{uuid.uuid4().hex[:6]}"))
        tasks = [asyncio.create_task(ledger.follow()), asyncio.create_task(run.sample_readiness())]
        last_fault, details = await SCENARIO_RUNS[config.scenario](run)
        drained = await ledger.wait_drained(config.drain_timeout_s)
        drained_at = time.monotonic()
        fleet.check_exits()
        if "_stopped" in details:
            await ready_seen_after(run, last_fault, timeout_s=15.0)
        readiness_details(run, details, last_fault)
        details.update(await settle(fleet, config.partitions))
        leavers = {d.worker for d in fleet.departures}
        try:
            lag: int | None = await ledger.commit_lag()
        except Exception:
            lag = None
        live_costs = [await fleet.costs(w) for w in fleet.live()]
        exit_codes = await fleet.stop_all()
        spent = live_costs + [d.costs for d in fleet.departures if d.worker not in exit_codes]
        bound, bound_departed = duplicate_bounds(fleet, leavers)
        first = ledger.first_result_after(last_fault)
        lost = ledger.lost()
        repeated, differing = ledger.duplicate_answers()
        return ChaosReport(
            scenario=config.scenario, jobs=len(run.jobs), lost=len(lost), duplicated=ledger.duplicated(),
            not_ok=ledger.not_ok(), drain_s=drained_at - last_fault if drained else None, commit_lag=lag,
            duplicate_bound=bound, duplicate_bound_departed=bound_departed,
            first_result_s=None if first is None else first - last_fault,
            tokens_computed=int(sum(c.output_tokens for c in spent)),
            discarded_tokens=sum(c.discarded_tokens for c in spent),
            unexpected_exits=fleet.unexpected_exits, exit_codes=exit_codes, details=details, lost_ids=lost[:10],
            worker_exits=fleet.exits(), duplicated_jobs=repeated, duplicates_identical=repeated - len(differing),
            duplicates_differing_ids=differing[:10])
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if fleet is not None:
            fleet.kill_all_now()
        if own and broker is not None:
            await broker.close()
        if temp:
            shutil.rmtree(work_dir, ignore_errors=True)
