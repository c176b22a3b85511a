"""`tokenmill backfill`: push a whole dataset through tokenmill, one Job per row, resumably.

Modules: datasets (streaming readers), identity (stable job ids), jobs (row -> validated Job),
rows (the planned rows, and their jobs), store (sqlite state: rows, results, result-topic
offsets), output (ordered writer), config (settings, summary, defaults), backend (the interface
of where jobs run), kafka_backend and local_backend (its two kinds), runner (the run).
"""

from tokenmill.tools.backfill.config import BackfillConfig, BackfillIncomplete, Summary
from tokenmill.tools.backfill.jobs import JobSpec
from tokenmill.tools.backfill.runner import run_backfill, run_backfill_sync

__all__ = ["BackfillConfig", "BackfillIncomplete", "JobSpec", "Summary", "run_backfill", "run_backfill_sync"]
