"""Files the engine derives from a checkpoint once and reads on later starts (the tokenizer's record,
the weights in the model's own layout), under $TOKENMILL_CACHE (default ~/.cache/tokenmill).

An entry is a file named by a digest of the checkpoint folder's absolute path (and, where several
may be valid at once, of its key), that starts with a JSON line holding the key it was made under
(the folder's files, the libraries' versions, the CPU): a reader that finds another key ignores the
file, and the next writer replaces it. A file is written beside its place and renamed into it, so a
reader never sees half of one, and concurrent writers (several workers starting at once) all end
with a whole file. Entries of folders that no longer exist are removed when another is written, and
of the rest the most recently used are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

# Files of a checkpoint folder that hold weights: not part of a tokenizer's key.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack")


def cache_root() -> Path:
    root = os.environ.get("TOKENMILL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
    return Path(root)


def entry_path(kind: str, model_dir: Path, suffix: str) -> Path:
    """Where the `kind` entry of a checkpoint folder lives (one per folder)."""
    digest = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:20]
    return cache_root() / kind / f"{digest}{suffix}"


def file_identity(path: Path) -> list[Any]:
    """A file's name, size and modification time: what changes when it is rewritten or replaced."""
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns, st.st_ino]


def folder_identity(model_dir: Path, keep: Callable[[Path], bool]) -> list[list[Any]]:
    """file_identity of every file of the folder (and its subfolders) that `keep` takes, sorted."""
    found = []
    for root, _dirs, files in os.walk(model_dir):
        for name in files:
            path = Path(root) / name
            if keep(path):
                ident = file_identity(path)
                ident[0] = str(path.relative_to(model_dir))
                found.append(ident)
    return sorted(found)


def read_key(f: IO[bytes]) -> dict[str, Any] | None:
    """The header line of an entry (its key and record), or None where it is not one."""
    try:
        header = json.loads(f.readline())
    except (ValueError, UnicodeDecodeError):
        return None
    return header if isinstance(header, dict) else None


def header_line(header: dict[str, Any]) -> bytes:
    """An entry's first line: its key and record as JSON."""
    return json.dumps(header, separators=(",", ":")).encode() + b"\n"


def write_entry(target: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """`target` := the chunks (a header_line first), written beside it and renamed into place.
    Raises OSError where the cache cannot be written (the caller carries on without it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def touch(path: Path) -> None:
    """Mark an entry as used now (prune keeps the most recently used)."""
    try:
        os.utime(path)
    except OSError:
        pass


def prune(kind: str, keep_latest: int, max_bytes: int | None = None) -> None:
    """Remove a kind's entries whose checkpoint folder is gone (test copies, moved models), then all
    but the `keep_latest` most recently used (and, with max_bytes, the older ones past that many
    bytes; the newest is always kept), and what a writer killed mid-way left an hour ago."""
    folder = cache_root() / kind
    try:
        paths = [(p, p.stat()) for p in folder.iterdir()]
    except OSError:
        return
    doomed = [p for p, st in paths if p.name.startswith(".") and st.st_mtime < time.time() - 3600]
    entries = []
    for path, st in sorted(((p, st) for p, st in paths if not p.name.startswith(".")),
                           key=lambda e: e[1].st_mtime, reverse=True):
        if not _source_exists(path):
            doomed.append(path)
        else:
            entries.append((path, st.st_size))
    total = 0
    for i, (path, size) in enumerate(entries):
        total += size
        if i >= keep_latest or (i > 0 and max_bytes is not None and total > max_bytes):
            doomed.append(path)
    for path in doomed:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def _source_exists(path: Path) -> bool:
    """Whether the checkpoint folder an entry was made from still exists (True where unreadable)."""
    try:
        with open(path, "rb") as f:
            header = read_key(f)
    except OSError:
        return True
    source = (header or {}).get("key", {}).get("folder")
    return not isinstance(source, str) or os.path.isdir(source)
