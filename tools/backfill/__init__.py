"""`tokenmill backfill`: push a whole dataset through tokenmill, one Job per row, resumably.

Modules: datasets (streaming readers), identity (stable job ids), jobs (row -> Job), store
(sqlite state: rows, results, result-topic offsets), output (ordered writer), runner (the run).
"""

from tools.backfill.jobs import JobSpec
from tools.backfill.runner import BackfillConfig, BackfillIncomplete, Summary, run_backfill, run_backfill_sync

__all__ = ["BackfillConfig", "BackfillIncomplete", "JobSpec", "Summary", "run_backfill", "run_backfill_sync"]
