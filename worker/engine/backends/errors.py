"""The one error an engine raises for itself rather than for a request."""

from __future__ import annotations


class EngineDied(RuntimeError):
    """The engine cannot go on: its core died, or a step stopped answering. Never a request's fault:
    the process must end, so that the consumer group hands its jobs to another member (where crash
    counting applies), instead of answering them with errors or hanging."""
