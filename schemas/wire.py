"""Confluent's wire format: a record value framed with the id of its schema in a schema registry.

    value := 0x00 (magic byte) | schema id (4 bytes, big-endian, unsigned) | payload

The payload is the record as that schema's format writes it: JSON text for a JSON Schema, Avro's
binary encoding for an Avro schema. A plain JSON value starts with `{` (or whitespace), never
with a zero byte, so a reader tells the two apart by the first byte (`unframe`).
"""

from __future__ import annotations

import struct

MAGIC = 0
HEADER_BYTES = 5  # the magic byte and the schema id


class FramingError(ValueError):
    """A value that starts like a framed one but cannot be."""


def frame(schema_id: int, payload: bytes) -> bytes:
    if not 0 <= schema_id < 2**32:
        raise ValueError(f"schema id {schema_id} does not fit 4 bytes")
    return struct.pack(">bI", MAGIC, schema_id) + payload


def is_framed(value: bytes | None) -> bool:
    return bool(value) and value[0] == MAGIC  # type: ignore[index]


def unframe(value: bytes) -> tuple[int, bytes]:
    """(schema id, payload) of a framed value; FramingError when it is too short to be one."""
    if len(value) < HEADER_BYTES or value[0] != MAGIC:
        raise FramingError(f"a framed value has a magic byte 0 and a 4-byte schema id; this one has "
                           f"{len(value)} byte(s) starting {value[:HEADER_BYTES]!r}")
    _, schema_id = struct.unpack(">bI", value[:HEADER_BYTES])
    return schema_id, value[HEADER_BYTES:]
