"""Which pyarrow filesystem a folder name or URI points at (checkpoints and model folders).

A plain path or ``file://`` is local; ``s3://`` (and Hadoop's ``s3a://`` and ``s3n://``,
the same bucket and key), ``gs://``, ``hdfs://`` and the other schemes this pyarrow
build can write go to pyarrow. A URI keeps pyarrow's query options, e.g.
``s3://bucket/run?endpoint_override=host:9000&scheme=http`` for a non-AWS server; pyarrow
also reads ``AWS_ENDPOINT_URL_S3`` and ``AWS_ENDPOINT_URL`` from the environment.
"""

from __future__ import annotations

import os
import re

from pyarrow import fs as pafs

__all__ = ["filesystem", "is_uri"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")
_S3_ALIASES = ("s3a", "s3n")
_HINTS = {"dbfs": "on Databricks use the FUSE path /dbfs/... instead"}


def filesystem(uri: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and the path inside it (no trailing slash) that ``uri`` names.

    Raises
    ------
    ValueError
        The scheme is one this pyarrow cannot write (``dbfs:/``, an unknown one, or ``gs://``
        in a build without GCS); the message says what to use instead.
    """
    uri = os.fspath(uri)
    m = _SCHEME.match(uri)
    if m is None:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    scheme = m.group(1).lower()
    if scheme in _S3_ALIASES:
        uri = "s3" + uri[len(scheme):]
    if scheme in _HINTS:
        raise ValueError(f"{uri}: pyarrow cannot write {scheme}: URIs; {_HINTS[scheme]}")
    try:
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except (ValueError, NotImplementedError) as e:  # ArrowInvalid, ArrowNotImplementedError
        raise ValueError(f"{uri}: this pyarrow cannot write {scheme}:// ({e}); use a local folder, file://, "
                         "s3:// (or s3a://), or a scheme your pyarrow build supports (gs://, hdfs://...)") from None
    return filesystem, path.rstrip("/") or "/"


def is_uri(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a URI (``file://``, ``s3a://``, ``hdfs://``, ``dbfs:/``...) rather than a plain path."""
    return path is not None and _SCHEME.match(os.fspath(path)) is not None
