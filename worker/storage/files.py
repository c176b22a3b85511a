"""Read and write whole files that may live on S3, with bounded memory.

A dataset on `s3://` is streamed to a local temporary file (the readers then stream it row by
row); an output is written to a local temporary file and uploaded once complete (multipart for
large files), so a half-written output never appears at its destination.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenmill.storage.s3 import S3Error, head_object, is_s3_url, parse_s3_url, s3_client


@contextlib.contextmanager
def local_input(location: str | os.PathLike, *, tmp_dir: str | None = None) -> Iterator[Path]:
    """Yield a local path holding the file at `location` (a path or s3:// URL)."""
    if not is_s3_url(location):
        path = Path(location).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"input file not found: {location}")
        yield path
        return
    url = parse_s3_url(str(location))
    client = s3_client()
    meta = head_object(client, url)
    suffix = "".join(Path(url.key).suffixes[-2:])
    fd, tmp = tempfile.mkstemp(prefix="tokenmill-in-", suffix=suffix, dir=tmp_dir)
    os.close(fd)
    try:
        client.download_file(url.bucket, url.key, tmp)
        if os.path.getsize(tmp) != meta["Size"]:
            raise S3Error(f"{url}: downloaded {os.path.getsize(tmp)} bytes, expected {meta['Size']}")
        yield Path(tmp)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def local_output(location: str | os.PathLike, *, tmp_dir: str | None = None) -> Iterator[Path]:
    """Yield a local temporary path; on success move it to `location` (a path or s3:// URL).

    If the block raises, nothing is written at `location`.
    """
    if is_s3_url(location):
        url = parse_s3_url(str(location))
        if not url.key or url.key.endswith("/"):
            raise ValueError(f"output URL must name an object, not a folder: {location}")
        parent = tmp_dir
    else:
        target = Path(location).expanduser()
        target.parent.mkdir(parents=True, exist_ok=True)
        parent = str(target.parent)  # same file system, so the final rename is atomic
    fd, tmp = tempfile.mkstemp(prefix=".tokenmill-out-", dir=parent)
    os.close(fd)
    try:
        yield Path(tmp)
        if is_s3_url(location):
            client = s3_client()
            client.upload_file(tmp, url.bucket, url.key)
            size = head_object(client, url)["Size"]
            if size != os.path.getsize(tmp):
                raise S3Error(f"{location}: uploaded {size} bytes, expected {os.path.getsize(tmp)}")
        else:
            shutil.move(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
