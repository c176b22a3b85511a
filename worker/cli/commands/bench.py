"""`tokenmill bench --workload {mixed,prefix,kafka,structured,features,score,n,invariance} --model {tiny-llama,smollm2,DIR} [--json PATH]`."""

from __future__ import annotations

import argparse

from tokenmill.cli import preflight
from tokenmill.cli.engine_options import add_engine_options, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark the engine: mixed (vs transformers generate), prefix (vs no prefix cache), "
        "kafka (mixed through a broker and a worker vs the engine alone), structured (JSON-schema "
        "constrained vs unconstrained), features (each sampling feature alone vs plain greedy rows), "
        "score (multiple-choice loglikelihoods vs transformers), n (n = 8 samples per prompt vs single jobs), "
        "invariance (each job's Result alone vs in mixes of 64 and 256: the share identical, and the cost)",
        description=(
            "mixed: 256 requests, prompt 16-512 tokens, output 16-256 (ignore_eos), against transformers "
            "generate with the best static batch of 8/32/64. prefix: 128 requests sharing a 512-token "
            "prefix plus 32 unique tokens, 32 output tokens, against the same engine without prefix "
            "caching. kafka: the mixed workload through a real broker and a worker, against the engine "
            "alone. structured: 256 requests over 8 JSON schemas, every row constrained, against the "
            "same requests unconstrained with the same output lengths. features: the structured workload's "
            "prompts plain greedy and with each feature alone (structured JSON, logprobs 5, seeded top-p, "
            "penalties, stop strings, n 4, prompt_logprobs 5), each feature's decode steps against the plain "
            "ones in lockstep, with the CPU's AVX2, AVX-512 and AMX named. score: 64 four-choice questions "
            "(a ~400-token shared context, ~10-token continuations), 256 score-only requests, against "
            "transformers computing the same loglikelihoods (best batch of 8/32), plus the peak memory of "
            "one --memory-tokens prompt scored against the same prompt plain. n: 32 prompts (200-300 "
            "tokens) with n = 8 samples of 32 tokens, against the same 256 samples as single seeded "
            "jobs (prefix cache on in both; --requests sets the prompts). invariance: 1,000 jobs (greedy, "
            "seeded sampling with logprobs, structured, scoring, n) each alone and in mixes of 64 and 256 with "
            "chunked prefill, prefix-cache hits, preemption, 1 and 2 threads, async scheduling on and off: the "
            "share of jobs whose Results are the same bits everywhere, and batch_invariant's throughput cost on "
            "mixed (on and off alternated, --cost-rounds each). Every report also gives startup_s "
            "(from the process's start to its first engine ready) and first_result_s (from there to that "
            "engine's first finished request). Prints a table; --json writes the report."
        ),
    )
    p.add_argument("--workload", required=True,
                   choices=["mixed", "prefix", "kafka", "structured", "features", "score", "n", "invariance"])
    p.add_argument("--bootstrap-servers", default=None,
                   help="kafka workload: an existing broker (default: start a throw-away local one)")
    p.add_argument("--model", required=True, help="tiny-llama, smollm2 or a checkpoint directory")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON here")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="number of requests (default: 256 for mixed, structured and score, 128 for prefix; "
                   "score: a multiple of 4, one question per 4); small for quick runs")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch intra-op threads for both sides, the engine's --cpu-threads included "
                   "(default 1: shared small CPUs stall otherwise)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="structured and features: run each (constrained or feature, plain) pair of passes this "
                   "many times, in lockstep, and pool their step times (default 3)")
    p.add_argument("--memory-tokens", type=int, default=None, metavar="N",
                   help="score: prompt length of the memory figure (default 4096; 0 skips it)")
    p.add_argument("--cost-rounds", type=int, default=None, metavar="N",
                   help="invariance: runs of mixed with batch_invariant on and off each, alternated, for the cost "
                   "(default 2; 0 skips it)")
    p.add_argument("--full-sweep", action="store_true",
                   help="run every static batch size over the whole workload (default: calibrate on 64 requests)")
    add_engine_options(p, model_required=False, exclude=("cpu_threads",))  # --threads sets it
    p.set_defaults(func=run)


def model_problems(name: str, backend: str = "tokenmill") -> list[str]:
    """A bundled model name (tiny-llama is built on first use; smollm2 needs its package or its cached
    conversion) or a checkpoint folder, checked without torch."""
    if name == "tiny-llama":
        return []
    if name == "smollm2":
        from tokenmill.tools.smollm2 import unavailable_reason

        reason = unavailable_reason()
        return [f"--model smollm2: {reason}"] if reason else []
    return preflight.model(name, backend=backend)


def problems(args: argparse.Namespace) -> list[str]:
    """Everything wrong with the flags, the model and the report's path, found before torch loads;
    then, only when there is none, whether the given broker answers (the kafka workload)."""
    found = model_problems(args.model, args.backend)
    if args.json:
        found += preflight.output_file(args.json, "--json")
    if args.memory_tokens is not None and args.workload != "score":
        found.append("--memory-tokens is an option of --workload score")
    if args.cost_rounds is not None and args.workload != "invariance":
        found.append("--cost-rounds is an option of --workload invariance")
    if args.bootstrap_servers and args.workload != "kafka":
        found.append("--bootstrap-servers is an option of --workload kafka")
    if not found and args.workload == "kafka" and args.bootstrap_servers:
        found = preflight.broker(args.bootstrap_servers)
    return found


def run(args: argparse.Namespace) -> int:
    found = problems(args)
    if found:
        return preflight.fail("tokenmill bench", found)
    import torch

    from tokenmill.cli.engine_options import engine_kwargs
    from tokenmill.tools.bench import format_table, run_bench, write_json

    torch.set_num_threads(args.threads)
    options = engine_kwargs(args, exclude=("model", "cpu_threads"))
    options.pop("served_model_name")
    options["cpu_threads"] = args.threads
    if args.workload == "kafka":
        from tokenmill.tools.bench_kafka import format_kafka_table, run_kafka_bench

        report = run_kafka_bench(args.model, num_requests=args.requests, seed=args.workload_seed,
                                 engine_options=options, bootstrap=args.bootstrap_servers)
        report["threads"] = args.threads
        print(format_kafka_table(report))
        if args.json:
            write_json(report, args.json)
        return 0
    workload_options = None
    if args.workload == "score":
        workload_options = {"threads": args.threads}
        if args.memory_tokens is not None:
            workload_options["memory_tokens"] = args.memory_tokens
    if args.workload == "invariance" and args.cost_rounds is not None:
        workload_options = {"cost_rounds": args.cost_rounds}
    report = run_bench(
        args.workload, args.model, num_requests=args.requests, seed=args.workload_seed,
        engine_options=options, full_sweep=args.full_sweep, repeats=args.repeats,
        workload_options=workload_options,
    )
    report["threads"] = args.threads
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
    return 0
