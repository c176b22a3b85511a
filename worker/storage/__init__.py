"""Storage helpers: `s3://` URLs, model checkpoints from S3 (cached locally), dataset files on S3."""

from tokenmill.storage.checkpoint import DownloadReport, download_prefix, resolve_model_path
from tokenmill.storage.files import local_input, local_output
from tokenmill.storage.s3 import S3Error, S3Url, is_s3_url, parse_s3_url, s3_client

__all__ = [
    "DownloadReport",
    "S3Error",
    "S3Url",
    "download_prefix",
    "is_s3_url",
    "local_input",
    "local_output",
    "parse_s3_url",
    "resolve_model_path",
    "s3_client",
]
