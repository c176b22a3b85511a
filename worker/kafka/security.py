"""Kafka connection security (SSL, SASL PLAIN / SCRAM) turned into aiokafka keyword arguments,
and what a client does when the broker refuses it.

Secrets (SASL password, SSL key password) are held in `Secret`, whose repr and str never show the
value, so settings can be logged whole.

Refusals (second half): refused SASL credentials, a broker certificate that is not trusted, a
missing ACL. `access_denied(exc)` recognises them in any exception aiokafka raises (or its cause)
and turns them into a `KafkaAccessDenied` with one clear message and an exit code of its own;
`check_credentials` and `start_checked` find the real reason when aiokafka only says "Unable to
bootstrap"; `check_topic_access` names every topic the principal may not describe, with the ACL
each needs, in one message.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class Secret:
    """A string that does not print itself."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('****')"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return bool(self._value)


@dataclass
class KafkaSecurity:
    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: Secret | None = field(default=None)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_key_password: Secret | None = None
    ssl_check_hostname: bool = True

    def validate(self) -> None:
        """Raise ValueError naming every problem with the combination of options."""
        problems = []
        if self.protocol not in SECURITY_PROTOCOLS:
            problems.append(f"security protocol {self.protocol!r} is not one of {', '.join(SECURITY_PROTOCOLS)}")
        uses_sasl = self.protocol.startswith("SASL_")
        if uses_sasl:
            if self.sasl_mechanism not in SASL_MECHANISMS:
                problems.append(f"{self.protocol} needs --sasl-mechanism, one of {', '.join(SASL_MECHANISMS)}")
            if not self.sasl_username or not self.sasl_password:
                problems.append(f"{self.protocol} needs --sasl-username and a password")
        elif self.sasl_mechanism or self.sasl_username or self.sasl_password:
            problems.append("SASL options given but --security-protocol is not SASL_PLAINTEXT or SASL_SSL")
        if not self.protocol.endswith("SSL") and (self.ssl_cafile or self.ssl_certfile or self.ssl_keyfile):
            problems.append("SSL files given but --security-protocol is not SSL or SASL_SSL")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            problems.append("--ssl-certfile and --ssl-keyfile go together (client certificate and its key)")
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                problems.append(f"--{name.replace('_', '-')} {path}: no such file")
        if problems:
            raise ValueError("Kafka security settings: " + "; ".join(problems))

    def aiokafka_kwargs(self) -> dict:
        """Keyword arguments for AIOKafkaConsumer / AIOKafkaProducer / admin clients."""
        self.validate()
        kwargs: dict = {"security_protocol": self.protocol}
        if self.protocol.endswith("SSL"):
            from aiokafka.helpers import create_ssl_context

            ctx = create_ssl_context(
                cafile=self.ssl_cafile,
                certfile=self.ssl_certfile,
                keyfile=self.ssl_keyfile,
                password=self.ssl_key_password.reveal() if self.ssl_key_password else None,
            )
            ctx.check_hostname = self.ssl_check_hostname
            kwargs["ssl_context"] = ctx
        if self.protocol.startswith("SASL_"):
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password.reveal() if self.sasl_password else None
        return kwargs

    def describe(self) -> dict:
        """What may be logged: everything except secret values."""
        return {
            "security_protocol": self.protocol,
            "sasl_mechanism": self.sasl_mechanism,
            "sasl_username": self.sasl_username,
            "sasl_password": "****" if self.sasl_password else None,
            "ssl_cafile": self.ssl_cafile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_check_hostname": self.ssl_check_hostname,
        }


def read_secret(value: str | None, file: str | None, what: str) -> Secret | None:
    """A secret from a flag/env value or from a file (first line, e.g. a mounted Kubernetes Secret)."""
    if value and file:
        raise ValueError(f"give the {what} either directly or as a file, not both")
    if file:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read the {what} file {file}: {exc.strerror}") from None
        return Secret(text.splitlines()[0] if text else "")
    return Secret(value) if value else None


# ---------------------------------------------------------------------------------------------
# When the broker says no: refused credentials, an untrusted certificate, a missing ACL.
#
# None of these gets better by trying again, so every retry loop asks `access_denied(exc)` first
# and stops when it answers; the commands then print the message and exit with its code.

EXIT_NOT_AUTHENTICATED = 76  # SASL credentials refused, or the TLS handshake failed
EXIT_NOT_AUTHORIZED = 77  # an ACL is missing for a topic, a group, a transactional id or the cluster

_ACLS_HINT = "see 'Credentials and ACLs' in docs/operations.md"


class KafkaAccessDenied(Exception):
    """The broker refused who we are or what we asked; the message names what and how to fix it."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _names(exc: Exception) -> str:
    """The topic, group or transactional id an aiokafka error carries, for a message."""
    if not exc.args:
        return ""
    arg = exc.args[0]
    if isinstance(arg, (set, frozenset, list, tuple)):
        return ", ".join(sorted(map(str, arg)))
    return str(arg) if isinstance(arg, str) else ""


# TLS errors of the connection itself (closed, reset), not of the handshake's outcome.
_TLS_TRANSPORT_ERRORS = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError, ssl.SSLWantReadError,
                         ssl.SSLWantWriteError)


def _topics_denied(listed: str) -> KafkaAccessDenied:
    return KafkaAccessDenied(f"not authorized for topic {listed}: the broker has no ACL allowing this principal "
                             f"to use it (TOPIC_AUTHORIZATION_FAILED); {_ACLS_HINT}", EXIT_NOT_AUTHORIZED)


def access_denied(exc: BaseException) -> KafkaAccessDenied | None:
    """The access problem behind exc (exc itself, or its explicit causes: `raise ... from`), or None
    for any other failure. Only what no retry can change counts: a connection cut during a TLS
    handshake (a broker restarting) is an outage, not a refusal."""
    from aiokafka import errors

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, KafkaAccessDenied):
            return current
        if isinstance(current, errors.TopicAuthorizationFailedError):
            return _topics_denied(_names(current) or "(unnamed)")
        if isinstance(current, errors.GroupAuthorizationFailedError):
            return KafkaAccessDenied(
                f"not authorized for consumer group {_names(current) or '(unnamed)'}: it needs a READ ACL for "
                f"this principal (GROUP_AUTHORIZATION_FAILED); {_ACLS_HINT}", EXIT_NOT_AUTHORIZED)
        if isinstance(current, errors.TransactionalIdAuthorizationFailed):
            return KafkaAccessDenied(
                f"not authorized for transactional id {_names(current) or '(unnamed)'}: --exactly-once needs "
                f"WRITE and DESCRIBE on its transactional ids (TRANSACTIONAL_ID_AUTHORIZATION_FAILED); "
                f"{_ACLS_HINT}", EXIT_NOT_AUTHORIZED)
        if isinstance(current, errors.ClusterAuthorizationFailedError):
            return KafkaAccessDenied(
                "not authorized for a cluster operation: an idempotent producer needs IDEMPOTENT_WRITE on the "
                f"cluster (CLUSTER_AUTHORIZATION_FAILED); {_ACLS_HINT}", EXIT_NOT_AUTHORIZED)
        if isinstance(current, (errors.SaslAuthenticationFailed, errors.AuthenticationFailedError)):
            detail = _names(current) or "the credentials were refused"
            return KafkaAccessDenied(f"authentication failed: {detail}; check the SASL user name and password",
                                     EXIT_NOT_AUTHENTICATED)
        if isinstance(current, (errors.UnsupportedSaslMechanismError, errors.IllegalSaslStateError,
                                errors.AuthenticationMethodNotSupported)):
            detail = _names(current) or current.__class__.__name__
            return KafkaAccessDenied(f"authentication failed: {detail} (check --sasl-mechanism against the "
                                     "broker's sasl.enabled.mechanisms)", EXIT_NOT_AUTHENTICATED)
        if isinstance(current, ssl.SSLCertVerificationError):
            reason = current.verify_message or str(current)
            hint = ("the certificate does not name this host"
                    if "mismatch" in reason.lower() or "hostname" in reason.lower()
                    else "give the CA that signed it with --ssl-cafile")
            return KafkaAccessDenied(f"TLS handshake failed: the broker's certificate is not trusted ({reason}); "
                                     f"{hint}", EXIT_NOT_AUTHENTICATED)
        if isinstance(current, ssl.SSLError) and not isinstance(current, _TLS_TRANSPORT_ERRORS):
            return KafkaAccessDenied(f"TLS handshake failed: {current.reason or current} (is the listener "
                                     "TLS, and is --security-protocol right?)", EXIT_NOT_AUTHENTICATED)
        current = current.__cause__
    return None


_CONNECTION_OPTIONS = ("security_protocol", "ssl_context", "sasl_mechanism", "sasl_plain_username",
                       "sasl_plain_password")


async def check_credentials(bootstrap_servers: str, client_kwargs: dict, timeout_s: float = 10.0) -> bool:
    """Open one connection to a bootstrap server with these settings (aiokafka keyword arguments).

    Raises KafkaAccessDenied when the broker refuses the SASL credentials or the TLS handshake
    fails; returns True once one server accepted them, False when none could be reached (a broker
    away is not this check's business: the clients wait or fail as they do). aiokafka itself only
    logs such a refusal and reports "Unable to bootstrap", which reads like a broker outage.
    A PLAINTEXT connection has nothing to check.
    """
    if client_kwargs.get("security_protocol", "PLAINTEXT") == "PLAINTEXT":
        return True
    from aiokafka.conn import collect_hosts, create_conn

    options = {k: client_kwargs[k] for k in _CONNECTION_OPTIONS if k in client_kwargs}
    for host, port, _family in collect_hosts(bootstrap_servers, randomize=False):
        try:
            conn = await create_conn(host, port, request_timeout_ms=int(timeout_s * 1000), **options)
        except Exception as exc:
            denied = access_denied(exc)
            if denied is not None:
                who = options.get("sasl_plain_username")
                where = f"SASL user {who!r}, broker {host}:{port}" if who else f"broker {host}:{port}"
                raise KafkaAccessDenied(f"{denied} ({where})", denied.exit_code) from None
            continue
        conn.close()
        return True
    return False


async def start_checked(client, bootstrap_servers: str, client_kwargs: dict) -> None:
    """`await client.start()` (an aiokafka producer, consumer or admin client), the credentials
    checked first: refused ones raise KafkaAccessDenied, which is not a KafkaError, so no retry
    loop takes it for an outage, and the client is closed again. Any other failure of the start
    (the broker away) is raised as it was, the client left for the caller to try again."""
    from aiokafka.errors import KafkaConnectionError

    try:
        reached = await check_credentials(bootstrap_servers, client_kwargs)
        try:
            await client.start()
        except KafkaConnectionError:
            if not reached:  # the broker may have come up in between: did it refuse us?
                await check_credentials(bootstrap_servers, client_kwargs)
            raise
    except KafkaAccessDenied:
        try:
            await (client.stop() if hasattr(client, "stop") else client.close())
        except Exception:
            pass
        raise


async def refused_topics(client, topics) -> list[str]:
    """The topics this principal may not even describe (TOPIC_AUTHORIZATION_FAILED), read with a
    metadata request that never auto-creates one; [] when the broker cannot be asked right now.

    One request names them all, so a start-up can report every refused topic with the ACL it
    needs, instead of the first one a client trips over; and a reader that lists all topics
    (tools/kafka_topics.py) can tell a refused topic from a missing one, since the broker leaves
    topics the principal may not describe out of that list.
    ``client``: an aiokafka client (``producer.client``, ``consumer._client``), started.
    """
    from aiokafka.errors import KafkaError, TopicAuthorizationFailedError
    from aiokafka.protocol.metadata import MetadataRequest

    node = client.get_random_node()
    if node is None:
        return []
    try:
        response = await client.send(node, MetadataRequest(list(topics), allow_auto_topic_creation=False))
    except KafkaError:
        return []
    return sorted(t[1] for t in response.topics if t[0] == TopicAuthorizationFailedError.errno)


async def check_topic_access(client, needs: dict[str, str]) -> None:
    """Raise KafkaAccessDenied naming every topic of ``needs`` (topic -> the ACL it needs, e.g.
    "READ") that the principal cannot describe."""
    refused = await refused_topics(client, needs)
    if refused:
        raise _topics_denied(", ".join(f"{topic} (needs {needs[topic]})" for topic in refused))
