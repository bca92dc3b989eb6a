"""Extended MNIST's deformation (no Spark, no download): determinism, labels, how far digits move."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from sparknet.datasets import ArrayDataset, Deformation, extended_arrays, extended_samples
from sparknet.datasets._extended import (WORDS_PER_SAMPLE, _displacements, _random_words, arrow_samples,
                                         contiguous_runs, gaussian_weights)
from sparknet.datasets._extended_write import base_digits

STILL = Deformation(alpha=0, rotation=0, scale=0, shear=0, translation=0)
ELASTIC = Deformation(rotation=0, scale=0, shear=0, translation=0)


_SEGMENTS = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg")  # 0..9
_ENDS = {"a": ((5, 9), (5, 18)), "b": ((5, 18), (14, 18)), "c": ((14, 18), (23, 18)), "d": ((23, 9), (23, 18)),
         "e": ((14, 9), (23, 9)), "f": ((5, 9), (14, 9)), "g": ((14, 9), (14, 18))}  # (row, column) of each end


def _seven_segment_digits(width: float = 1.6) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic base digits 0..9: seven-segment glyphs drawn with soft strokes about 3 px wide."""
    yy, xx = np.mgrid[0:28, 0:28].astype(np.float64)
    images = []
    for segments in _SEGMENTS:
        ink = np.zeros((28, 28))
        for s in segments:
            (y0, x0), (y1, x1) = _ENDS[s]
            dy, dx = y1 - y0, x1 - x0
            t = np.clip(((yy - y0) * dy + (xx - x0) * dx) / (dy * dy + dx * dx), 0, 1)
            ink = np.maximum(ink, np.exp(-(np.hypot(yy - (y0 + t * dy), xx - (x0 + t * dx)) / width) ** 2))
        images.append(np.rint(255 * ink).astype(np.uint8))
    return np.stack(images), np.arange(10, dtype=np.uint8)


BASE_X, BASE_Y = _seven_segment_digits()
N = len(BASE_X)


def _flat(a: np.ndarray) -> np.ndarray:
    a = a.reshape(len(a), -1).astype(np.float64)
    return a - a.mean(axis=1, keepdims=True)


def _correlations(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of every image of ``a`` with every image of ``b``: ``[len(a), len(b)]``."""
    fa, fb = _flat(a), _flat(b)
    return (fa @ fb.T) / np.outer(np.linalg.norm(fa, axis=1), np.linalg.norm(fb, axis=1))


# -- the same bytes -----------------------------------------------------------------------------
def test_a_sample_is_the_same_bytes_whatever_range_makes_it() -> None:
    whole, labels = extended_samples(BASE_X, BASE_Y, 0, 2500, seed=7)  # crosses the 1024-sample chunks
    again, _ = extended_samples(BASE_X, BASE_Y, 0, 2500, seed=7)
    assert np.array_equal(whole, again)
    for start, stop in ((0, 1), (1023, 1025), (1500, 2500), (2499, 2500), (777, 1900)):
        part, part_labels = extended_samples(BASE_X, BASE_Y, start, stop, seed=7)
        assert np.array_equal(part, whole[start:stop]), (start, stop)
        assert np.array_equal(part_labels, labels[start:stop])


def test_another_seed_gives_other_deformations() -> None:
    a, _ = extended_samples(BASE_X, BASE_Y, 0, 50, seed=0)
    b, _ = extended_samples(BASE_X, BASE_Y, 0, 50, seed=1)
    differs = (a != b).reshape(50, -1).any(axis=1)
    assert differs.all()


def test_the_stream_jumps_to_a_sample_exactly() -> None:
    import numpy.random as npr

    straight = npr.PCG64(3).random_raw(5 * WORDS_PER_SAMPLE).reshape(5, WORDS_PER_SAMPLE)
    assert np.array_equal(_random_words(3, 2, 3), straight[2:])


# -- shapes, labels, range ----------------------------------------------------------------------
def test_shapes_dtypes_and_labels_of_the_base_digit_i_mod_n() -> None:
    x, y = extended_samples(BASE_X, BASE_Y, 15, 75, seed=0)
    assert x.shape == (60, 28, 28) and x.dtype == np.uint8
    assert np.array_equal(y, BASE_Y[np.arange(15, 75) % N])


def test_a_still_deformation_copies_the_base_digits_exactly() -> None:
    x, y = extended_samples(BASE_X, BASE_Y, 0, 3 * N, deformation=STILL)
    assert np.array_equal(x, np.concatenate([BASE_X] * 3)) and np.array_equal(y, np.tile(BASE_Y, 3))


def test_deformed_digits_differ_from_the_base_and_from_each_other() -> None:
    x, _ = extended_samples(BASE_X, BASE_Y, 0, 4 * N, seed=0)
    base = np.concatenate([BASE_X] * 4)
    changed = (np.abs(x.astype(int) - base).reshape(len(x), -1) > 20).sum(axis=1)
    assert changed.min() >= 20, changed.min()  # every sample moved at least 20 pixels by more than 20 levels
    same_base = (np.abs(x[:N].astype(int) - x[N:2 * N]).reshape(N, -1) > 20).sum(axis=1)
    assert same_base.min() >= 20, same_base.min()  # sample i and i + N deform one digit differently


def test_ink_is_kept_and_pixels_stay_in_range() -> None:
    x, _ = extended_samples(BASE_X, BASE_Y, 0, 50 * N, seed=2)
    ratio = x.reshape(len(x), -1).sum(axis=1) / np.tile(BASE_X.reshape(N, -1).sum(axis=1), 50)
    assert 0.9 < ratio.mean() < 1.1, ratio.mean()  # scale in [0.9, 1.1] changes the area by up to 21% either way
    assert ratio.min() > 0.3 and ratio.max() < 2.5, (ratio.min(), ratio.max())  # strokes stretch and shrink locally
    assert x.max() > 200  # strokes stay strokes, not blurred to grey


@pytest.mark.parametrize("deformation, least_median, least_nearest", [(Deformation(), 0.45, 0.5),
                                                                     (ELASTIC, 0.6, 0.75)])
def test_a_deformed_digit_stays_close_to_its_own_base(deformation, least_median, least_nearest) -> None:
    """Correlation with its own base digit, and the nearest base digit's label (chance: 0.1; 8 holds every stroke)."""
    x, y = extended_samples(BASE_X, BASE_Y, 0, 50 * N, seed=3, deformation=deformation)
    corr = _correlations(x, BASE_X)
    own = corr[np.arange(len(x)), np.arange(len(x)) % N]
    assert np.median(own) > least_median, np.median(own)
    nearest = (BASE_Y[corr.argmax(axis=1)] == y).mean()
    assert nearest > least_nearest, nearest


def test_the_elastic_field_has_simards_size() -> None:
    """Smoothed uniform noise: std = alpha · sqrt(1/3) · sum of the 2-D kernel's squared weights."""
    deformation = Deformation(sigma=2.0, alpha=10.0)
    d = _displacements(_random_words(5, 0, 4000), deformation)
    w = gaussian_weights(2.0) / 4096
    want = 10.0 * np.sqrt(1 / 3) * float((w ** 2).sum())
    interior = d[:, :, 7:21, 7:21]  # at least 3 sigma from every border: no zero padding in reach
    assert abs(interior.std() / want - 1) < 0.03, (interior.std(), want)
    assert abs(interior.mean()) < 0.02 * want
    assert d[:, :, 0, 0].std() < interior.std()  # the zero padding shrinks the field at the corners


def test_translation_moves_the_centre_of_mass_within_its_bound() -> None:
    x, _ = extended_samples(BASE_X, BASE_Y, 0, 30 * N, seed=4,
                            deformation=Deformation(alpha=0, rotation=0, scale=0, shear=0, translation=2.0))
    grid = np.arange(28)

    def centres(a: np.ndarray) -> np.ndarray:
        m = a.astype(np.float64)
        total = m.sum(axis=(1, 2))
        return np.stack([(m.sum(axis=1) * grid).sum(axis=1) / total, (m.sum(axis=2) * grid).sum(axis=1) / total], 1)

    shift = centres(x) - np.tile(centres(BASE_X), (30, 1))
    assert np.abs(shift).max() < 2.2, np.abs(shift).max()
    assert np.abs(shift).max() > 1.5 and np.abs(shift).std() > 0.5  # uniform in [-2, 2]


def test_gaussian_weights_sum_to_4096_and_peak_in_the_middle() -> None:
    for sigma in (0.3, 1.0, 4.0, 6.0, 28.0):
        w = gaussian_weights(sigma)
        r = len(w) // 2
        assert w.sum() == 4096 and np.array_equal(w, w[::-1]) and w.argmax() == r and len(w) <= 55
    assert len(gaussian_weights(4.0)) == 25
    with pytest.raises(ValueError, match="sigma"):
        gaussian_weights(0)


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"sigma": 0}, "sigma = 0 is out of range"), ({"alpha": -1}, "alpha"), ({"rotation": 91}, "rotation"),
    ({"scale": 1.0}, "scale"), ({"shear": float("nan")}, "finite"), ({"translation": "2"}, "finite"),
    ({"translation": 29}, "translation")])
def test_a_deformation_out_of_range_is_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Deformation(**kwargs)


def test_bad_base_and_ranges_are_refused() -> None:
    with pytest.raises(ValueError, match=r"uint8 \[N, 28, 28\]"):
        extended_samples(BASE_X.astype(np.float32), BASE_Y, 0, 1)
    with pytest.raises(ValueError, match="one per base image"):
        extended_samples(BASE_X, BASE_Y[:-1], 0, 1)
    with pytest.raises(ValueError, match="stop"):
        extended_samples(BASE_X, BASE_Y, 5, 4)
    with pytest.raises(ValueError, match="seed"):
        extended_samples(BASE_X, BASE_Y, 0, 1, seed=-1)


def test_base_digits_take_mnist_floats_back_to_their_bytes() -> None:
    floats = ArrayDataset(BASE_X[:, None] / np.float32(255), BASE_Y.astype(np.int64))
    x, y = base_digits(floats)
    assert np.array_equal(x, BASE_X) and np.array_equal(y, BASE_Y) and x.dtype == np.uint8
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        base_digits((BASE_X * 2.0, BASE_Y))
    with pytest.raises(ValueError, match="28, 28"):
        base_digits((np.zeros((3, 27, 28), np.uint8), np.zeros(3, np.int64)))
    with pytest.raises(ValueError, match="labels"):
        base_digits((BASE_X, BASE_Y.astype(np.int64) + 300))


def test_the_extended_mnist_data_set_by_name(tmp_path, monkeypatch) -> None:
    """``load_dataset("extended-mnist")`` (``--dataset extended-mnist``) on base digits from IDX files."""
    from test_datasets import _write_idx

    from sparknet.datasets import IDX_ENV, load_dataset

    for name, arr in (("train-images-idx3-ubyte", BASE_X), ("train-labels-idx1-ubyte", BASE_Y),
                      ("t10k-images-idx3-ubyte", BASE_X[:4]), ("t10k-labels-idx1-ubyte", BASE_Y[:4])):
        _write_idx(tmp_path / name, arr)
    monkeypatch.setenv(IDX_ENV, str(tmp_path))
    monkeypatch.setenv("SPARKNET_CACHE", str(tmp_path / "cache"))
    splits = load_dataset("extended_mnist", num_samples=25, seed=4, alpha=20.0)
    n_train = N - N // 6  # mnist() keeps the last sixth of IDX training digits for validation
    want = extended_arrays(25, seed=4, deformation=Deformation(alpha=20.0), base=(BASE_X[:n_train], BASE_Y[:n_train]))
    assert np.array_equal(splits.train.x, want.x) and np.array_equal(splits.train.y, want.y)
    assert len(splits.validation) == N - n_train and len(splits.test) == 4
    # made once: the next load maps the cached files, named by the base digits and the deformation too
    again = load_dataset("extended-mnist", num_samples=25, seed=4, alpha=20.0).train
    assert not again.x.flags.writeable and np.array_equal(again.x, want.x) and np.array_equal(again.y, want.y)
    load_dataset("extended-mnist", num_samples=25, seed=4, alpha=19.0)
    assert len(list((tmp_path / "cache" / "extended_mnist").glob("train-25-seed4-*.x.npy"))) == 2
    with pytest.raises(ValueError, match="alpha"):
        load_dataset("extended-mnist", num_samples=5, alpha=-1.0)


def test_extended_arrays_made_in_processes_are_the_same_bytes() -> None:
    from sparknet.datasets._extended import CHUNK

    rows = 2 * CHUNK + 7  # three processes, each more than one vectorised step's worth but the last
    alone = extended_arrays(rows, seed=3, base=(BASE_X, BASE_Y))
    shared = extended_arrays(rows, seed=3, base=(BASE_X, BASE_Y), processes=3)
    assert np.array_equal(shared.x, alone.x) and np.array_equal(shared.y, alone.y)
    assert shared.x.shape == (rows, 1, 28, 28) and shared.y.dtype == alone.y.dtype
    with pytest.raises(ValueError, match="processes"):
        extended_arrays(5, base=(BASE_X, BASE_Y), processes=0)


def test_extended_arrays_scale_pixels_as_mnist_does() -> None:
    data = extended_arrays(30, seed=1, base=(BASE_X, BASE_Y))
    raw, labels = extended_samples(BASE_X, BASE_Y, 0, 30, seed=1)
    assert data.x.shape == (30, 1, 28, 28) and data.x.dtype == np.float32 and data.y.dtype == np.int64
    assert np.array_equal(data.x[:, 0], raw / np.float32(255)) and np.array_equal(data.y, labels)


# -- executor side ------------------------------------------------------------------------------
def test_contiguous_runs() -> None:
    assert list(contiguous_runs(np.array([3, 4, 5, 9, 10, 2]))) == [(3, 6), (9, 11), (2, 3)]
    assert list(contiguous_runs(np.array([], np.int64))) == []


def test_arrow_samples_turn_ids_into_the_rows_of_those_samples() -> None:
    import pyarrow as pa

    base = SimpleNamespace(value=(BASE_X.tobytes(), BASE_Y.tobytes()))
    ids = [pa.record_batch([pa.array(np.arange(1000, 2100), pa.int64())], names=["id"]),
           pa.record_batch([pa.array([5, 6, 40], pa.int64())], names=["id"])]
    table = pa.Table.from_batches(list(arrow_samples(base, 9, Deformation())(iter(ids))))
    index = table.column("index").to_numpy()
    assert index.tolist() == [*range(1000, 2100), 5, 6, 40]
    pixels = np.frombuffer(b"".join(table.column("features").to_pylist()), np.uint8).reshape(-1, 28, 28)
    want, labels = extended_samples(BASE_X, BASE_Y, 1000, 2100, seed=9)
    assert np.array_equal(pixels[:1100], want) and np.array_equal(table.column("label").to_numpy()[:1100], labels)
    assert np.array_equal(pixels[-1], extended_samples(BASE_X, BASE_Y, 40, 41, seed=9)[0][0])
    assert table.schema.field("features").type == pa.binary() and table.schema.field("label").type == pa.int32()


def test_the_commands_deadline_grows_with_the_samples() -> None:
    from sparknet.tools.data import deadline_s

    assert deadline_s(100, None) == 600 and deadline_s(5_000_000, None) == 5000
    assert deadline_s(100, 30) == 30 and deadline_s(100, 0) is None
    with pytest.raises(ValueError, match="--timeout"):
        deadline_s(100, -1)


_CHILD = """
import sys
from test_extended_mnist import _fingerprint
print(_fingerprint())
"""


def _fingerprint() -> str:
    """SHA-256 of 1,500 samples, of the float32 points they were read at and of their float64 smoothed fields
    (where a last bit of BLAS's sums would show)."""
    import hashlib

    from sparknet.datasets._extended import _smoothed_fields, _source_points

    x, _ = extended_samples(BASE_X, BASE_Y, 0, 1500, seed=11)
    words = _random_words(11, 0, 1500)
    floats = [*_source_points(words, Deformation()), _smoothed_fields(words, 4.0)]
    return hashlib.sha256(x.tobytes() + b"".join(f.tobytes() for f in floats)).hexdigest()


def test_the_bytes_do_not_depend_on_the_vector_units_or_the_blas_kernel() -> None:
    """Another machine, as near as one process can get: numpy's loops without AVX, OpenBLAS's oldest x86 kernel on
    one thread (where those switches exist); the same samples and the floats that made them, bit for bit."""
    import os
    import platform
    import subprocess
    import sys

    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])}
    if platform.machine().lower() in ("x86_64", "amd64"):
        env["NPY_DISABLE_CPU_FEATURES"] = " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))
        env["OPENBLAS_CORETYPE"] = "Prescott"
    child = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120,
                           check=True)
    assert child.stdout.strip() == _fingerprint()
