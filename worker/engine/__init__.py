"""tokenmill's inference engine: continuous batching over a paged KV cache with prefix caching.

Imports nothing from Kafka, pydantic schemas or boto3 (it must run alone on a GPU machine).
"""

from worker.engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestDelta,
    SamplingParams,
    TokenLogprob,
    Timing,
    Usage,
)

__all__ = [
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "RequestDelta",
    "SamplingParams",
    "TokenLogprob",
    "Timing",
    "Usage",
]
