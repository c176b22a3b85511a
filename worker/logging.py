"""Structured JSON logs (structlog): one object per line on stderr.

Every line about a job carries job_id, partition and offset (bind them with `job_log`), so a
job's whole story can be found with one grep.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import FilteringBoundLogger

_configured = False


def configure_logging(level: str = "INFO") -> None:
    global _configured
    numeric = getattr(logging, level.upper(), None)
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    logging.basicConfig(stream=sys.stderr, level=max(numeric, logging.WARNING), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str = "tokenmill") -> FilteringBoundLogger:
    return structlog.get_logger(name)


def job_log(log: FilteringBoundLogger, job_id: str | None, partition: int, offset: int) -> FilteringBoundLogger:
    """A logger bound to one input record."""
    return log.bind(job_id=job_id, partition=partition, offset=offset)
