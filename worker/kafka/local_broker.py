"""A local single-node Apache Kafka (KRaft) driven from Python.

The work is done by ``deploy/kafka/kafka.sh`` (fetch jars, format storage once, launch the JVM,
wait until it answers, stop it cleanly); this class calls it and turns its outcome into Python
values and exceptions, so tests, the CLI and demos share one implementation.

A node keeps everything in its data directory (config, pid file, log, Kafka's log dir). Starting
again on the same directory keeps the topics and records.

By default the node is PLAINTEXT without an authorizer. Given a ``SaslSsl`` its client listener is
SASL_SSL (SCRAM-SHA-512 users created when the storage is formatted, a broker certificate signed
by a CA of our own, made with keytool by ``make_tls_files``) and every request needs an ACL
(StandardAuthorizer); worker/kafka/acls.py makes them.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenmill.kafka.security import KafkaSecurity, Secret

# The script lives in the source tree, two levels above this package.
_DEFAULT_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "kafka.sh"

# Exit codes of `kafka.sh status`.
_STATUS_RUNNING = 0
_STATUS_STOPPED = 3
_STATUS_NOT_ANSWERING = 4


class LocalKafkaError(RuntimeError):
    """The local broker could not be fetched, started or stopped; the message says why."""


@dataclass(frozen=True)
class BrokerStatus:
    running: bool  # the JVM of this data directory is alive and its listener accepts connections
    pid: int | None
    port: int | None
    message: str  # the script's one-line summary


@dataclass(frozen=True)
class SaslSsl:
    """What makes a node's client listener SASL_SSL with ACLs (`kafka.sh start --sasl-ssl`)."""

    tls_dir: Path  # the files of make_tls_files
    users: Mapping[str, str]  # SCRAM-SHA-512 users, created when the storage is formatted: name -> password
    super_user: str = "admin"  # one of users; may do anything, and the broker logs in to itself as it

    @property
    def ca_file(self) -> Path:
        return Path(self.tls_dir) / "ca.pem"

    def security(self, user: str, password: str | None = None) -> KafkaSecurity:
        """Client settings for one of the users (``password`` replaces theirs, e.g. to try a wrong one)."""
        return KafkaSecurity(protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username=user,
                             sasl_password=Secret(self.users[user] if password is None else password),
                             ssl_cafile=str(self.ca_file))


def make_tls_files(tls_dir: str | os.PathLike[str], days: int = 30) -> Path:
    """A CA and a broker key store signed by it (for 127.0.0.1 and localhost), made with Java's
    keytool into tls_dir unless they are there already; returns the CA certificate (PEM) that
    clients trust."""
    _run_script(["tls", "--dir", str(tls_dir), "--days", str(days)], timeout=300, what="tls")
    return Path(tls_dir) / "ca.pem"


def default_data_dir() -> Path:
    """Where `tokenmill kafka start` keeps its node when no --data-dir is given."""
    cache = os.environ.get("TOKENMILL_CACHE") or os.path.join(Path.home(), ".cache", "tokenmill")
    return Path(cache) / "kafka" / "data"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kafka_script() -> Path:
    """The control script; TOKENMILL_KAFKA_SCRIPT points elsewhere (e.g. an installed copy)."""
    script = Path(os.environ.get("TOKENMILL_KAFKA_SCRIPT") or _DEFAULT_SCRIPT)
    if not script.is_file():
        raise LocalKafkaError(
            f"Kafka control script not found at {script}; run from a source checkout or set "
            "TOKENMILL_KAFKA_SCRIPT to deploy/kafka/kafka.sh"
        )
    return script


class LocalKafka:
    """One single-node Kafka bound to 127.0.0.1.

    ``port`` None means: the port recorded in the data directory by an earlier start, else 9092.
    ``controller_port`` None means: the recorded one, else a free port.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        controller_port: int | None = None,
        sasl_ssl: SaslSsl | None = None,
    ) -> None:
        for name, value in (("port", port), ("controller_port", controller_port)):
            if value is not None and not 0 < int(value) < 65536:
                raise ValueError(f"{name} must be in 1..65535, got {value}")
        self.port = port
        self.controller_port = controller_port
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.sasl_ssl = sasl_ssl

    # -- control ---------------------------------------------------------------------------
    def start(
        self, timeout: float = 120.0, owner_pid: int | None = None, auto_create_topics: bool = True
    ) -> str:
        """Start the node (no-op if it already runs) and return its bootstrap address.

        With ``owner_pid`` the node stops itself once that process is gone, so a test session
        that is killed does not leave a JVM behind. ``auto_create_topics`` False makes a
        produce to an unknown topic fail instead of creating a one-partition topic.
        """
        args = ["start", "--data-dir", str(self.data_dir), "--timeout", str(int(timeout)),
                "--auto-create-topics", "true" if auto_create_topics else "false"]
        if self.port is not None:
            args += ["--port", str(self.port)]
        if self.controller_port is not None:
            args += ["--controller-port", str(self.controller_port)]
        if owner_pid is not None:
            args += ["--owner-pid", str(owner_pid)]
        if self.sasl_ssl is not None:
            args += self._sasl_ssl_args(self.sasl_ssl)
        self._run(args, timeout=timeout + 60, what="start")
        recorded = self._recorded_ports()
        self.port = recorded.get("port", self.port)
        self.controller_port = recorded.get("controller_port", self.controller_port)
        return self.bootstrap

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the node: SIGTERM (a clean shutdown), SIGKILL after ``timeout`` seconds."""
        self._run(["stop", "--data-dir", str(self.data_dir), "--timeout", str(int(timeout))],
                  timeout=timeout + 30, what="stop")

    def status(self) -> BrokerStatus:
        proc = subprocess.run(
            ["bash", str(kafka_script()), "status", "--data-dir", str(self.data_dir)],
            capture_output=True, text=True, timeout=30,
        )
        message = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
        summary = message[-1] if message else ""
        if proc.returncode not in (_STATUS_RUNNING, _STATUS_STOPPED, _STATUS_NOT_ANSWERING):
            raise LocalKafkaError(f"kafka status failed (exit {proc.returncode}): {proc.stderr.strip()}")
        pid = None
        if proc.returncode != _STATUS_STOPPED:
            try:
                pid = int((self.data_dir / "kafka.pid").read_text().strip())
            except (OSError, ValueError):
                pid = None
        return BrokerStatus(
            running=proc.returncode == _STATUS_RUNNING,
            pid=pid,
            port=self._recorded_ports().get("port", self.port),
            message=summary,
        )

    def fetch(self) -> None:
        """Copy the Kafka jars into the cache if they are not there yet."""
        self._run(["fetch"], timeout=900, what="fetch")

    # -- addresses -------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        port = self.port if self.port is not None else self._recorded_ports().get("port", 9092)
        return f"127.0.0.1:{port}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "kafka.log"

    # -- internals -------------------------------------------------------------------------
    def _recorded_ports(self) -> dict[str, int]:
        path = self.data_dir / "ports"
        if not path.is_file():
            return {}
        ports: dict[str, int] = {}
        for line in path.read_text().splitlines():
            key, _, value = line.partition("=")
            if key in ("port", "controller_port") and value.isdigit():
                ports[key] = int(value)
        return ports

    def _sasl_ssl_args(self, sasl_ssl: SaslSsl) -> list[str]:
        """The start options of a SASL_SSL node; the users go in a file only the owner can read."""
        if sasl_ssl.super_user not in sasl_ssl.users:
            raise ValueError(f"the super user {sasl_ssl.super_user!r} must be one of the SCRAM users")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        users_file = self.data_dir / "scram-users"
        fd = os.open(users_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{name}={password}\n" for name, password in sasl_ssl.users.items())
        return ["--sasl-ssl", str(sasl_ssl.tls_dir), "--scram-users", str(users_file),
                "--super-user", sasl_ssl.super_user]

    def _run(self, args: list[str], timeout: float, what: str) -> str:
        return _run_script(args, timeout, what)

    def __repr__(self) -> str:
        return f"LocalKafka(port={self.port}, data_dir={str(self.data_dir)!r})"


def _run_script(args: list[str], timeout: float, what: str) -> str:
    try:
        proc = subprocess.run(
            ["bash", str(kafka_script()), *args],
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise LocalKafkaError(f"kafka {what} did not finish within {timeout:.0f}s") from exc
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip())[-4000:]
        raise LocalKafkaError(f"kafka {what} failed (exit {proc.returncode}):\n{detail}")
    return proc.stdout
