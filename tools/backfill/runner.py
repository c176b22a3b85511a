"""One backfill run: stream the dataset, submit the rows that have no result, collect results into
the on-disk store as they arrive, then write the ordered output.

The run is idempotent: everything it knows lives in the store, so Ctrl-C, a crash or a lost
machine cost only the work in flight; rerunning the same command picks up where it stopped.
Where the jobs run is a Backend (kafka_backend: through workers; local_backend: an engine in
this process).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from tokenmill.tools.backfill.backend import Backend
from tokenmill.tools.backfill.config import (
    BackfillConfig,
    BackfillIncomplete,
    Summary,
    dataset_identity,
    default_state_path,
    output_format_for,
)
from tokenmill.tools.backfill.constraints import OutputParser, check_compiles
from tokenmill.tools.backfill.datasets import count_rows, detect_format
from tokenmill.tools.backfill.identity import job_id_prefix
from tokenmill.tools.backfill.output import write_output
from tokenmill.tools.backfill.rows import RowPlanner, jobs_for
from tokenmill.tools.backfill.store import ResultStore


class _Progress:
    """tqdm bar: rows done (of the whole dataset), ETA, tokens/s."""

    def __init__(self, total: int, done: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="row", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True, desc="backfill")
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.new = 0

    def submitted(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def results(self, added: list[dict]) -> None:
        if not added:
            return
        self.new += len(added)
        self.last = time.monotonic()
        self.tokens += sum(int((r.get("usage") or {}).get("completion_tokens") or 0) for r in added)
        rate = self.tokens / max(1e-6, self.last - (self.first or self.start))
        self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        self.bar.update(len(added))

    def close(self) -> None:
        self.bar.close()


def make_backend(cfg: BackfillConfig, dataset_id: str) -> Backend:
    if cfg.engine == "local":
        from tokenmill.tools.backfill.local_backend import LocalBackend

        return LocalBackend(cfg)
    if cfg.engine == "kafka":
        from tokenmill.tools.backfill.kafka_backend import KafkaBackend

        return KafkaBackend(cfg, job_id_prefix(dataset_id))
    raise ValueError(f"--engine must be kafka or local, not {cfg.engine!r}")


async def run_backfill(cfg: BackfillConfig) -> Summary:
    from tokenmill.storage import local_input, local_output

    started = time.monotonic()
    check_compiles(cfg.spec.sampling)  # a constraint that fails every row fails the run instead
    out_fmt = output_format_for(cfg.output, cfg.output_format)
    if out_fmt == "openai" and cfg.spec.sampling.get("prompt_logprobs") is not None:
        # OpenAI writes prompt logprobs only echoed, with the prompt's token texts: not kept here.
        raise ValueError("--output-format openai cannot carry prompt_logprobs; use jsonl or parquet")
    state_path = Path(cfg.state) if cfg.state else default_state_path(cfg.output)
    dataset_id = dataset_identity(cfg.input, cfg.dataset_id)
    store = ResultStore(state_path)
    summary = Summary(state=str(state_path))
    backend = make_backend(cfg, dataset_id)
    progress = None
    try:
        model_id = await backend.start(store)
        config_fp = cfg.spec.fingerprint(model_id)
        store.set_meta("dataset_id", dataset_id)
        with local_input(cfg.input) as path:
            fmt = cfg.input_format or detect_format(cfg.input)
            total = count_rows(path, fmt)
            progress = _Progress(total, 0, cfg.progress)
            backend.on_results = progress.results
            planner = RowPlanner(cfg.spec, path, fmt, dataset_id, config_fp, cfg.key_column)
            for chunk in planner.chunks():
                todo = store.plan_rows(chunk, cfg.retry_failed)
                already = len(chunk) - len(set(todo))
                if already:
                    progress.bar.update(already)
                jobs, errors = jobs_for([chunk[i] for i in todo], cfg.spec, backend.model_name)
                if errors:
                    summary.invalid_rows += len(errors)
                    progress.results(store.add_results(errors))
                if jobs:
                    store.mark_submitted([row.number for row, _ in jobs])
                    progress.submitted()
                    await backend.submit([job for _, job in jobs])
                    summary.submitted += len(jobs)
            store.truncate_rows(planner.rows_seen)
        await backend.wait_done(cfg.timeout_s)
        counts = store.counts()
        if counts["pending"]:
            raise BackfillIncomplete(
                f"{counts['pending']} row(s) still without a result after {cfg.timeout_s}s; "
                "rerun the same command to resume"
            )
        store.prune_results()
        parser = OutputParser.for_sampling(cfg.spec.sampling) if out_fmt != "openai" else None
        with local_output(cfg.output) as tmp:
            samples = int(cfg.spec.sampling.get("n") or 1) > 1  # n > 1: the `texts` column
            written = write_output(store, tmp, out_fmt, parser, samples)
        if parser is not None:
            summary.parsed, summary.unparsed = parser.parsed, parser.unparsed
        if written != store.row_count():
            raise RuntimeError(f"wrote {written} rows for {store.row_count()} input rows")
        summary.output = cfg.output
    finally:
        if progress is not None:
            summary.new_results = progress.new
            summary.completion_tokens = progress.tokens
            if progress.first is not None and progress.last is not None:
                summary.generation_s = progress.last - progress.first
            progress.close()
        await backend.close()
        counts = store.counts()
        summary.rows = store.row_count()
        summary.ok, summary.error = counts["ok"], counts["error"]
        summary.expired, summary.pending = counts["expired"], counts["pending"]
        summary.elapsed_s = time.monotonic() - started
        store.close()
    return summary


def run_backfill_sync(cfg: BackfillConfig) -> Summary:
    return asyncio.run(run_backfill(cfg))


__all__ = ["BackfillConfig", "BackfillIncomplete", "Summary", "run_backfill", "run_backfill_sync"]
