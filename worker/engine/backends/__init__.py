"""The engines behind one interface: tokenmill's own (worker/engine/engine.py, the default and the
reference) and vLLM's (backends/vllm/, an adapter on vLLM V1's step API in this process).

Everything that runs requests (the worker's engine thread, run-batch and local backfill through the
offline runner, eval, bench) makes its engine with ``create_engine(config)``, which picks it by
``config.backend``, and uses it through ``EngineLike`` only: add a request, abort one, step, read the
deltas. So the worker's delivery (offsets committed after durable Results, exactly-once, dead
letters, crash counting, tenant fairness) is the same whichever engine computes the tokens.

Light on purpose: the engine thread imports EngineDied from here; neither torch nor vLLM loads
before ``create_engine`` is called, and vLLM only when the config asks for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.engine.backends.errors import EngineDied

__all__ = ["EngineDied", "EngineLike", "create_engine"]

if TYPE_CHECKING:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.types import EngineRequest, EngineStats, RequestDelta


class EngineLike(Protocol):
    """What callers use of an engine (tokenmill's Engine has more, for its own tests and tools)."""

    config: EngineConfig
    served_model_name: str
    max_model_len: int
    tokenizer: Any  # the model folder's tokenizer (transformers), which encodes every request
    metrics: Any  # EngineMetrics: benchmark counters (a backend fills those it can measure)

    def add(self, request: EngineRequest) -> None:
        """Queue a request; ValueError for one it refuses (the caller answers invalid_job)."""

    def abort(self, request_id: str) -> None:
        """End the request with ABORTED at the next step (unknown or finished ids are ignored)."""

    def step(self) -> list[RequestDelta]:
        """One step: the deltas it produced. EngineDied when the engine cannot go on."""

    def has_work(self) -> bool: ...

    def stats(self, drain_observations: bool = False) -> EngineStats: ...

    def count_prompt_tokens(self, request: EngineRequest) -> int: ...

    def generate(self, requests: Iterable[EngineRequest], progress: bool = False) -> dict[str, RequestDelta]:
        """Run requests to completion; each request's final delta by request_id."""


def create_engine(config: EngineConfig) -> EngineLike:
    """The engine `config.backend` names, loaded and ready (torch, and vLLM for its backend, load here)."""
    if config.backend == "vllm":
        from tokenmill.engine.backends.vllm.engine import VllmEngine

        return VllmEngine(config)
    from tokenmill.engine.engine import Engine

    return Engine(config)
