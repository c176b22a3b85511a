"""Schema Registry framing, opt in (`--schema-registry URL`): what tokenmill writes and reads.

With a registry, every record tokenmill writes is in Confluent's wire format (schemas/wire.py)
with the contract's own schemas, registered under the topic-name strategy:

| record | subject | schema |
|---|---|---|
| Result | `<results topic>-value` | the Result's JSON Schema, or its Avro schema (`--result-format avro`) |
| TokenEvent | `<tokens topic>-value` | the TokenEvent's JSON Schema |
| dead letter | `<dlq topic>-tokenmill.error` | the DeadLetter JSON Schema, in the `tokenmill.error` header |
| Job (`produce`, `backfill`) | `<jobs topic>-value` | the Job's JSON Schema |

A dead letter's value stays the input's bytes, unchanged (the contract); its metadata (code,
message, source, worker) goes, framed, in the `tokenmill.error` header beside the plain
`tokenmill.error.*` and `tokenmill.source.*` headers.

An output subject that does not exist yet is created with FORWARD compatibility: tokenmill's
outputs only ever gain optional fields (schemas/compat.py keeps it so), and FORWARD is the rule
under which a reader of an older version keeps reading newer records. A subject that exists keeps
its rule; a schema it refuses stops the worker at start with the subject and the registry's reason.

Reading a Job (`JobReader`): a value that starts with `{` (or whitespace) is plain JSON, as
before. A framed value's schema id must name a JSON Schema registered under the jobs topic's
subject (whose compatibility rule the registry enforced when the producer registered it); a
schema id the registry does not know, one of another format, or one registered only under
other subjects is bad input: a dead letter with the reason, as for any bad Job. The payload is
then decoded like a plain Job (the contract's decoder is the judge of the fields). Schema ids are
looked up once and kept; the fetcher looks up a batch's new ids before intake sees them, and
while the registry does not answer it reads the batch again later (nothing is dead-lettered for
an outage).

Reading a Result (`ResultReader`, for `tail`, `backfill` and `eval`): plain JSON, framed JSON,
or framed Avro (decoded with the writer's schema from the registry) all give the Result's JSON
form.

The registry's credentials are like the broker's: HTTP basic auth (user and password, also from
the URL's user-info) and TLS (a CA file; a client certificate and key for mutual TLS).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.schemas.avro import AvroResults, avro_schema
from tokenmill.schemas.errors import JobDecodeError
from tokenmill.schemas.export import render
from tokenmill.schemas.json_text import job_id_of, load_json
from tokenmill.schemas.wire import FramingError, frame, is_framed, unframe

RESULT_FORMATS = ("json", "avro")
DEAD_LETTER_HEADER = "tokenmill.error"
_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


def value_subject(topic: str) -> str:
    """The topic-name strategy's subject of a topic's values."""
    return f"{topic}-value"


def dead_letter_subject(dlq_topic: str) -> str:
    return f"{dlq_topic}-{DEAD_LETTER_HEADER}"


@dataclass(frozen=True)
class RegistrySettings:
    url: str  # the registry's Confluent API base, e.g. http://registry:8081 (Apicurio: .../apis/ccompat/v7)
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log line or a traceback
    ca_file: str | None = None  # trust this CA (TLS)
    cert_file: str | None = None  # client certificate (mutual TLS)
    key_file: str | None = None
    result_format: str = "json"  # Results as JSON Schema or Avro
    timeout_s: float = 10.0

    def problems(self) -> list[str]:
        out = []
        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme not in ("http", "https"):
            out.append(f"--schema-registry must be an http:// or https:// URL, got {self.url!r}")
        if self.result_format not in RESULT_FORMATS:
            out.append(f"--result-format must be one of {', '.join(RESULT_FORMATS)}")
        if bool(self.username) != bool(self.password):
            out.append("--schema-registry-user and --schema-registry-password go together")
        if bool(self.cert_file) != bool(self.key_file):
            out.append("--schema-registry-cert and --schema-registry-key go together")
        return out

    def describe(self) -> dict[str, Any]:
        """For the log: no password, no user-info."""
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        url = urllib.parse.urlunsplit((parts.scheme, host + (f":{parts.port}" if parts.port else ""),
                                       parts.path, "", ""))
        return {"url": url, "auth": bool(self.username or parts.username), "tls": parts.scheme == "https",
                "result_format": self.result_format}


class RegistryError(Exception):
    """The registry answered with an error."""

    def __init__(self, status: int, message: str, code: int | None = None) -> None:
        super().__init__(f"schema registry: HTTP {status}: {message}")
        self.status = status
        self.code = code
        self.message = message


class RegistryUnreachable(Exception):
    """No answer from the registry (connection refused, timeout)."""


@dataclass(frozen=True)
class RegisteredSchema:
    schema_id: int
    schema_type: str  # JSON, AVRO or PROTOBUF
    text: str


class RegistryClient:
    """Confluent's Schema Registry REST API, the calls tokenmill needs. Blocking calls run on a
    thread (`await client.x(...)`); answers about schema ids are kept (ids never change meaning)."""

    def __init__(self, settings: RegistrySettings) -> None:
        parts = urllib.parse.urlsplit(settings.url)
        self.base = urllib.parse.urlunsplit((parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""),
                                             parts.path.rstrip("/"), "", ""))
        user = settings.username or (urllib.parse.unquote(parts.username) if parts.username else None)
        password = settings.password or (urllib.parse.unquote(parts.password) if parts.password else None)
        self._auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode() if user else None
        self._timeout = settings.timeout_s
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._ssl = ssl.create_default_context(cafile=settings.ca_file)
            if settings.cert_file:
                self._ssl.load_cert_chain(settings.cert_file, settings.key_file)
        self._schemas: dict[int, RegisteredSchema | None] = {}  # None: the registry does not know the id
        self._subjects: dict[int, set[str]] = {}

    # -- blocking calls ---------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Accept", _CONTENT_TYPE)
        if data is not None:
            req.add_header("Content-Type", _CONTENT_TYPE)
        if self._auth:
            req.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._ssl) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                answer = json.loads(raw)
                message, code = str(answer.get("message", raw[:200])), answer.get("error_code")
            except (ValueError, AttributeError):
                message, code = raw[:200].decode(errors="replace") or exc.reason, None
            raise RegistryError(exc.code, message, code) from None
        except (urllib.error.URLError, OSError) as exc:
            raise RegistryUnreachable(f"schema registry {self.base} does not answer: {exc}") from exc

    def register_now(self, subject: str, text: str, schema_type: str) -> int:
        body = {"schema": text, "schemaType": schema_type}
        return int(self.request("POST", f"/subjects/{urllib.parse.quote(subject, safe='')}/versions", body)["id"])

    def schema_now(self, schema_id: int) -> RegisteredSchema | None:
        if schema_id not in self._schemas:
            try:
                answer = self.request("GET", f"/schemas/ids/{schema_id}")
                self._schemas[schema_id] = RegisteredSchema(schema_id, answer.get("schemaType") or "AVRO",
                                                            answer["schema"])
            except RegistryError as exc:
                if exc.status != 404:
                    raise
                self._schemas[schema_id] = None
        return self._schemas[schema_id]

    def subjects_now(self, schema_id: int) -> set[str]:
        if schema_id not in self._subjects:
            try:
                self._subjects[schema_id] = set(self.request("GET", f"/schemas/ids/{schema_id}/subjects"))
            except RegistryError as exc:
                if exc.status != 404:
                    raise
                self._subjects[schema_id] = set()
        return self._subjects[schema_id]

    def ensure_subject_now(self, subject: str, text: str, schema_type: str, compatibility: str | None) -> int:
        """Register text under subject; a subject created here gets `compatibility` first."""
        quoted = urllib.parse.quote(subject, safe="")
        if compatibility is not None:
            try:
                self.request("GET", f"/subjects/{quoted}/versions")
            except RegistryError as exc:
                if exc.status != 404:
                    raise
                try:
                    self.request("PUT", f"/config/{quoted}", {"compatibility": compatibility})
                except RegistryError:
                    pass  # not allowed to configure: the registry's default rule applies
        try:
            return self.register_now(subject, text, schema_type)
        except RegistryError as exc:
            if exc.status == 409:
                raise RegistryError(409, f"subject {subject} refuses tokenmill's {schema_type} schema as "
                                         f"incompatible with its earlier versions ({exc.message}); tokenmill's "
                                         f"outputs evolve under FORWARD compatibility", exc.code) from None
            raise

    # -- on the event loop --------------------------------------------------------------------
    async def ensure_subject(self, subject: str, text: str, schema_type: str,
                             compatibility: str | None = "FORWARD") -> int:
        return await asyncio.to_thread(self.ensure_subject_now, subject, text, schema_type, compatibility)

    async def schema(self, schema_id: int) -> RegisteredSchema | None:
        if schema_id in self._schemas:
            return self._schemas[schema_id]
        return await asyncio.to_thread(self.schema_now, schema_id)

    async def subjects(self, schema_id: int) -> set[str]:
        if schema_id in self._subjects:
            return self._subjects[schema_id]
        return await asyncio.to_thread(self.subjects_now, schema_id)

    async def lookup(self, schema_id: int) -> None:
        """Fetch what the registry says of a schema id (its schema, its subjects), once."""
        if await self.schema(schema_id) is None:
            self._subjects[schema_id] = set()
        else:
            await self.subjects(schema_id)

    def known(self, schema_id: int) -> bool:
        return schema_id in self._schemas and schema_id in self._subjects

    def cached(self, schema_id: int) -> tuple[RegisteredSchema | None, set[str]]:
        """What lookup() found (None and no subjects when it was not looked up or is unknown)."""
        return self._schemas.get(schema_id), self._subjects.get(schema_id, set())


# -- writing ----------------------------------------------------------------------------------
@dataclass
class Framing:
    """How tokenmill's outputs are written: plain JSON (no registry), or framed with schema ids."""

    result_id: int | None = None
    token_event_id: int | None = None
    dead_letter_id: int | None = None
    avro: AvroResults | None = None  # Results in Avro
    _avro_parsed: Any = field(default=None, repr=False)

    @classmethod
    async def register(cls, client: RegistryClient, *, results_topic: str, tokens_topic: str, dlq_topic: str,
                       result_format: str = "json") -> Framing:
        """Register the output schemas (topic-name strategy) and return the framing that uses them."""
        out = cls()
        if result_format == "avro":
            import fastavro

            out.avro = AvroResults()
            out._avro_parsed = fastavro.parse_schema(out.avro.schema)
            out.result_id = await client.ensure_subject(value_subject(results_topic), json.dumps(avro_schema()),
                                                        "AVRO")
        else:
            out.result_id = await client.ensure_subject(value_subject(results_topic), render("result"), "JSON")
        out.token_event_id = await client.ensure_subject(value_subject(tokens_topic), render("token-event"), "JSON")
        out.dead_letter_id = await client.ensure_subject(dead_letter_subject(dlq_topic), render("dead-letter"), "JSON")
        return out

    @property
    def framed(self) -> bool:
        return self.result_id is not None

    def result(self, value: bytes) -> bytes:
        """A Result's JSON bytes as written to the results topic."""
        if self.result_id is None:
            return value
        if self.avro is None:
            return frame(self.result_id, value)
        import fastavro

        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, self._avro_parsed, self.avro.to_avro(json.loads(value)))
        return frame(self.result_id, buf.getvalue())

    def token_event(self, value: bytes) -> bytes:
        return value if self.token_event_id is None else frame(self.token_event_id, value)

    def decode_result(self, value: bytes) -> dict[str, Any]:
        """A Result this framing wrote, back to its JSON form."""
        if self.result_id is None:
            return json.loads(value)
        _, payload = unframe(value)
        if self.avro is None:
            return json.loads(payload)
        import fastavro

        return self.avro.from_avro(fastavro.schemaless_reader(io.BytesIO(payload), self._avro_parsed))  # type: ignore[arg-type]

    def dead_letter_headers(self, info: bytes) -> list[tuple[str, bytes]]:
        """The framed dead-letter metadata header (none without a registry)."""
        return [] if self.dead_letter_id is None else [(DEAD_LETTER_HEADER, frame(self.dead_letter_id, info))]


PLAIN = Framing()


async def open_registry(settings: RegistrySettings | None, *, jobs_topic: str, results_topic: str,
                        tokens_topic: str, dlq_topic: str) -> tuple[Framing, JobReader]:
    """The worker's framing and Job reader: plain without a registry; with one, the output
    schemas registered (RegistryError, RegistryUnreachable: the worker cannot start)."""
    if settings is None:
        return Framing(), JobReader(None, jobs_topic)
    client = RegistryClient(settings)
    framing = await Framing.register(client, results_topic=results_topic, tokens_topic=tokens_topic,
                                     dlq_topic=dlq_topic, result_format=settings.result_format)
    return framing, JobReader(client, jobs_topic)


# -- reading ----------------------------------------------------------------------------------
class JobReader:
    """Jobs from the jobs topic: plain JSON, or framed with a schema of the jobs topic's subject."""

    def __init__(self, client: RegistryClient | None, jobs_topic: str) -> None:
        self.client = client
        self.subject = value_subject(jobs_topic)

    async def resolve(self, values: Iterable[bytes | None]) -> bool:
        """Look up the schema ids of framed values not seen before; False while the registry does
        not answer (the caller reads those records again later)."""
        if self.client is None:
            return True
        for value in values:
            if not is_framed(value) or len(value) < 5:  # type: ignore[arg-type]
                continue
            schema_id, _ = unframe(value)  # type: ignore[arg-type]
            if self.client.known(schema_id):
                continue
            try:
                await self.client.lookup(schema_id)
            except RegistryUnreachable:
                return False
        return True

    def needs_lookup(self, value: bytes | None) -> bool:
        if self.client is None or not is_framed(value) or len(value) < 5:  # type: ignore[arg-type]
            return False
        return not self.client.known(unframe(value)[0])  # type: ignore[arg-type]

    def payload(self, value: bytes) -> bytes:
        """The Job's JSON bytes; JobDecodeError (invalid_job) for a framed value that is not a Job
        of this topic. Plain values pass through unchanged."""
        if not is_framed(value):
            return value
        try:
            schema_id, payload = unframe(value)
        except FramingError as exc:
            raise JobDecodeError.invalid(str(exc)) from None
        if self.client is None:
            raise JobDecodeError.invalid(f"the value is framed with schema id {schema_id} (Confluent's wire "
                                         "format) and this worker has no --schema-registry to look it up")
        schema, subjects = self.client.cached(schema_id)
        if schema is None:
            raise JobDecodeError.invalid(f"schema id {schema_id} is not known to the schema registry",
                                         _readable_job_id(payload))
        if schema.schema_type != "JSON":
            raise JobDecodeError.invalid(f"schema id {schema_id} is a {schema.schema_type} schema; Jobs are "
                                         "read as JSON (JSON Schema)", _readable_job_id(payload))
        if self.subject not in subjects:
            where = ", ".join(sorted(subjects)) or "no subject"
            raise JobDecodeError.invalid(f"schema id {schema_id} is not a schema of subject {self.subject} "
                                         f"(registered under {where}): not compatible with this topic's Jobs",
                                         _readable_job_id(payload))
        return payload


def _readable_job_id(payload: bytes) -> str | None:
    """The job_id of a refused framed Job whose payload is still JSON naming one (the contract: bad
    input gets an error Result when its job_id can be read); None for any other payload."""
    try:
        return job_id_of(load_json(payload, id_of=job_id_of))
    except JobDecodeError as err:
        return err.job_id


class ResultReader:
    """Results as their JSON form (a dict), from plain JSON, framed JSON or framed Avro."""

    def __init__(self, client: RegistryClient | None) -> None:
        self.client = client
        self._avro: dict[int, Any] = {}
        self._results = AvroResults()

    async def decode(self, value: bytes) -> dict[str, Any]:
        """ValueError for a value that is none of them."""
        if not is_framed(value):
            return json.loads(value)
        schema_id, payload = unframe(value)
        if self.client is None:
            raise ValueError(f"a framed value (schema id {schema_id}): give --schema-registry to read it")
        schema = await self.client.schema(schema_id)
        if schema is None:
            raise ValueError(f"schema id {schema_id} is not known to the schema registry")
        if schema.schema_type == "JSON":
            return json.loads(payload)
        if schema.schema_type != "AVRO":
            raise ValueError(f"schema id {schema_id} is a {schema.schema_type} schema")
        import fastavro

        if schema_id not in self._avro:
            self._avro[schema_id] = fastavro.parse_schema(json.loads(schema.text))
        record = fastavro.schemaless_reader(io.BytesIO(payload), self._avro[schema_id])
        return self._results.from_avro(record)  # type: ignore[arg-type]
