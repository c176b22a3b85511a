"""worker.storage against a local S3-compatible server, through real boto3 calls."""

import hashlib
from pathlib import Path

import boto3
import pytest

from tokenmill.storage import (
    S3Error,
    download_prefix,
    local_input,
    local_output,
    parse_s3_url,
    resolve_model_path,
)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _upload_dir(bucket: str, prefix: str, src: Path) -> dict[str, str]:
    client = boto3.client("s3")
    digests = {}
    for f in sorted(src.rglob("*")):
        if f.is_file():
            rel = f.relative_to(src).as_posix()
            client.upload_file(str(f), bucket, prefix + rel)
            digests[rel] = _sha(f)
    return digests


@pytest.mark.parametrize(
    "url, bucket, key, prefix",
    [
        ("s3://b/models/x/", "b", "models/x/", "models/x/"),
        ("s3://b/models/x", "b", "models/x", "models/x/"),
        ("s3://b", "b", "", ""),
        ("s3://b/", "b", "", ""),
    ],
)
def test_parse_s3_url(url, bucket, key, prefix):
    u = parse_s3_url(url)
    assert (u.bucket, u.key, u.prefix) == (bucket, key, prefix)


@pytest.mark.parametrize("bad", ["http://b/x", "s3:///key", "/local/path", "s3://bad bucket/x"])
def test_parse_s3_url_rejects(bad):
    with pytest.raises(ValueError):
        parse_s3_url(bad)


def test_download_checkpoint_parallel_cached_by_etag(s3_bucket, tiny_llama_dir, tmp_path):
    digests = _upload_dir(s3_bucket, "ckpt/llama/", Path(tiny_llama_dir))
    dest = tmp_path / "cache"
    url = f"s3://{s3_bucket}/ckpt/llama/"
    # Small parts so the safetensors file is fetched as many ranged parts in parallel.
    first = download_prefix(url, dest, part_size=64 * 1024, max_workers=4)
    assert first.files_downloaded == len(digests) and first.files_cached == 0
    for rel, digest in digests.items():
        assert _sha(dest / rel) == digest, rel
    assert not list(dest.rglob("*.part")) and not list(dest.rglob("*.part.json"))

    second = download_prefix(url, dest, part_size=64 * 1024)
    assert second.files_cached == len(digests) and second.bytes_downloaded == 0

    # A changed object (new ETag) is fetched again; a removed one disappears locally.
    client = boto3.client("s3")
    client.put_object(Bucket=s3_bucket, Key="ckpt/llama/config.json", Body=b'{"changed": true}')
    client.delete_object(Bucket=s3_bucket, Key="ckpt/llama/tokenizer_config.json")
    third = download_prefix(url, dest, part_size=64 * 1024)
    assert third.files_downloaded == 1
    assert (dest / "config.json").read_bytes() == b'{"changed": true}'
    assert not (dest / "tokenizer_config.json").exists()
    assert "tokenizer_config.json" in third.removed


class _FailingClient:
    """Wraps a boto3 client; get_object fails after `allowed` successful calls (a killed download)."""

    def __init__(self, inner, allowed: int):
        self.inner, self.allowed, self.calls = inner, allowed, 0

    def get_object(self, **kw):
        self.calls += 1
        if self.calls > self.allowed:
            raise ConnectionError("connection reset (simulated)")
        return self.inner.get_object(**kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _TruncatingClient(_FailingClient):
    def get_object(self, **kw):
        resp = self.inner.get_object(**kw)
        data = resp["Body"].read()

        class Body:
            def iter_chunks(self, n):
                yield data[:-1]

        return {**resp, "Body": Body()}


def test_download_resumes_unfinished_parts(s3_bucket, tmp_path):
    payload = bytes(range(256)) * 4096  # 1 MiB
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="m/weights.bin", Body=payload)
    dest = tmp_path / "cache"
    url = f"s3://{s3_bucket}/m/"
    part = 64 * 1024  # 16 parts
    with pytest.raises(S3Error, match="rerun to resume"):
        download_prefix(url, dest, client=_FailingClient(boto3.client("s3"), allowed=5), part_size=part, max_workers=1)
    assert not (dest / "weights.bin").exists() and (dest / "weights.bin.part").exists()

    resumed = download_prefix(url, dest, part_size=part, max_workers=3)
    assert resumed.parts_resumed == 5
    assert resumed.bytes_downloaded == len(payload) - 5 * part
    assert (dest / "weights.bin").read_bytes() == payload


def test_download_checks_sizes(s3_bucket, tmp_path):
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="m/a.bin", Body=b"x" * 1000)
    with pytest.raises(S3Error, match="expected 1000"):
        download_prefix(f"s3://{s3_bucket}/m/", tmp_path, client=_TruncatingClient(boto3.client("s3"), 99))
    assert not (tmp_path / "a.bin").exists()


def test_resolve_model_path(s3_bucket, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "tmcache"))
    _upload_dir(s3_bucket, "models/tiny/", Path(tiny_llama_dir))
    local = resolve_model_path(f"s3://{s3_bucket}/models/tiny/")
    assert local.is_relative_to(tmp_path / "tmcache")
    assert (local / "config.json").read_bytes() == (Path(tiny_llama_dir) / "config.json").read_bytes()
    assert resolve_model_path(str(tiny_llama_dir)) == Path(tiny_llama_dir)
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no objects"):
        resolve_model_path(f"s3://{s3_bucket}/models/missing/")
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="notamodel/readme.txt", Body=b"hi")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(f"s3://{s3_bucket}/notamodel/")


def test_local_input_and_output_roundtrip(s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/data/out.jsonl"
    with local_output(url) as tmp:
        tmp.write_text("line\n" * 3)
    with local_input(url) as path:
        assert path.read_text() == "line\n" * 3
    # A failing writer leaves nothing at the destination.
    with pytest.raises(RuntimeError):
        with local_output(f"s3://{s3_bucket}/data/broken.jsonl") as tmp:
            tmp.write_text("partial")
            raise RuntimeError("boom")
    listed = boto3.client("s3").list_objects_v2(Bucket=s3_bucket, Prefix="data/")
    assert [o["Key"] for o in listed["Contents"]] == ["data/out.jsonl"]
    local = tmp_path / "sub" / "o.txt"
    with local_output(local) as tmp:
        tmp.write_text("ok")
    assert local.read_text() == "ok"
    with pytest.raises(FileNotFoundError):
        with local_input(f"s3://{s3_bucket}/data/missing.jsonl"):
            pass
