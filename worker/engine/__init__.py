"""tokenmill's inference engine: continuous batching over a paged KV cache with prefix caching.

Imports nothing from Kafka, pydantic schemas or boto3 (it must run alone on a GPU machine).
``create_engine(config)`` makes the engine ``config.backend`` names: this one, or vLLM's behind the
same interface (worker/engine/backends/).
"""

from typing import TYPE_CHECKING

from tokenmill.engine.backends import EngineDied, EngineLike, create_engine
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.types import (
    EngineRequest,
    EngineStats,
    ErrorKind,
    FinishReason,
    PromptLogprob,
    RequestDelta,
    SamplingParams,
    Timing,
    TokenLogprob,
    Usage,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineDied",
    "EngineLike",
    "EngineRequest",
    "EngineStats",
    "ErrorKind",
    "FinishReason",
    "PromptLogprob",
    "RequestDelta",
    "SamplingParams",
    "TokenLogprob",
    "Timing",
    "Usage",
    "create_engine",
]

if TYPE_CHECKING:
    from tokenmill.engine.engine import Engine


def __getattr__(name: str):
    # Engine pulls in torch; loading it lazily keeps `import tokenmill.engine.types` (and the CLI) light.
    if name == "Engine":
        from tokenmill.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
