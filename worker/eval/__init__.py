"""lm-evaluation-harness on tokenmill: the evaluation model (``lm.TokenmillLM``), the in-process
runner of its Jobs (``local_runner.LocalJobRunner``) and the local task files (``TASKS_DIR``).

lm-eval is an optional dependency (the ``eval`` extra); only ``lm`` imports it, so this package
and ``TASKS_DIR`` import without it.
"""

from pathlib import Path

# The shipped tasks (tokenmill_mc, tokenmill_ppl, tokenmill_gen): pass it as lm-eval's include path.
TASKS_DIR = Path(__file__).resolve().parent / "tasks"

__all__ = ["TASKS_DIR"]
