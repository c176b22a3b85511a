"""What a command checks before it imports torch or loads a model: its files, its model, its broker.

A command that loads a model spends seconds on imports and on the load before it reads its input,
so a missing input file, an output folder it cannot write or a model folder without weights used
to fail only after all that. The checks here run first: each returns the problems it found as
one-line messages that name the flag or the path (an empty list when all is well); a command
gathers every problem at once and exits with code 2 (``fail``) before anything heavy runs.

Nothing here imports torch, transformers or aiokafka: a local model folder is checked by its file
names and its config.json (tokenmill.engine.checkpoint_files), an ``s3://`` model by one listing
and one small read, a broker by one TCP connection to its bootstrap servers. The checks that go
over the network (remote_model, broker) come second: a command runs them only when the local ones
found nothing, as it would fail anyway.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path

EXIT_BAD_USAGE = 2
STDIO = "-"
BROKER_TIMEOUT_S = 5.0


def fail(prog: str, problems: Iterable[str]) -> int:
    """Print each problem as one line (``prog: problem``) on stderr; the exit code for them (2)."""
    for problem in problems:
        print(f"{prog}: {problem}", file=sys.stderr)
    return EXIT_BAD_USAGE


def input_file(path: str, what: str) -> list[str]:
    """A file the command reads: it exists, is a file and is readable ('-' is stdin)."""
    if path == STDIO:
        return []
    p = Path(path).expanduser()
    if not p.exists():
        return [f"{what} {path}: no such file"]
    if p.is_dir():
        return [f"{what} {path}: a folder, not a file"]
    if not os.access(p, os.R_OK):
        return [f"{what} {path}: not readable"]
    return []


def output_file(path: str, what: str, *, input_path: str | None = None) -> list[str]:
    """A file the command writes (its missing folders made then): not a folder, not the input it
    reads, and the file or its nearest existing folder writable."""
    p = Path(path).expanduser()
    if p.is_dir():
        return [f"{what} {path}: a folder, not a file"]
    if input_path not in (None, STDIO) and p.exists() and p.resolve() == Path(input_path).expanduser().resolve():
        return [f"{what} {path} is the input file: writing it would erase what is being read"]
    if p.exists():
        return [] if os.access(p, os.W_OK) else [f"{what} {path}: not writable"]
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return [f"{what} {path}: {parent} is a file, not a folder"]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [f"{what} {path}: folder {parent} is not writable"]
    return []


def folder(path: str, what: str) -> list[str]:
    """A folder the command reads."""
    p = Path(path).expanduser()
    if not p.exists():
        return [f"{what} {path}: not a folder (nothing is there)"]
    if not p.is_dir():
        return [f"{what} {path}: a file, not a folder"]
    return []


def model(model_arg: str, what: str = "--model", *, weights: bool = True, backend: str | None = "tokenmill") -> list[str]:
    """A local checkpoint folder: config.json of an architecture the engine serves, a tokenizer and,
    with ``weights``, the weights (``weights=False``: a command that needs only the tokenizer and
    config). ``backend``: the engine that will load it; tokenmill's serves the architectures of
    tokenmill.engine.checkpoint_files, another ("vllm", or None where the engine is not known here,
    as for a fleet's workers) any, and .bin weights too. An ``s3://`` model is remote_model's; here
    only its URL is read."""
    from tokenmill.storage.s3 import is_s3_url, parse_s3_url

    if is_s3_url(model_arg):
        try:
            parse_s3_url(model_arg)
        except ValueError as exc:
            return [f"{what}: {exc}"]
        return []
    from tokenmill.engine.checkpoint_files import checkpoint_problems

    return [f"{what}: {p}" for p in checkpoint_problems(model_arg, weights=weights, ours=backend == "tokenmill")]


def remote_model(model_arg: str, what: str = "--model", *, weights: bool = True,
                 backend: str | None = "tokenmill") -> list[str]:
    """An ``s3://`` model: the bucket answers with these credentials and the prefix holds a
    checkpoint (one listing, one read of config.json); [] for a local folder (``model``'s)."""
    from tokenmill.storage.s3 import is_s3_url

    if not is_s3_url(model_arg):
        return []
    from tokenmill.storage.checkpoint import s3_checkpoint_problems

    return [f"{what}: {p}" for p in s3_checkpoint_problems(model_arg, weights=weights, ours=backend == "tokenmill")]


def broker(bootstrap_servers: str, what: str = "--bootstrap-servers", timeout_s: float = BROKER_TIMEOUT_S) -> list[str]:
    """At least one bootstrap server accepts a TCP connection within ``timeout_s``: one quick round
    trip. Credentials and ACLs are the clients' to check (they report refusals with their own exit
    codes); this only tells a broker that is not there from one that is."""
    servers = [s.strip() for s in bootstrap_servers.split(",") if s.strip()]
    if not servers:
        return [f"{what}: no server given"]
    reasons = []
    for server in servers:
        host, sep, port = server.rpartition(":")
        if not sep or not port.isdigit():
            return [f"{what} {server}: expected HOST:PORT"]
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
            return []
        except OSError as exc:
            reasons.append(f"{server} ({exc.strerror or exc})")
    return [f"{what}: no broker answers at {', '.join(reasons)}"]
