"""The run: every section in order (each through run_section, so one failing never stops the
others), sections not started within the time budget reported as skipped, then the JSON report
(gpu_check.json) and the markdown one (gpu_check.md) written to --out. Exit 0 when no section
failed, 1 when one did, 2 when there is no CUDA device (and no --dry-run)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from tokenmill.tools.gpu_check.attention import section_attention
from tokenmill.tools.gpu_check.context import Context, run_section
from tokenmill.tools.gpu_check.copy_bandwidth import section_copy_bandwidth
from tokenmill.tools.gpu_check.decode_step import section_decode_step
from tokenmill.tools.gpu_check.environment import section_environment
from tokenmill.tools.gpu_check.fidelity import section_fidelity
from tokenmill.tools.gpu_check.invariance import section_invariance
from tokenmill.tools.gpu_check.kernel_checks import section_kernels
from tokenmill.tools.gpu_check.mixed import section_mixed
from tokenmill.tools.gpu_check.report import markdown_report
from tokenmill.tools.gpu_check.sizes import dry_sizes, gpu_sizes
from tokenmill.tools.gpu_check.structured import section_structured
from tokenmill.tools.gpu_check.throughput import section_throughput

DESCRIPTION = "One prepared command that measures tokenmill's GPU path and writes a JSON and a markdown report."

SECTIONS: list[tuple[str, Callable[[Context], dict]]] = [
    ("environment", section_environment),
    ("kernels", section_kernels),
    ("fidelity", section_fidelity),
    ("copy_bandwidth", section_copy_bandwidth),
    ("attention", section_attention),
    ("invariance", section_invariance),
    ("decode_step", section_decode_step),
    ("mixed", section_mixed),
    ("throughput", section_throughput),
    ("structured", section_structured),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=DESCRIPTION)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                        help="folder for gpu_check.json and gpu_check.md (default: $OUT or ./gpu_check_out)")
    parser.add_argument("--dry-run", action="store_true", help="same code path on the CPU at toy sizes")
    parser.add_argument("--only", nargs="+", choices=[name for name, _ in SECTIONS], help="run only these sections")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="sections not started within this many seconds are reported as skipped (default 450)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # The interpreter must be on before any kernel module defines its @triton.jit functions.
        os.environ["TRITON_INTERPRET"] = "1"
    for var, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("TRANSFORMERS_VERBOSITY", "error"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(var, value)
    import torch

    if args.dry_run:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --dry-run on a CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
    sizes = dry_sizes() if args.dry_run else gpu_sizes()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        ctx = Context(sizes=sizes, device=device, workdir=Path(tmp))
        for name, fn in SECTIONS:
            if args.only and name not in args.only:
                continue
            if name == "copy_bandwidth" and name in ctx.results:
                continue  # measured already on demand
            if time.perf_counter() - t0 > args.budget_s:
                ctx.results[name] = {"ok": False, "skipped": True, "seconds": 0.0,
                                     "error": f"not started: the {args.budget_s:.0f} s budget was spent"}
                continue
            ctx.results[name] = run_section(name, fn, ctx)
    order = [name for name, _ in SECTIONS if name in ctx.results]
    report = dict(
        dry_run=sizes.dry_run, sizes=asdict(sizes), seconds=time.perf_counter() - t0,
        sections={name: ctx.results[name] for name in order},
        failed=[name for name in order if not ctx.results[name].get("ok")],
    )
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(markdown_report(report))
    print(f"[gpu_check] report: {out / 'gpu_check.md'}; failed sections: {report['failed'] or 'none'}")
    return 0 if not report["failed"] else 1
