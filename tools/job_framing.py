"""Jobs as the clients write them to a jobs topic (`produce`, backfill's and eval's Kafka backend).

Without a schema registry a Job is its plain JSON, as ever. With one, it is framed in Confluent's
wire format (schemas/wire.py) with the id of the Job's JSON Schema (the contract's own export),
registered under the topic-name strategy's subject `<jobs topic>-value` on the first Job sent to
that topic: a `{model}` topic template gives each model's topic its own subject. The worker reads
such a Job through its JobReader (worker/kafka/registry.py).

A jobs subject created here gets BACKWARD compatibility: the worker, the Jobs' reader, is
upgraded first, and a newer Job schema must still read the Jobs written under the older ones
(schemas/compat.py holds the contract to it: a Job field is never removed or narrowed without a
new CONTRACT_VERSION). A subject that exists keeps its rule; one that refuses the contract's Job
schema stops the run with the registry's reason (RegistryError).
"""

from __future__ import annotations

from tokenmill.kafka.registry import RegistryClient, RegistrySettings, value_subject
from tokenmill.schemas.export import render
from tokenmill.schemas.wire import frame

JOBS_COMPATIBILITY = "BACKWARD"


class JobFraming:
    """The bytes a Job is written as, per jobs topic: plain JSON, or framed with its schema id."""

    def __init__(self, settings: RegistrySettings | None) -> None:
        self.client = RegistryClient(settings) if settings is not None else None
        self._schema_ids: dict[str, int] = {}  # jobs topic -> the Job schema's id under its subject

    async def value(self, topic: str, job_json: bytes) -> bytes:
        """A Job's JSON bytes as written to ``topic`` (RegistryError, RegistryUnreachable: the
        schema could not be registered)."""
        if self.client is None:
            return job_json
        schema_id = self._schema_ids.get(topic)
        if schema_id is None:
            schema_id = await self.client.ensure_subject(value_subject(topic), render("job"), "JSON",
                                                         compatibility=JOBS_COMPATIBILITY)
            self._schema_ids[topic] = schema_id
        return frame(schema_id, job_json)
