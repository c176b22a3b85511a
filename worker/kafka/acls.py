"""The Kafka ACLs each tokenmill client needs, and creating or listing them on a broker.

One list per role, the least each needs (everything else stays refused on a broker with
`allow.everyone.if.no.acl.found=false`):

- worker: READ on its jobs topic and its consumer group; WRITE, DESCRIBE and DESCRIBE_CONFIGS
  on the results, tokens and dead-letter topics (the last so it can read their
  max.message.bytes at start and size its requests by it; without it Kafka's default is
  assumed, and logged); IDEMPOTENT_WRITE on the cluster (its producer is idempotent); with
  --exactly-once also WRITE and DESCRIBE on its transactional ids, a prefixed pattern
  (transactions.py derives them from the group: `tokenmill.<group>.<topic>.<partition>`).
- producer (`tokenmill produce`): WRITE and DESCRIBE on the jobs topic (a prefixed pattern when
  the topic routes by `{model}`), IDEMPOTENT_WRITE on the cluster.
- reader (`tokenmill tail`): READ on the topics it follows; it assigns partitions itself, so no
  group.
- backfill (`--engine kafka`): the producer's list plus the reader's for the results topic.

READ and WRITE imply DESCRIBE in Kafka; DESCRIBE is still listed with WRITE so the list reads the
same as the kafka-acls commands in deploy/kafka/acls.sh, which a test holds equal to it.

aiokafka has no create_acls; the CreateAcls (v1) and DescribeAcls (v1) requests of its protocol
module are sent through its admin client here. Kafka 4 still serves both versions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from tokenmill.kafka.transactions import transactional_id


class ResourceType(IntEnum):  # Kafka's org.apache.kafka.common.resource.ResourceType codes
    ANY = 1
    TOPIC = 2
    GROUP = 3
    CLUSTER = 4
    TRANSACTIONAL_ID = 5


class Operation(IntEnum):
    """The operations tokenmill grants, with Kafka's AclOperation codes (ANY: a filter)."""

    ANY = 1
    READ = 3
    WRITE = 4
    DESCRIBE = 8
    DESCRIBE_CONFIGS = 10
    IDEMPOTENT_WRITE = 12

    @property
    def kafka_acls_name(self) -> str:  # READ -> Read, IDEMPOTENT_WRITE -> IdempotentWrite
        return self.name.title().replace("_", "")


class PatternType(IntEnum):  # org.apache.kafka.common.resource.PatternType
    ANY = 1
    LITERAL = 3
    PREFIXED = 4


_ALLOW = 3  # AclPermissionType.ALLOW; tokenmill only ever allows
_ANY_PERMISSION = 1
CLUSTER = "kafka-cluster"  # the one name of the cluster resource

# kafka-acls options of the resources.
_RESOURCE_OPTIONS = {ResourceType.TOPIC: "--topic", ResourceType.GROUP: "--group",
                     ResourceType.TRANSACTIONAL_ID: "--transactional-id"}


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW rule: `principal` may do `operation` on the resource, from any host."""

    principal: str  # "User:tokenmill-worker"
    resource: ResourceType
    name: str
    operation: Operation
    pattern: PatternType = PatternType.LITERAL

    def kafka_acls_args(self) -> list[str]:
        """The arguments of `kafka-acls.sh --add` that create this rule."""
        args = ["--allow-principal", self.principal, "--operation", self.operation.kafka_acls_name]
        if self.resource is ResourceType.CLUSTER:
            args.append("--cluster")
        else:
            args += [_RESOURCE_OPTIONS[self.resource], self.name]
        if self.pattern is PatternType.PREFIXED:
            args += ["--resource-pattern-type", "prefixed"]
        return args

    def describe(self) -> str:
        pattern = " (prefix)" if self.pattern is PatternType.PREFIXED else ""
        return f"{self.principal} {self.operation.name} {self.resource.name} {self.name}{pattern}"


def _user(principal: str) -> str:
    return principal if ":" in principal else f"User:{principal}"


def _writes(principal: str, resource: ResourceType, name: str,
            pattern: PatternType = PatternType.LITERAL) -> list[Acl]:
    return [Acl(principal, resource, name, op, pattern) for op in (Operation.WRITE, Operation.DESCRIBE)]


def transactional_id_prefix(group_id: str, jobs_topic: str) -> str:
    """The prefix every transactional id of this group's workers starts with."""
    prefix = f"tokenmill.{group_id}."
    # Very long group and topic names are shortened to a digest (transactions.py): then only the
    # common start is shared.
    return prefix if transactional_id(group_id, jobs_topic, 0).startswith(prefix) else "tokenmill."


def worker_acls(principal: str, *, group_id: str, jobs_topic: str, results_topic: str, tokens_topic: str,
                dlq_topic: str, exactly_once: bool = False) -> list[Acl]:
    p = _user(principal)
    acls = [Acl(p, ResourceType.TOPIC, jobs_topic, Operation.READ),
            Acl(p, ResourceType.GROUP, group_id, Operation.READ)]
    for topic in (results_topic, tokens_topic, dlq_topic):
        acls += _writes(p, ResourceType.TOPIC, topic)
        acls.append(Acl(p, ResourceType.TOPIC, topic, Operation.DESCRIBE_CONFIGS))
    acls.append(Acl(p, ResourceType.CLUSTER, CLUSTER, Operation.IDEMPOTENT_WRITE))
    if exactly_once:
        acls += _writes(p, ResourceType.TRANSACTIONAL_ID, transactional_id_prefix(group_id, jobs_topic),
                        PatternType.PREFIXED)
    return acls


def producer_acls(principal: str, jobs_topic: str) -> list[Acl]:
    """`tokenmill produce`; a jobs topic with {model} becomes a prefixed pattern."""
    p = _user(principal)
    if "{model}" in jobs_topic:
        prefix = jobs_topic.split("{model}", 1)[0]
        if not prefix:
            raise ValueError(f"--jobs-topic {jobs_topic!r}: a per-model topic needs a fixed start for its ACL")
        acls = _writes(p, ResourceType.TOPIC, prefix, PatternType.PREFIXED)
    else:
        acls = _writes(p, ResourceType.TOPIC, jobs_topic)
    return acls + [Acl(p, ResourceType.CLUSTER, CLUSTER, Operation.IDEMPOTENT_WRITE)]


def reader_acls(principal: str, topics: Iterable[str]) -> list[Acl]:
    """`tokenmill tail`: partitions assigned by hand, so READ on the topics and no group."""
    p = _user(principal)
    return [Acl(p, ResourceType.TOPIC, topic, Operation.READ) for topic in topics]


def backfill_acls(principal: str, jobs_topic: str, results_topic: str) -> list[Acl]:
    return producer_acls(principal, jobs_topic) + reader_acls(principal, [results_topic])


# ---------------------------------------------------------------------------------------------
# On a broker (through a principal allowed to change ACLs: a super user, or ALTER on the cluster)

def _requests() -> tuple[type, type]:
    from aiokafka.protocol.admin import CreateAclsRequest_v1, DescribeAclsRequest_v1
    from aiokafka.protocol.api import Request

    class CreateAcls(Request[CreateAclsRequest_v1]):
        API_KEY = 30

        def __init__(self, acls: list[Acl]) -> None:
            self._acls = acls

        def build(self, request_struct_class):
            return request_struct_class([(a.resource, a.name, a.pattern, a.principal, "*", a.operation, _ALLOW)
                                         for a in self._acls])

    class DescribeAcls(Request[DescribeAclsRequest_v1]):
        API_KEY = 29

        def __init__(self, principal: str | None) -> None:
            self._principal = principal

        def build(self, request_struct_class):
            return request_struct_class(ResourceType.ANY, None, PatternType.ANY, self._principal, None,
                                        Operation.ANY, _ANY_PERMISSION)

    return CreateAcls, DescribeAcls


async def _with_admin(bootstrap: str, client_options: Mapping[str, Any] | None, call):
    from aiokafka.admin import AIOKafkaAdminClient

    from tokenmill.kafka.security import start_checked

    options = dict(client_options or {})
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **options)
    try:
        await start_checked(admin, bootstrap, options)
        return await call(admin)
    finally:
        await admin.close()


async def create_acls(bootstrap: str, acls: Iterable[Acl], client_options: Mapping[str, Any] | None = None) -> None:
    """Create the rules (adding one that exists changes nothing); RuntimeError names any refused."""
    from aiokafka.errors import for_code

    acls = list(acls)
    if not acls:
        return
    create, _ = _requests()

    async def call(admin):
        response = await admin._send_request(create(acls))
        problems = [f"{acl.describe()}: {for_code(code).__name__} {message or ''}".strip()
                    for acl, (code, message) in zip(acls, response.creation_responses, strict=True) if code]
        if problems:
            raise RuntimeError("cannot create ACLs: " + "; ".join(problems))

    await _with_admin(bootstrap, client_options, call)


async def list_acls(bootstrap: str, principal: str | None = None,
                    client_options: Mapping[str, Any] | None = None) -> list[Acl]:
    """The ALLOW rules on the broker (of one principal, or all), sorted; rules of resource kinds or
    operations tokenmill never grants are left out."""
    from aiokafka.errors import for_code

    _, describe = _requests()

    async def call(admin):
        response = await admin._send_request(describe(_user(principal) if principal else None))
        if response.error_code:
            raise RuntimeError(f"cannot list ACLs: {for_code(response.error_code).__name__} {response.error_message}")
        found = []
        for resource_type, name, pattern, entries in response.resources:
            for who, _host, operation, permission in entries:
                known = resource_type in ResourceType._value2member_map_ and operation in Operation._value2member_map_
                if permission == _ALLOW and known:
                    found.append(Acl(who, ResourceType(resource_type), name, Operation(operation),
                                     PatternType(pattern)))
        return sorted(found)

    return await _with_admin(bootstrap, client_options, call)
