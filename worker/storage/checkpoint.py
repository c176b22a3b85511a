"""Download a model checkpoint from `s3://bucket/prefix/` into a local cache, and serve it from there.

- Parallel: every file is cut into byte ranges (parts) fetched by a thread pool, so one large
  safetensors shard uses all connections, and small files go side by side.
- Resumable: each file is written in place into `NAME.part` (parts land at their offsets); a
  sidecar `NAME.part.json` records the object's ETag and the finished parts. A killed download
  restarts only the unfinished parts. Ranged reads carry `IfMatch: ETag`, so an object replaced
  mid-download restarts that file instead of mixing two versions.
- Cached by ETag: `.tokenmill-s3.json` in the cache folder lists each file's ETag and size; a file
  whose local copy matches the listing is not fetched again. Files no longer under the prefix are
  removed, so an old shard never lingers next to a new index.
- Sizes checked: every part's length and every finished file's size must equal what S3 listed.
- Two processes on one node (two workers sharing a cache volume) take an exclusive file lock on
  the cache folder, so one downloads and the other then finds everything cached.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.storage.s3 import S3Error, S3Url, is_s3_url, list_objects, parse_s3_url, s3_client

log = logging.getLogger(__name__)

MANIFEST = ".tokenmill-s3.json"
LOCK = ".tokenmill-s3.lock"
DEFAULT_PART_SIZE = 64 * 1024 * 1024
_READ_CHUNK = 1024 * 1024


@dataclass
class DownloadReport:
    local_dir: Path
    files_total: int = 0
    files_cached: int = 0
    files_downloaded: int = 0
    bytes_downloaded: int = 0
    parts_resumed: int = 0  # parts found finished from an earlier, interrupted run
    removed: list[str] = field(default_factory=list)


def cache_root() -> Path:
    root = os.environ.get("TOKENMILL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
    return Path(root)


def default_cache_dir(url: S3Url) -> Path:
    """A readable, collision-free folder per (endpoint, bucket, prefix)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "aws"
    digest = hashlib.sha256(f"{endpoint}|{url.bucket}|{url.prefix}".encode()).hexdigest()[:12]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{url.bucket}_{url.prefix}".strip("/"))[:80]
    return cache_root() / "s3" / f"{readable}-{digest}"


def _safe_relative(key: str, prefix: str) -> str:
    rel = key[len(prefix):]
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts) or rel.startswith("/"):
        raise S3Error(f"refusing to download object with unsafe key {key!r}")
    return rel


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


class _FileDownload:
    """One object -> one local file, in ranged parts, resumable via a sidecar."""

    def __init__(self, client, bucket: str, obj: dict, dest: Path, part_size: int):
        self.client = client
        self.bucket = bucket
        self.key = obj["Key"]
        self.size = obj["Size"]
        self.etag = obj["ETag"]
        self.dest = dest
        self.part_path = dest.with_name(dest.name + ".part")
        self.sidecar = dest.with_name(dest.name + ".part.json")
        self.part_size = part_size
        self.num_parts = max(1, -(-self.size // part_size))
        self.lock = threading.Lock()
        self.done: set[int] = set()
        self.resumed = 0

    def prepare(self) -> list[int]:
        """Open (or reuse) the .part file; return the part indexes still to fetch."""
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        if self.part_path.exists() and self.sidecar.exists():
            try:
                state = json.loads(self.sidecar.read_text())
            except (OSError, ValueError):
                state = {}
            if (
                state.get("etag") == self.etag
                and state.get("size") == self.size
                and state.get("part_size") == self.part_size
                and self.part_path.stat().st_size == self.size
            ):
                self.done = {int(i) for i in state.get("done", [])}
                self.resumed = len(self.done)
        if not self.done:
            with open(self.part_path, "wb") as f:
                f.truncate(self.size)  # sparse preallocation; parts are written at their offsets
            self._save_state()
        return [i for i in range(self.num_parts) if i not in self.done]

    def _save_state(self) -> None:
        _write_json_atomic(
            self.sidecar,
            {"etag": self.etag, "size": self.size, "part_size": self.part_size, "done": sorted(self.done)},
        )

    def fetch_part(self, index: int) -> int:
        start = index * self.part_size
        end = min(self.size, start + self.part_size) - 1
        if self.size == 0:
            return 0
        resp = self.client.get_object(
            Bucket=self.bucket, Key=self.key, Range=f"bytes={start}-{end}", IfMatch=self.etag
        )
        expected = end - start + 1
        written = 0
        fd = os.open(self.part_path, os.O_WRONLY)
        try:
            body = resp["Body"]
            for chunk in body.iter_chunks(_READ_CHUNK):
                os.pwrite(fd, chunk, start + written)
                written += len(chunk)
                if written > expected:
                    break
            os.fsync(fd)
        finally:
            os.close(fd)
        if written != expected:
            raise S3Error(
                f"s3://{self.bucket}/{self.key}: part {index} returned {written} bytes, expected {expected}"
            )
        with self.lock:
            self.done.add(index)
            self._save_state()
        return written

    def finish(self) -> None:
        actual = self.part_path.stat().st_size
        if actual != self.size or len(self.done) != self.num_parts:
            raise S3Error(f"s3://{self.bucket}/{self.key}: local size {actual}, expected {self.size}")
        os.replace(self.part_path, self.dest)
        self.sidecar.unlink(missing_ok=True)


def download_prefix(
    url: str | S3Url,
    local_dir: str | Path | None = None,
    *,
    client=None,
    max_workers: int = 8,
    part_size: int = DEFAULT_PART_SIZE,
    on_bytes: Callable[[int], None] | None = None,
) -> DownloadReport:
    """Mirror every object under an S3 prefix into local_dir (see the module docstring)."""
    src = parse_s3_url(url) if isinstance(url, str) else url
    dest = Path(local_dir) if local_dir is not None else default_cache_dir(src)
    dest.mkdir(parents=True, exist_ok=True)
    client = client or s3_client(max_pool_connections=max(16, max_workers))
    report = DownloadReport(local_dir=dest)

    with open(dest / LOCK, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            objects = list_objects(client, src)
        except Exception as exc:  # botocore raises many types; the user needs the URL and reason
            raise S3Error(f"cannot list {src}: {exc}") from exc
        if not objects:
            raise FileNotFoundError(f"{src}: no objects under this prefix")
        manifest_path = dest / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        except ValueError:
            manifest = {}
        files = manifest.get("files", {})
        report.files_total = len(objects)

        wanted: dict[str, dict] = {}
        downloads: list[_FileDownload] = []
        for obj in objects:
            rel = _safe_relative(obj["Key"], src.prefix)
            wanted[rel] = obj
            local = dest / rel
            known = files.get(rel)
            if (
                known
                and known.get("etag") == obj["ETag"]
                and known.get("size") == obj["Size"]
                and local.is_file()
                and local.stat().st_size == obj["Size"]
            ):
                report.files_cached += 1
                continue
            files.pop(rel, None)
            downloads.append(_FileDownload(client, src.bucket, obj, local, part_size))

        # Drop what the prefix no longer has (and stale manifest entries) before fetching.
        for rel in list(files):
            if rel not in wanted:
                files.pop(rel)
        for path in sorted(dest.rglob("*")):
            if not path.is_file() or path.parent == dest and path.name in (MANIFEST, LOCK):
                continue
            rel = path.relative_to(dest).as_posix()
            base = re.sub(r"\.part(\.json)?$", "", rel)
            if base not in wanted:
                path.unlink()
                report.removed.append(rel)
        manifest["source"] = str(src)
        manifest["files"] = files
        _write_json_atomic(manifest_path, manifest)

        manifest_lock = threading.Lock()
        tasks = []
        with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="s3-download") as pool:
            for fd in downloads:
                todo = fd.prepare()
                report.parts_resumed += fd.resumed
                for index in todo:
                    tasks.append((fd, pool.submit(fd.fetch_part, index)))
            errors = []
            for fut in as_completed([t[1] for t in tasks]):
                try:
                    n = fut.result()
                except Exception as exc:  # keep going: finished parts stay recorded for a resume
                    errors.append(exc)
                    continue
                report.bytes_downloaded += n
                if on_bytes:
                    on_bytes(n)
        if errors:
            raise S3Error(f"download of {src} failed ({len(errors)} part(s)); rerun to resume: {errors[0]}")
        for fd in downloads:
            fd.finish()
            rel = fd.dest.relative_to(dest).as_posix()
            with manifest_lock:
                files[rel] = {"etag": fd.etag, "size": fd.size}
                _write_json_atomic(manifest_path, manifest)
            report.files_downloaded += 1
    return report


# The early check of an s3:// model answers within seconds: one try more, short timeouts (a download
# keeps s3_client's patient retries).
CHECK_TIMEOUT_S = 10.0
CHECK_ATTEMPTS = 2


def _checking_client(timeout_s: float):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client("s3", config=Config(
        connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": CHECK_ATTEMPTS, "mode": "standard"},
        s3={"addressing_style": "path"},  # as s3_client: every S3-compatible server takes it
    ))


def s3_checkpoint_problems(model_url: str, *, weights: bool = True, ours: bool = True,
                           timeout_s: float = CHECK_TIMEOUT_S) -> list[str]:
    """What a command checks of an s3:// model before it loads anything (worker/cli/preflight.py):
    the URL parses, the bucket answers these credentials, and the prefix holds a config.json (of an
    architecture tokenmill's engine serves, unless ``ours`` is False: another engine's checkpoint), a
    tokenizer and (with ``weights``) weights. One listing and one read of config.json; [] when all is
    there (the download checks sizes and ETags itself)."""
    from tokenmill.engine.checkpoint_files import (
        CONFIG_FILE,
        TOKENIZER_FILES,
        CheckpointError,
        architecture,
    )

    try:
        src = parse_s3_url(model_url)
    except ValueError as exc:
        return [str(exc)]
    where = f"s3://{src.bucket}/{src.prefix}"  # the folder, with its slash
    client = _checking_client(timeout_s)
    try:
        listing = client.list_objects_v2(Bucket=src.bucket, Prefix=src.prefix, MaxKeys=1000)
        names = {obj["Key"][len(src.prefix):] for obj in listing.get("Contents", [])}
        if not names:
            return [f"{where}: no objects under this prefix"]
        problems = []
        if CONFIG_FILE not in names:
            problems.append(f"{where} has no {CONFIG_FILE}: not a checkpoint folder")
        else:
            body = client.get_object(Bucket=src.bucket, Key=src.prefix + CONFIG_FILE)["Body"].read()
            try:
                config = json.loads(body)
                if ours:
                    architecture(config if isinstance(config, dict) else {})
            except ValueError as exc:  # CheckpointError and bad JSON alike
                reason = exc if isinstance(exc, CheckpointError) else f"not valid JSON: {exc}"
                problems.append(f"{where}{CONFIG_FILE}: {reason}")
    except Exception as exc:  # botocore raises many types: the user needs the URL and the reason
        return [f"cannot read {where}: {exc}"]
    if not names & set(TOKENIZER_FILES):
        problems.append(f"{where} has no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})")
    suffixes = (".safetensors",) if ours else (".safetensors", ".bin")
    if weights and not any(n.endswith(suffixes) for n in names):
        problems.append(f"{where} has no {'safetensors ' if ours else ''}weights")
    return problems


def resolve_model_path(model_arg: str | os.PathLike, *, cache_dir: str | Path | None = None) -> Path:
    """What the worker and run-batch call with --model: a local folder as is, or an s3:// prefix
    downloaded (or found cached) and returned as its local folder."""
    if is_s3_url(model_arg):
        src = parse_s3_url(str(model_arg))
        report = download_prefix(src, cache_dir)
        log.info(
            "model %s: %d file(s), %d cached, %d downloaded (%d bytes) into %s",
            src, report.files_total, report.files_cached, report.files_downloaded,
            report.bytes_downloaded, report.local_dir,
        )
        if not (report.local_dir / "config.json").is_file():
            raise FileNotFoundError(f"{src} has no config.json: not a checkpoint folder")
        return report.local_dir
    path = Path(model_arg).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {model_arg}")
    return path
