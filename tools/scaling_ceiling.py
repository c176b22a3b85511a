"""How much the engine gains from a second thread, beside how much this machine lets any work gain.

    python -m tools.scaling_ceiling [--model tiny-llama] [--num-requests 256] [--cpus 0 1] [--json out.json]

On a shared host (a VM whose cores share an L3 cache and memory bandwidth with other tenants) the gain
from a second thread moves with the neighbours' load from one hour to the next: the same code
scaled 1.66x to 1.89x in four peer sittings of one morning. To tell the engine's share from the
machine's, this runs the `mixed` workload five times, each run a process of its own, within a few
minutes (most of it the processes' starts):

1. alone: one thread, pinned to the first CPU;
2. pair: two one-thread runs at once, one pinned to each CPU. They share nothing but the machine,
   so 2 x alone / pair is the most that two threads could gain this hour: the machine's ceiling.
   Their starts take uneven times (the kernel may have to assemble huge pages for the KV cache), so
   each waits after its warm-up until the other is ready, and the two timed runs start together;
3. t1 and t2: the engine on one thread and on two (both allowed the two CPUs), as the peer suite
   and `tokenmill bench` run it;
4. alone once more, pinned to the second CPU: the ceiling takes the mean of the two alone runs, so
   a machine that speeds up or slows down during the probe tilts it less.

It prints the engine's scaling (t1 / t2), the ceiling, and the engine's share of the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# As the peer suite runs tokenmill (../shared/peer/vllm_cpu_bench.py); the random prompts share no
# block. Its KV cache is 4 GiB, so SmolLM2's 256 requests need no preemption (--kv-cache-gb).
ENGINE_OPTIONS = {"dtype": "float32", "max_num_seqs": 256, "max_num_batched_tokens": 2048,
                  "enable_prefix_caching": False}
BARRIER_TIMEOUT_S = 900.0  # a pair run whose partner died gives up after this long


def run_once(
    model: str, threads: int, num_requests: int, kv_cache_gb: float = 4.0, seed: int = 0,
    barrier: tuple[Path, int] | None = None,
) -> dict[str, Any]:
    """One timed `mixed` run in this process, after the bench's warm-up; with `barrier` (a folder,
    a number of processes) the timed run waits until that many processes are ready in the folder."""
    import torch

    torch.set_num_threads(threads)
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.tools.bench_engine import run_engine
    from tokenmill.tools.bench_workloads import mixed_workload, resolve_model

    model_dir = resolve_model(model)
    mc = load_model_config(model_dir)
    work = mixed_workload(mc.vocab_size, num_requests, seed, set(mc.eos_token_ids))
    started: list[float] = []

    def before_timed() -> None:
        if barrier is not None:
            meet(*barrier)
        started.append(time.time())  # the clock's start, within microseconds

    run = run_engine(model_dir, work, {**ENGINE_OPTIONS, "kv_cache_gb": kv_cache_gb, "cpu_threads": threads},
                     before_timed)
    return {"threads": threads, "cpus": sorted(os.sched_getaffinity(0)), "wall_s": run.wall_s,
            "cpu_s": run.cpu_s, "output_tokens": run.output_tokens, "started_at": started[0]}


def meet(folder: Path, parties: int, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Say this process is ready (a file in `folder`), then wait until `parties` processes are."""
    (folder / f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while sum(1 for _ in folder.glob("ready-*")) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{parties} processes were not ready in {folder} after {timeout_s:.0f} s")
        time.sleep(0.002)


def _child(
    model: str, threads: int, cpus: list[int], num_requests: int, kv_cache_gb: float, barrier: Path | None = None
) -> dict[str, Any]:
    """run_once in a process of its own (torch's thread pool is fixed at its first use), on `cpus`;
    with `barrier`, its timed run starts with the other pair run's."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "tokenmill.tools.scaling_ceiling", "--model", model, "--num-requests", str(num_requests),
           "--kv-cache-gb", str(kv_cache_gb), "--threads", str(threads), "--cpus", *map(str, cpus), "--child"]
    if barrier is not None:
        cmd += ["--barrier", str(barrier)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"run at {threads} thread(s) on CPUs {cpus} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ceiling_ratios(runs: dict[str, Any]) -> dict[str, float]:
    """The machine's ceiling (two pinned one-thread runs at once against one alone), the engine's
    scaling (one thread against two), the engine's share of the ceiling, and how much of the
    longer pair run the shorter one overlapped (their timed runs start together, so this is short
    of 1 only by how much one ran longer; a low overlap would make the ceiling too high)."""
    alone = (runs["alone_first"]["wall_s"] + runs["alone_second"]["wall_s"]) / 2
    x, y = runs["pair"]
    pair = (x["wall_s"] + y["wall_s"]) / 2
    common = min(x["started_at"] + x["wall_s"], y["started_at"] + y["wall_s"]) - max(x["started_at"], y["started_at"])
    ceiling = 2 * alone / pair
    scaling = runs["t1"]["wall_s"] / runs["t2"]["wall_s"]
    return {"ceiling": ceiling, "engine_scaling": scaling, "share_of_ceiling": scaling / ceiling,
            "pair_overlap": max(0.0, common) / max(x["wall_s"], y["wall_s"])}


def probe(model: str, num_requests: int, cpus: tuple[int, int], kv_cache_gb: float = 4.0) -> dict[str, Any]:
    a, b = cpus

    def child(threads: int, on: list[int], barrier: Path | None = None) -> dict[str, Any]:
        return _child(model, threads, on, num_requests, kv_cache_gb, barrier)

    runs: dict[str, Any] = {"alone_first": child(1, [a])}
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(2) as pool:
        runs["pair"] = list(pool.map(lambda cpu: child(1, [cpu], Path(folder)), (a, b)))
    runs["t1"] = child(1, [a, b])
    runs["t2"] = child(2, [a, b])
    runs["alone_second"] = child(1, [b])
    return {"model": model, "num_requests": num_requests, "cpus": [a, b], "runs": runs, **ceiling_ratios(runs)}


def format_report(result: dict[str, Any]) -> str:
    r = result["runs"]
    pair = " / ".join(f"{x['wall_s']:.2f}" for x in r["pair"])
    walls = (f"alone {r['alone_first']['wall_s']:.2f} / {r['alone_second']['wall_s']:.2f} s, pair {pair} s, "
             f"1 thread {r['t1']['wall_s']:.2f} s, 2 threads {r['t2']['wall_s']:.2f} s")
    return (f"{result['model']}, mixed, {result['num_requests']} requests, CPUs {result['cpus']}: {walls}\n"
            f"machine's ceiling (two pinned one-thread runs at once against one alone): {result['ceiling']:.2f}x "
            f"(the pair's timed runs overlapped {100 * result['pair_overlap']:.0f}%)\n"
            f"engine from 1 to 2 threads: {result['engine_scaling']:.2f}x, "
            f"{100 * result['share_of_ceiling']:.0f}% of the ceiling")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.scaling_ceiling", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama", help="tiny-llama, smollm2, or a checkpoint directory")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--cpus", type=int, nargs="+", default=None,
                   help="the two CPUs to run on (default: the first two this process may use)")
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV cache size (4 GiB, as the peer suite)")
    p.add_argument("--json", help="write the runs and ratios here")
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--barrier", type=Path, default=None, help=argparse.SUPPRESS)  # a pair run's meeting folder
    args = p.parse_args(argv)
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if args.kv_cache_gb <= 0:
        p.error("--kv-cache-gb must be > 0")
    allowed = sorted(os.sched_getaffinity(0))
    cpus = args.cpus if args.cpus is not None else allowed[:2]
    if not set(cpus) <= set(allowed):
        p.error(f"--cpus {cpus}: this process may run on CPUs {allowed} only")
    if args.child:
        os.sched_setaffinity(0, cpus)  # before torch starts its threads, which inherit the mask
        print(json.dumps(run_once(args.model, args.threads, args.num_requests, args.kv_cache_gb,
                                  barrier=(args.barrier, 2) if args.barrier is not None else None)))
        return 0
    if len(set(cpus)) != 2:
        p.error(f"the probe needs two distinct CPUs (this process may run on {allowed})")
    result = probe(args.model, args.num_requests, (cpus[0], cpus[1]), args.kv_cache_gb)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
