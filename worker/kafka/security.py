"""Kafka connection security (SSL, SASL PLAIN / SCRAM) turned into aiokafka keyword arguments.

Secrets (SASL password, SSL key password) are held in `Secret`, whose repr and str never show the
value, so settings can be logged whole.
"""

from __future__ import annotations

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
