"""The markdown report (gpu_check.md): a table of sections with one headline each, then the
kernel checks, attention runs, decode steps and the traceback of every failed section."""

from __future__ import annotations

from typing import Any


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def markdown_report(report: dict) -> str:
    s = report["sections"]
    lines = ["# tokenmill gpu_check", ""]
    env = s.get("environment", {})
    lines.append(f"- device: {env.get('gpu', env.get('device'))}; torch {env.get('torch')}, triton {env.get('triton')}, "
                 f"transformers {env.get('transformers')}; dry run: {report['dry_run']}")
    lines.append(f"- total: {report['seconds']:.1f} s; sections failed: {', '.join(report['failed']) or 'none'}")
    lines.append("")
    lines.append("| section | ok | seconds | headline |")
    lines.append("|---|---|---|---|")
    for name, res in s.items():
        lines.append(f"| {name} | {'yes' if res.get('ok') else 'NO'} | {res.get('seconds')} | {headline(name, res)} |")
    k = s.get("kernels", {})
    if k.get("checks"):
        lines += ["", "## kernels", "", "| check | dtype | max error | tolerance | ok |", "|---|---|---|---|---|"]
        for c in k["checks"]:
            err = _fmt(c["max_err"]) if c.get("max_err") is not None else c.get("error", "")
            lines.append(f"| {c['check']} | {c['dtype']} | {err} | {c['tol']:g} | {'yes' if c['ok'] else 'NO'} |")
    a = s.get("attention", {})
    if a.get("runs"):
        lines += ["", "## attention (decode, KV bytes read per second)", "",
                  "| run | ms | GB/s | fraction of copy |", "|---|---|---|---|"]
        for r in a["runs"]:
            lines.append(f"| {r['label']} | {_fmt(r['ms'])} | {_fmt(r['bytes_per_s'] / 1e9)} | {_fmt(r['fraction_of_copy'])} |")
    d = s.get("decode_step", {})
    if d.get("runs"):
        lines += ["", "## decode step (~1B Llama)", "",
                  "| batch | step ms | roofline ms | roofline / step | tok/s | graph step ms | roofline / graph step |",
                  "|---|---|---|---|---|---|---|"]
        for r in d["runs"]:
            graph = (f"{_fmt(r['graph_step_ms'])} | {_fmt(r['graph_roofline_over_step'])}" if "graph_step_ms" in r
                     else f"{r.get('graph_error', '')[:120]} | ")
            lines.append(f"| {r['batch']} | {_fmt(r['step_ms'])} | {_fmt(r['roofline_ms'])} | "
                         f"{_fmt(r['roofline_over_step'])} | {_fmt(r['tokens_per_s'])} | {graph} |")
    for name, res in s.items():
        if not res.get("ok") and res.get("error"):
            lines += ["", f"## {name} failed", "", "```", res.get("traceback", res["error"]).strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _gpu_path_note(res: dict) -> str:
    return f"cuda graphs {res['cuda_graphs']}, async scheduling {'on' if res['async_scheduling'] in (True, 'on') else 'off'}"


def headline(name: str, res: dict) -> str:
    """One line on a section's result, for the report's table."""
    if not res.get("ok"):
        return f"error: {res.get('error', 'failed checks')}"[:200].replace("|", "/")
    if name == "kernels":
        return f"{res['passed']} passed, {res['failed']} failed"
    if name == "copy_bandwidth":
        return f"{_fmt(res['gb_per_s'])} GB/s (read + write)"
    if name == "attention":
        return f"best {_fmt(res['best_fraction_of_copy'])} of copy bandwidth"
    if name == "decode_step":
        return "; ".join(
            f"b{r['batch']}: {_fmt(r['step_ms'])} ms, roofline/step {_fmt(r['roofline_over_step'])}"
            + (f" (graph {_fmt(r['graph_step_ms'])} ms, {_fmt(r['graph_roofline_over_step'])})" if "graph_step_ms" in r else "")
            for r in res["runs"])
    if name == "throughput":
        return (f"{_fmt(res['output_tok_s'])} output tok/s, {_fmt(res['fraction_of_ceiling'])} of ceiling "
                f"{_fmt(res['ceiling_tok_s'])} tok/s; {_gpu_path_note(res)}, "
                f"{res['graph_steps']}/{res['engine_steps']} steps as graphs")
    if name == "mixed":
        return (f"engine {_fmt(res['engine_output_tok_s'])} tok/s vs transformers {_fmt(res['baseline_output_tok_s'])} "
                f"(batch {res['baseline_batch']}): ratio {_fmt(res['ratio'])}; {_gpu_path_note(res)}")
    if name == "structured":
        return (f"{res['peak_running']} constrained rows: step {_fmt(res['step_ms_constrained'])} ms vs "
                f"{_fmt(res['step_ms_unconstrained'])} ms unconstrained ({100 * res['step_overhead_fraction']:+.1f}%); "
                f"mask p50/p99 {_fmt(res['mask_ms_p50'])}/{_fmt(res['mask_ms_p99'])} ms, compile p50/p99 "
                f"{_fmt(res['compile_ms_p50'])}/{_fmt(res['compile_ms_p99'])} ms; valid {res['valid']}/{res['stop']} "
                f"stop ({res['length']} length), whitespace runs {res['whitespace_runs']}; {_gpu_path_note(res)}")
    if name == "fidelity":
        def eq(key: str) -> str:
            return f"{res[key]['equal']}/{res[key]['of']}"
        return (f"greedy sequences equal: GPU path vs transformers {eq('gpu_path_vs_transformers')}, plain engine vs "
                f"transformers {eq('plain_vs_transformers')}, GPU path vs plain engine {eq('gpu_path_vs_plain')}; "
                f"{_gpu_path_note(res)}, {res['graph_steps']}/{res['engine_steps']} steps as graphs")
    if name == "environment":
        return str(res.get("gpu", res.get("device")))
    return ""

