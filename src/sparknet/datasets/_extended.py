"""Extended MNIST: MNIST's training digits, elastically distorted and jittered, as many as asked.

Sample ``i`` (of seed ``s``) is base digit ``i mod N`` (``N`` base digits: MNIST's 50,000
training images) moved by an affine jitter (rotation, scale, shear, translation) and an
elastic distortion (Simard, Steinkraus and Platt, 2003: a displacement per pixel and axis,
uniform in (-1, 1), smoothed by a Gaussian of ``sigma`` pixels and scaled by ``alpha``),
resampled bilinearly (zero outside the image) and rounded back to uint8. It keeps its base
digit's label. :func:`extended_samples` makes any range of samples, a whole batch at once.

The same bytes everywhere
-------------------------
Sample ``i`` takes its randomness from words ``[i·W, (i+1)·W)`` of the PCG64 stream seeded
with ``s`` (``W`` = :data:`WORDS_PER_SAMPLE`; the stream jumps there with
``PCG64.advance``), so its bytes do not depend on which samples are made beside it, on the
partitioning or on the order. The arithmetic comes out the same on every machine: the
smoothing is a product of integer matrices whose sums stay below 2^53, so float64 BLAS gives
the exact result whatever its summation order; the rest is element-wise ``+ - * /``, floor
and rint, which IEEE 754 rounds one way; the rotation is built from tan(θ/2), with no sin or
cos. The Gaussian's weights (integers summing to 4096) and the rotation's bound (a multiple
of 2^-32) are rounded to a coarse grid, so last-bit differences of ``exp`` and ``tan``
between C libraries do not reach the pixels.

Executor side, :func:`arrow_samples` is the ``mapInArrow`` function that turns Spark's
``range`` ids into rows (``sparknet.datasets._extended_write`` runs it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["Deformation", "IMAGE_SHAPE", "WORDS_PER_SAMPLE", "ROW_SCHEMA", "extended_samples", "gaussian_weights",
           "arrow_samples", "contiguous_runs", "check_count"]

SIDE = 28
"""Height and width of a digit."""
IMAGE_SHAPE = (1, SIDE, SIDE)
"""The shape a net takes one extended-MNIST sample in (``image_shape=`` of ``SparkTrainer.fit``)."""
_FIELD_WORDS = 2 * SIDE * SIDE // 4  # two displacement fields, 16 bits a pixel, four to a 64-bit word
_AFFINE_WORDS = 5  # rotation, scale, shear, x and y translation
WORDS_PER_SAMPLE = _FIELD_WORDS + _AFFINE_WORDS
"""64-bit words of the PCG64 stream each sample draws."""
_KERNEL_SUM = 4096  # the Gaussian's integer weights sum to this (2^12)
_FIELD_UNIT = 65536  # a field value r (odd, |r| < 65536) means r / 65536
_FIELD_SCALE = 2.0 ** -40  # 1 / (_FIELD_UNIT * _KERNEL_SUM ** 2): the smoothed field in units of the uniform one
_GRID = 2.0 ** -32  # the rotation bound is rounded to a multiple of this
_PAD = 31  # a base digit padded with one zero row/column before and two after (index -1..29)
CHUNK = 1024
"""Samples deformed in one vectorised step (about 40 MB of temporaries)."""
ROW_SCHEMA = "features binary, label int, index long"
"""The rows :func:`arrow_samples` yields: 784 uint8 pixels (row-major 28 x 28), the label, the sample's index."""


@dataclass(frozen=True, kw_only=True)
class Deformation:
    """How far a digit is moved: the elastic distortion and the affine jitter.

    Every jitter is drawn uniformly in its range, independently per sample. The defaults
    are Simard et al.'s elastic distortion (sigma 4, alpha 34) and a mild affine jitter.
    All zeros make every sample a copy of its base digit.

    Raises
    ------
    ValueError
        A value is negative, not finite, or beyond its bound (stated in the message).
    """

    sigma: float = 4.0
    """Standard deviation of the Gaussian that smooths the displacement fields, in pixels (0 < sigma <= 28)."""
    alpha: float = 34.0
    """Scale of the smoothed displacement fields, in pixels (>= 0; 0: no elastic distortion)."""
    rotation: float = 10.0
    """Largest rotation, in degrees either way (0 <= rotation <= 90)."""
    scale: float = 0.1
    """Largest relative change of size: the digit is scaled by a factor in [1 - scale, 1 + scale] (0 <= scale < 1)."""
    shear: float = 0.15
    """Largest horizontal shear: x moves by up to shear · y either way (0 <= shear <= 1)."""
    translation: float = 2.0
    """Largest shift, in pixels, either way along each axis (0 <= translation <= 28)."""

    def __post_init__(self) -> None:
        for name, (allowed, text) in _RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Deformation.{name} must be a finite number, got {value!r}")
            if not allowed(value):
                raise ValueError(f"Deformation.{name} = {value} is out of range ({text})")

    @property
    def tan_half_rotation(self) -> float:
        """tan(rotation / 2), rounded to a multiple of 2^-32."""
        return math.floor(math.tan(math.radians(self.rotation) / 2) / _GRID + 0.5) * _GRID


_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "sigma": (lambda v: 0 < v <= SIDE, "0 < sigma <= 28 pixels"),
    "alpha": (lambda v: v >= 0, "alpha >= 0 pixels"),
    "rotation": (lambda v: 0 <= v <= 90, "0 <= rotation <= 90 degrees"),
    "scale": (lambda v: 0 <= v < 1, "0 <= scale < 1"),
    "shear": (lambda v: 0 <= v <= 1, "0 <= shear <= 1"),
    "translation": (lambda v: 0 <= v <= SIDE, "0 <= translation <= 28 pixels"),
}


def gaussian_weights(sigma: float) -> np.ndarray:
    """The Gaussian of ``sigma`` pixels as symmetric int64 weights ``[2 R + 1]`` that sum to exactly 4096.

    Taps reach ``R = min(ceil(3 sigma), 27)`` pixels either way (a digit is 28 wide); each is
    ``round(4096 g_k / sum g)``, and the centre takes what rounding left over.
    """
    if not (isinstance(sigma, (int, float)) and 0 < sigma <= SIDE):
        raise ValueError(f"sigma must be in (0, {SIDE}] pixels, got {sigma!r}")
    radius = min(math.ceil(3 * sigma), SIDE - 1)
    g = [math.exp(-(k * k) / (2.0 * sigma * sigma)) for k in range(-radius, radius + 1)]
    total = sum(g)
    w = np.array([math.floor(_KERNEL_SUM * v / total + 0.5) for v in g], dtype=np.int64)
    w[radius] += _KERNEL_SUM - int(w.sum())
    return w


def _smoothing_matrix(sigma: float) -> np.ndarray:
    """float64 ``[28, 28]`` of integers, ``G[a, b] = w[a - b]``: ``G @ F @ G.T`` smooths a field with zero padding."""
    w = gaussian_weights(sigma)
    radius = len(w) // 2
    offsets = np.arange(SIDE)[:, None] - np.arange(SIDE)[None, :]
    inside = np.abs(offsets) <= radius
    return np.where(inside, w[np.clip(offsets + radius, 0, len(w) - 1)], 0).astype(np.float64)


def _random_words(seed: int, start: int, count: int) -> np.ndarray:
    """uint64 ``[count, W]``: the words of samples ``start .. start + count - 1`` in seed's PCG64 stream."""
    bits = np.random.PCG64(seed)
    bits.advance(start * WORDS_PER_SAMPLE)
    return bits.random_raw(count * WORDS_PER_SAMPLE).reshape(count, WORDS_PER_SAMPLE)


def _smoothed_fields(words: np.ndarray, sigma: float) -> np.ndarray:
    """float64 ``[n, 2, 28, 28]`` of integers: each sample's two uniform fields (its first 392 words) smoothed.

    The value is the field in units of ``2^-40`` of the uniform one: 16 random bits b become the odd
    integer ``2b - 65535`` (uniform in (-1, 1) in units of 1/65536), and the Gaussian's integer weights
    sum to 2^12 along each axis. Every sum stays below 2^40, so float64 BLAS gives it exactly.
    """
    field_words = words[:, :_FIELD_WORDS]
    lanes = np.stack([(field_words >> np.uint64(16 * k)) & np.uint64(0xFFFF) for k in range(4)], axis=-1)
    n = len(words)
    field = lanes.reshape(n * 2 * SIDE, SIDE).astype(np.float64) * 2.0 - (_FIELD_UNIT - 1)
    g = _smoothing_matrix(sigma)
    rows = (field @ g.T).reshape(n * 2, SIDE, SIDE)
    both = (rows.transpose(0, 2, 1).reshape(-1, SIDE) @ g.T).reshape(n * 2, SIDE, SIDE).transpose(0, 2, 1)
    return both.reshape(n, 2, SIDE, SIDE)


def _displacements(words: np.ndarray, deformation: Deformation) -> np.ndarray:
    """float32 ``[n, 2, 28, 28]``: each sample's (dx, dy) in pixels."""
    smoothed = _smoothed_fields(words, deformation.sigma)
    return (smoothed * (deformation.alpha * _FIELD_SCALE)).astype(np.float32)


def _inverse_affines(words: np.ndarray, deformation: Deformation) -> tuple[np.ndarray, ...]:
    """float32 ``[n, 1, 1]`` each: ``m00, m01, m10, m11, tx, ty`` mapping an output pixel to its source.

    The forward jitter is ``p -> c + k R H (p - c) + t`` (rotation R by 2 atan(t), horizontal
    shear H, size factor k, shift t); its inverse is ``(1/k) H^-1 R^T (p - c - t) + c``.
    """
    u = (words[:, _FIELD_WORDS:] >> np.uint64(11)).astype(np.float64) * 2.0 ** -53  # [0, 1), exact
    v = 2.0 * u - 1.0
    t = deformation.tan_half_rotation * v[:, 0]
    cos = (1.0 - t * t) / (1.0 + t * t)
    sin = 2.0 * t / (1.0 + t * t)
    k = 1.0 + deformation.scale * v[:, 1]
    h = deformation.shear * v[:, 2]
    parts = ((cos + h * sin) / k, (sin - h * cos) / k, -sin / k, cos / k,
             deformation.translation * v[:, 3], deformation.translation * v[:, 4])
    return tuple(p.astype(np.float32)[:, None, None] for p in parts)


def _source_points(words: np.ndarray, deformation: Deformation) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[n, 28, 28]`` twice: where in its base digit each output pixel is read (x: column, y: row)."""
    m00, m01, m10, m11, tx, ty = _inverse_affines(words, deformation)
    centre = np.float32((SIDE - 1) / 2)
    grid = np.arange(SIDE, dtype=np.float32) - centre
    cx = grid[None, None, :] - tx
    cy = grid[None, :, None] - ty
    d = _displacements(words, deformation)
    x = (m00 * cx + m01 * cy) + centre + d[:, 0]
    y = (m10 * cx + m11 * cy) + centre + d[:, 1]
    return x, y


def _bilinear(digits: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """uint8 ``[n, 28, 28]``: each digit read at (x, y) with bilinear weights, zero outside it."""
    n = len(digits)
    padded = np.zeros((n, _PAD, _PAD), np.uint8)
    padded[:, 1:SIDE + 1, 1:SIDE + 1] = digits
    # Points beyond the border's zeros read zeros only: clip them onto it (weight 0 on the far side).
    x = np.clip(x, -1.0, float(SIDE), out=x)
    y = np.clip(y, -1.0, float(SIDE), out=y)
    x0 = np.floor(x)
    y0 = np.floor(y)
    fx = x - x0
    fy = y - y0
    index = ((y0.astype(np.int64) + 1) * _PAD + (x0.astype(np.int64) + 1)
             + (np.arange(n, dtype=np.int64) * _PAD * _PAD)[:, None, None])
    flat = padded.reshape(-1)

    def at(offset: int) -> np.ndarray:
        return flat.take(index + offset).astype(np.float32)

    gx = np.float32(1) - fx
    top = gx * at(0) + fx * at(1)
    bottom = gx * at(_PAD) + fx * at(_PAD + 1)
    value = (np.float32(1) - fy) * top + fy * bottom
    return np.clip(np.rint(value), 0, 255).astype(np.uint8)


def check_count(name: str, value, minimum: int) -> int:
    """``value`` as an int; ``ValueError`` unless it is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_base(images: np.ndarray, labels: np.ndarray) -> None:
    if not (isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.ndim == 3
            and images.shape[1:] == (SIDE, SIDE) and len(images)):
        spec = f"{images.dtype}{list(images.shape)}" if isinstance(images, np.ndarray) else type(images).__name__
        raise ValueError(f"base images must be uint8 [N, {SIDE}, {SIDE}] with N >= 1, got {spec}")
    if not (isinstance(labels, np.ndarray) and labels.ndim == 1 and len(labels) == len(images)
            and labels.dtype.kind in "iu"):
        spec = f"{labels.dtype}{list(labels.shape)}" if isinstance(labels, np.ndarray) else type(labels).__name__
        raise ValueError(f"base labels must be integers [{len(images)}], one per base image, got {spec}")


def extended_samples(images: np.ndarray, labels: np.ndarray, start: int, stop: int, *, seed: int = 0,
                     deformation: Deformation | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``start .. stop - 1`` (``0 <= start <= stop``) of the extended set grown from ``images``.

    ``images`` are the base digits, uint8 ``[N, 28, 28]`` (MNIST's training images, pixels 0..255),
    ``labels`` their integer labels ``[N]``; sample ``i`` deforms base digit ``i mod N`` as far as
    ``deformation`` says, drawn from the stream of ``seed`` (an integer >= 0). Returns uint8
    ``[stop - start, 28, 28]`` and the labels (``labels``' dtype): the same arguments give the same
    bytes on every machine, whatever range a sample is made in. Arguments out of range are a
    ``ValueError``.
    """
    _check_base(images, labels)
    start, stop, seed = (check_count(name, value, 0)
                         for name, value in (("start", start), ("stop", stop), ("seed", seed)))
    if stop < start:
        raise ValueError(f"stop ({stop}) must not be below start ({start})")
    deformation = deformation or Deformation()
    out = np.empty((stop - start, SIDE, SIDE), np.uint8)
    for a in range(start, stop, CHUNK):
        b = min(stop, a + CHUNK)
        words = _random_words(seed, a, b - a)
        x, y = _source_points(words, deformation)
        out[a - start:b - start] = _bilinear(images[np.arange(a, b) % len(images)], x, y)
    return out, labels[np.arange(start, stop) % len(images)]


# -- executor side ------------------------------------------------------------------------------
def contiguous_runs(ids: np.ndarray) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each run of consecutive integers in ``ids``, in order (Spark's ``range`` gives one)."""
    if len(ids) == 0:
        return
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    bounds = np.concatenate([[0], breaks, [len(ids)]])
    for a, b in zip(bounds[:-1], bounds[1:]):
        yield int(ids[a]), int(ids[b - 1]) + 1


def _record_batch(x: np.ndarray, y: np.ndarray, start: int):
    """Rows of :data:`ROW_SCHEMA` for samples ``start ..``: pixels as one Arrow binary column, no object per row."""
    import pyarrow as pa

    n = len(x)
    row = SIDE * SIDE
    offsets = pa.py_buffer(np.arange(0, (n + 1) * row, row, dtype=np.int32).tobytes())
    features = pa.BinaryArray.from_buffers(pa.binary(), n, [None, offsets, pa.py_buffer(x.tobytes())])
    return pa.RecordBatch.from_arrays(
        [features, pa.array(y.astype(np.int32)), pa.array(np.arange(start, start + n, dtype=np.int64))],
        names=["features", "label", "index"])


def arrow_samples(base, seed: int, deformation: Deformation) -> Callable[[Iterator], Iterator]:
    """The ``mapInArrow`` function: batches of Spark ``range`` ids -> rows of :data:`ROW_SCHEMA`.

    ``base`` is a Spark broadcast (anything with ``.value``) of ``(images, labels)`` as raw
    uint8 bytes (row-major ``[N, 28, 28]`` and ``[N]``); it is read once per task.
    """

    def generate(batches: Iterator) -> Iterator:
        image_bytes, label_bytes = base.value
        images = np.frombuffer(image_bytes, np.uint8).reshape(-1, SIDE, SIDE)
        labels = np.frombuffer(label_bytes, np.uint8)
        for batch in batches:
            ids = np.asarray(batch.column(0).to_numpy(zero_copy_only=False), dtype=np.int64)
            for start, stop in contiguous_runs(ids):
                for a in range(start, stop, CHUNK):
                    b = min(stop, a + CHUNK)
                    x, y = extended_samples(images, labels, a, b, seed=seed, deformation=deformation)
                    yield _record_batch(x, y, a)

    return generate
