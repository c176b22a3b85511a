"""What one backfill run is told (BackfillConfig), what it reports (Summary), and the defaults
derived from the config: the state file, the output format, the dataset identity."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.tools.backfill.jobs import JobSpec
from tokenmill.tools.backfill.output import OUTPUT_FORMATS

if TYPE_CHECKING:
    from tokenmill.kafka.registry import RegistrySettings


@dataclass
class BackfillConfig:
    input: str
    output: str
    spec: JobSpec
    engine: str = "kafka"  # kafka | local
    input_format: str | None = None
    output_format: str | None = None  # jsonl | parquet | openai (default: from the output name)
    dataset_id: str | None = None
    key_column: str | None = None
    state: str | None = None
    retry_failed: bool = False
    timeout_s: float | None = None
    progress: bool = True
    # Kafka engine
    bootstrap_servers: str | None = None
    jobs_topic: str = "tokenmill.jobs"
    results_topic: str = "tokenmill.results"
    kafka_options: dict[str, Any] = field(default_factory=dict)  # security kwargs for aiokafka
    registry: RegistrySettings | None = None  # Jobs framed, framed Results read (kafka_backend.py)
    # Local engine
    model_path: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)  # extra EngineConfig fields
    max_in_flight: int = 64


@dataclass
class Summary:
    rows: int = 0
    ok: int = 0
    error: int = 0
    expired: int = 0
    pending: int = 0
    submitted: int = 0
    invalid_rows: int = 0
    new_results: int = 0
    completion_tokens: int = 0
    parsed: int = 0  # with a json/choice constraint: ok rows whose output parsed (the `parsed` column)
    unparsed: int = 0  # ... and ok rows whose output did not (cut by max_tokens): null there
    elapsed_s: float = 0.0
    generation_s: float = 0.0  # first result of this run -> last (tokens/s is measured over it)
    output: str | None = None
    state: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.generation_s if self.generation_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        return d

    def render(self) -> str:
        return (
            f"backfill: {self.rows} rows -> ok {self.ok}, error {self.error}, expired {self.expired}"
            + (f", pending {self.pending}" if self.pending else "")
            + (f"; parsed {self.parsed}, unparsed {self.unparsed}" if self.parsed or self.unparsed else "")
            + f"; submitted {self.submitted} job(s) this run, {self.new_results} new result(s), "
            f"{self.completion_tokens} tokens in {self.elapsed_s:.1f}s ({self.tokens_per_s:.1f} tok/s)"
            + (f"; output {self.output}" if self.output else "")
        )


class BackfillIncomplete(RuntimeError):
    """Rows are still without a result (timeout); the state is kept, a rerun resumes."""


def default_state_path(output: str) -> Path:
    from tokenmill.storage import is_s3_url
    from tokenmill.storage.checkpoint import cache_root

    if is_s3_url(output):
        digest = hashlib.sha256(output.encode()).hexdigest()[:16]
        return cache_root() / "backfill" / f"{digest}.sqlite"
    return Path(output).expanduser().with_name(Path(output).name + ".state.sqlite")


def output_format_for(output: str, given: str | None) -> str:
    if given:
        if given not in OUTPUT_FORMATS:
            raise ValueError(f"--output-format must be one of {', '.join(OUTPUT_FORMATS)}")
        if given == "openai" and output.lower().endswith((".parquet", ".pq")):
            raise ValueError("--output-format openai writes JSON lines; name the output .jsonl")
        return given
    return "parquet" if output.lower().endswith((".parquet", ".pq")) else "jsonl"


def dataset_identity(location: str, given: str | None) -> str:
    if given:
        return given
    from tokenmill.storage import is_s3_url

    return location if is_s3_url(location) else str(Path(location).expanduser().resolve())
