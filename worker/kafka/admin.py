"""Create Kafka topics idempotently with aiokafka's admin client.

`ensure_topics` is what a worker or tool calls at start-up: every topic it names exists afterwards
with the requested partition count and has a leader for every partition (so the first produce or
fetch does not race topic creation). An existing topic is accepted when its partition count
matches; a different count is an error, because tokenmill relies on partition numbers (the
dead-letter topic mirrors the jobs topic's partitions, and keys map to partitions by count).

Topic metadata is read with a request for *all* topics on purpose: a metadata request naming a
topic asks the broker to auto-create it when `auto.create.topics.enable` is on, which would
mask a missing topic with a one-partition one.

Sync callers (CLI, pytest fixtures) use `ensure_topics_sync` / `create_topic_sync`, which also
work from inside a running event loop (they run the coroutine on a helper thread then).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

# Kafka's own rule for topic names (kafka.common.internals.Topic).
_TOPIC_NAME = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")
_TOPIC_ALREADY_EXISTS = 36

T = TypeVar("T")


class TopicError(RuntimeError):
    """A topic could not be created or does not have the shape that was asked for."""


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int = 1
    replication_factor: int = 1  # a local single node needs 1; use 3 on a production cluster
    config: Mapping[str, str] = field(default_factory=dict)  # e.g. {"retention.ms": "86400000"}

    def validate(self) -> None:
        if not _TOPIC_NAME.match(self.name) or self.name in (".", ".."):
            raise TopicError(
                f"invalid topic name {self.name!r}: use 1..249 characters from a-z A-Z 0-9 . _ -"
            )
        if int(self.partitions) < 1:
            raise TopicError(f"topic {self.name}: partitions must be >= 1, got {self.partitions}")
        if int(self.replication_factor) < 1:
            raise TopicError(
                f"topic {self.name}: replication factor must be >= 1, got {self.replication_factor}"
            )
        for key, value in self.config.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TopicError(f"topic {self.name}: config {key!r}={value!r}: keys and values are strings")


def _as_specs(topics: Iterable[TopicSpec | str] | Mapping[str, int]) -> list[TopicSpec]:
    if isinstance(topics, Mapping):
        specs = [TopicSpec(name, partitions) for name, partitions in topics.items()]
    else:
        specs = [t if isinstance(t, TopicSpec) else TopicSpec(t) for t in topics]
    seen: dict[str, TopicSpec] = {}
    for spec in specs:
        spec.validate()
        if spec.name in seen and seen[spec.name] != spec:
            raise TopicError(f"topic {spec.name} is listed twice with different settings")
        seen[spec.name] = spec
    return list(seen.values())


async def ensure_topics(
    bootstrap: str,
    topics: Iterable[TopicSpec | str] | Mapping[str, int],
    *,
    timeout: float = 30.0,
    client_options: Mapping[str, Any] | None = None,
) -> None:
    """Make every topic exist with its partition count and a leader for each partition.

    ``topics``: TopicSpec objects, bare names (1 partition) or a mapping name -> partitions.
    ``client_options``: extra AIOKafkaAdminClient arguments (security settings).
    Raises TopicError with the broker's reason when a topic cannot be created, or when an
    existing topic has a different partition count.
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import for_code

    specs = _as_specs(topics)
    if not specs:
        return
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=int(timeout * 1000),
        **dict(client_options or {}),
    )
    deadline = time.monotonic() + timeout
    try:
        await admin.start()
        response = await admin.create_topics(
            [NewTopic(s.name, int(s.partitions), int(s.replication_factor), topic_configs=dict(s.config))
             for s in specs],
            timeout_ms=int(timeout * 1000),
        )
        refused: dict[str, str] = {}
        for entry in response.topic_errors:
            name, code = entry[0], entry[1]
            message = entry[2] if len(entry) > 2 else None
            if code in (0, _TOPIC_ALREADY_EXISTS):
                continue
            err = for_code(code)
            refused[name] = f"{err.__name__} ({message or err.description})"
        if refused:
            # A principal without CREATE permission (usual in production) is refused even for
            # topics that exist; those are fine if their partition count is right.
            metadata = await admin.describe_topics(None)
            problems = unresolved_refusals(refused, metadata, {s.name: int(s.partitions) for s in specs})
            if problems:
                raise TopicError("cannot create topics: " + "; ".join(problems))
        await _wait_until_ready(admin, specs, deadline)
    finally:
        await admin.close()


def unresolved_refusals(refused: Mapping[str, str], metadata: list[dict], wanted: Mapping[str, int]) -> list[str]:
    """The refused creations that still matter: those whose topic is not already there with the
    wanted partition count. ``metadata``: aiokafka's describe_topics() entries."""
    present = {t["topic"]: len(t["partitions"]) for t in metadata if t["error_code"] == 0}
    return [f"{name}: {reason}" for name, reason in refused.items() if present.get(name) != wanted[name]]


async def _wait_until_ready(admin: Any, specs: list[TopicSpec], deadline: float) -> None:
    """Poll metadata until each topic shows its partitions, all with a leader."""
    wanted = {s.name: int(s.partitions) for s in specs}
    while True:
        pending: dict[str, str] = {}
        by_name = {t["topic"]: t for t in await admin.describe_topics(None)}
        for name, partitions in wanted.items():
            meta = by_name.get(name)
            if meta is None or meta["error_code"] != 0:
                pending[name] = "not in the metadata yet"
                continue
            have = len(meta["partitions"])
            if have != partitions:
                raise TopicError(
                    f"topic {name} exists with {have} partitions, but {partitions} were asked for; "
                    "tokenmill needs the exact count (delete the topic or ask for its count)"
                )
            leaderless = [p["partition"] for p in meta["partitions"] if p["leader"] < 0]
            if leaderless:
                pending[name] = f"partitions {leaderless} have no leader yet"
        if not pending:
            return
        if time.monotonic() >= deadline:
            detail = "; ".join(f"{n}: {why}" for n, why in pending.items())
            raise TopicError(f"topics not ready in time: {detail}")
        await asyncio.sleep(0.1)


async def create_topic(
    bootstrap: str,
    name: str,
    partitions: int = 1,
    config: Mapping[str, str] | None = None,
    *,
    replication_factor: int = 1,
    timeout: float = 30.0,
    client_options: Mapping[str, Any] | None = None,
) -> None:
    """Create one topic, or accept it when it already exists with ``partitions`` partitions."""
    spec = TopicSpec(name, partitions, replication_factor, dict(config or {}))
    await ensure_topics(bootstrap, [spec], timeout=timeout, client_options=client_options)


async def topic_config_values(
    bootstrap: str,
    topics: Iterable[str],
    key: str,
    *,
    timeout: float = 15.0,
    client_options: Mapping[str, Any] | None = None,
) -> dict[str, str | None]:
    """The value of one config ``key`` (e.g. ``max.message.bytes``) of each topic, as the broker
    applies it (the topic's own setting or the broker's default); None for a topic whose config
    cannot be read (it does not exist, or the principal may not describe its configs).

    Raises KafkaConnectionError while no broker answers, so a caller can wait for one."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
    from aiokafka.errors import KafkaConnectionError, KafkaError

    from tokenmill.kafka.security import start_checked

    names = list(dict.fromkeys(topics))
    values: dict[str, str | None] = dict.fromkeys(names)
    if not names:
        return values
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000),
                                **dict(client_options or {}))
    try:
        # Refused credentials raise KafkaAccessDenied (security.py), not a connection error to wait out.
        await start_checked(admin, bootstrap, dict(client_options or {}))
        try:
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, name, {key: None}) for name in names])
        except KafkaConnectionError:
            raise
        except KafkaError:
            return values  # refused as a whole (e.g. no DescribeConfigs permission at all)
        for response in responses:
            for error_code, _message, _type, name, entries, *_ in response.resources:
                if error_code == 0 and name in values:
                    values[name] = next((entry[1] for entry in entries if entry[0] == key), None)
    finally:
        await admin.close()
    return values


async def delete_topics(bootstrap: str, names: Iterable[str], *, timeout: float = 30.0) -> None:
    """Delete topics; a topic that does not exist is not an error."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import for_code

    names = list(names)
    if not names:
        return
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000))
    try:
        await admin.start()
        response = await admin.delete_topics(names, timeout_ms=int(timeout * 1000))
        unknown_topic = 3
        problems = [
            f"{name}: {for_code(code).__name__}"
            for name, code, *_ in response.topic_error_codes
            if code not in (0, unknown_topic)
        ]
        if problems:
            raise TopicError("cannot delete topics: " + "; ".join(problems))
    finally:
        await admin.close()


def run_sync(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, even if this thread has a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the calling thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="tokenmill-admin", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def ensure_topics_sync(bootstrap: str, topics: Iterable[TopicSpec | str] | Mapping[str, int], **kw: Any) -> None:
    run_sync(ensure_topics(bootstrap, topics, **kw))


def create_topic_sync(
    bootstrap: str, name: str, partitions: int = 1, config: Mapping[str, str] | None = None, **kw: Any
) -> None:
    run_sync(create_topic(bootstrap, name, partitions, config, **kw))
