"""Files the engine derives from a checkpoint once and reads on later starts (the tokenizer's record,
the weights in the model's own layout), under $TOKENMILL_CACHE (default ~/.cache/tokenmill).

Each entry is one file per checkpoint folder, named by a digest of the folder's absolute path, that
starts with the key it was made under (the folder's files, the libraries' versions, the CPU): a
reader that finds another key ignores the file, and the next writer replaces it. A file is written
beside its place and renamed into it, so a reader never sees half of one, and concurrent writers
(several workers starting at once) all end with a whole file.
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


def write_entry(target: Path, header: dict[str, Any], body: Iterable[bytes]) -> None:
    """`target` := one JSON header line, then `body`'s chunks; written beside it and renamed into place.
    Raises OSError where the cache cannot be written (the caller carries on without it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
            for chunk in body:
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


def prune(kind: str, keep_latest: int) -> None:
    """Remove all but the `keep_latest` most recently used entries of a kind (entries of folders that
    no longer exist, test copies, old versions), and what a writer killed mid-way left an hour ago."""
    folder = cache_root() / kind
    try:
        paths = [(p, p.stat().st_mtime) for p in folder.iterdir()]
    except OSError:
        return
    entries = sorted(((p, t) for p, t in paths if not p.name.startswith(".")), key=lambda e: e[1], reverse=True)
    stale = [p for p, t in paths if p.name.startswith(".") and t < time.time() - 3600]
    for path in [p for p, _ in entries[keep_latest:]] + stale:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
