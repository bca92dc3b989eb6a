"""A software model of a slow network link: every exchange waits latency + bytes / bandwidth.

The SparkNet paper could only *model* a cluster whose communication is slow (its Figure 4
plots speedup against a chosen overhead S). With a :class:`LinkModel` an engine makes every
exchange really take as long as it would over a given link, so wall-clock time to accuracy
can be measured on one machine as the link slows::

    >>> link = LinkModel.parse("50ms", "100Mbit")
    >>> round(link.delay(1_724_320), 4)       # LeNet's weights, once
    0.188
    >>> link.wait(1_724_320)                  # doctest: +SKIP
    0.188...

Units: latency in ``s``, ``ms``, ``us`` (a bare number is seconds); bandwidth in ``bit``,
``Kbit``, ``Mbit``, ``Gbit`` per second (decimal prefixes, as ``tc`` reads them; a ``/s``
suffix is accepted), a bare number being bits per second. Byte spellings (``MB``, ``mbps``)
are refused rather than guessed at. A link with no
bandwidth (``None``) has infinite bandwidth; ``LinkModel()`` costs nothing.

This module never imports pyspark; a ``LinkModel`` pickles, so it travels to executors.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

__all__ = ["LinkModel", "parse_duration", "parse_bandwidth", "format_bandwidth", "format_duration"]

_DURATION_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_BANDWIDTH_UNITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def parse_duration(text: str | float | int | None) -> float:
    """Seconds from ``"50ms"``, ``"1.5s"``, ``"200us"`` or a number of seconds.

    Raises
    ------
    ValueError
        Not a non-negative duration with a known unit.
    """
    if text is None:
        return 0.0
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(_NUMBER + r"([a-zµ]*)\s*", str(text).strip().lower())
        if not m or m.group(2) not in _DURATION_UNITS:
            raise ValueError(f"cannot read {text!r} as a duration; write e.g. 50ms, 1.5s or 200us")
        value = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"a duration must be a non-negative number of seconds, got {text!r}")
    return value


def parse_bandwidth(text: str | float | int | None) -> float | None:
    """Bits per second from ``"100Mbit"``, ``"1Gbit/s"``, ``"500kbit"`` or a number; ``None`` or
    ``"inf"`` for an unlimited link.

    Raises
    ------
    ValueError
        Not a positive bandwidth with a known unit.
    """
    if text is None:
        return None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = str(text).strip().lower()
        if s in ("inf", "infinite", "unlimited", "none"):
            return None
        m = re.fullmatch(_NUMBER + r"([a-z]*)(?:/s)?\s*", s)
        if not m or m.group(2) not in _BANDWIDTH_UNITS:
            raise ValueError(f"cannot read {text!r} as a bandwidth; write e.g. 100Mbit, 1Gbit or 500Kbit "
                             "(bits per second)")
        value = float(m.group(1)) * _BANDWIDTH_UNITS[m.group(2)]
    if math.isinf(value):
        return None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a bandwidth must be a positive number of bits per second, got {text!r}")
    return value


def format_bandwidth(bits_per_s: float | None) -> str:
    """``100Mbit`` for 1e8; ``inf`` for an unlimited link."""
    if bits_per_s is None:
        return "inf"
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("Kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def format_duration(seconds: float) -> str:
    """``50ms`` for 0.05."""
    if seconds == 0:
        return "0s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds / 1e-9:g}ns"


@dataclass(frozen=True)
class LinkModel:
    """A link that delays every message by ``latency_s + nbytes * 8 / bandwidth_bits_per_s``.

    Parameters
    ----------
    latency_s : float
        One-way latency of every message, in seconds.
    bandwidth_bits_per_s : float, optional
        Bits per second; ``None`` for unlimited bandwidth.
    """

    latency_s: float = 0.0
    bandwidth_bits_per_s: float | None = None

    def __post_init__(self):
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be a non-negative number of seconds, got {self.latency_s}")
        if self.bandwidth_bits_per_s is not None and not (math.isfinite(self.bandwidth_bits_per_s)
                                                          and self.bandwidth_bits_per_s > 0):
            raise ValueError(f"bandwidth_bits_per_s must be positive (or None for unlimited), "
                             f"got {self.bandwidth_bits_per_s}")

    @classmethod
    def parse(cls, latency: str | float | None = None, bandwidth: str | float | None = None) -> LinkModel:
        """A link from command-line spellings: ``LinkModel.parse("50ms", "100Mbit")``."""
        return cls(parse_duration(latency), parse_bandwidth(bandwidth))

    @property
    def is_free(self) -> bool:
        """Whether the link costs nothing (zero latency, unlimited bandwidth)."""
        return self.latency_s == 0 and self.bandwidth_bits_per_s is None

    def delay(self, nbytes: int) -> float:
        """Seconds one message of ``nbytes`` bytes takes over this link."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        transfer = 0.0 if self.bandwidth_bits_per_s is None else nbytes * 8.0 / self.bandwidth_bits_per_s
        return self.latency_s + transfer

    def wait(self, nbytes: int) -> float:
        """Sleep for :meth:`delay` ``(nbytes)`` seconds; returns the seconds slept."""
        return self._sleep(self.delay(nbytes))

    def allreduce_delay(self, nbytes: int, world: int) -> float:
        """Seconds a ring allreduce of an ``nbytes`` buffer over ``world`` ranks takes on this link.

        Gloo's ring runs ``2 (world - 1)`` steps (reduce-scatter, then all-gather), each rank
        sending one ``nbytes / world`` chunk per step to its neighbour over its own link, so
        every rank spends ``2 (world - 1)`` latencies and sends ``2 (world - 1) / world * nbytes``.
        Zero for one rank.
        """
        if world < 1:
            raise ValueError(f"world must be at least 1, got {world}")
        if world == 1:
            return 0.0
        steps = 2 * (world - 1)
        transfer = 0.0 if self.bandwidth_bits_per_s is None else steps * (nbytes / world) * 8.0 / self.bandwidth_bits_per_s
        return steps * self.latency_s + transfer

    def allgather_delay(self, nbytes: int, world: int) -> float:
        """Seconds a ring all-gather of one ``nbytes`` message from each of ``world`` ranks takes.

        ``world - 1`` steps, each rank forwarding one whole message to its neighbour per step
        (what the engines use for compressed updates, which cannot be summed on the way).
        Zero for one rank.
        """
        if world < 1:
            raise ValueError(f"world must be at least 1, got {world}")
        if world == 1:
            return 0.0
        return (world - 1) * self.delay(nbytes)

    def wait_allreduce(self, nbytes: int, world: int) -> float:
        """Sleep for :meth:`allreduce_delay`; returns the seconds slept."""
        return self._sleep(self.allreduce_delay(nbytes, world))

    @staticmethod
    def _sleep(seconds: float) -> float:
        if seconds > 0:
            time.sleep(seconds)
        return seconds

    def describe(self) -> str:
        """``50ms, 100Mbit`` (for logs and plot labels)."""
        return f"{format_duration(self.latency_s)}, {format_bandwidth(self.bandwidth_bits_per_s)}"

    def to_dict(self) -> dict:
        return {"latency_s": self.latency_s, "bandwidth_bits_per_s": self.bandwidth_bits_per_s,
                "label": self.describe()}
