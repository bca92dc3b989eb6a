"""Combiners: how a worker's push merges into the parameter server's copy.

The server calls its combiner once per accepted push, on the server's own thread (so it needs no locking); the reply
tells the worker to set ``local += mix * (reply - local)``. Built in (:data:`COMBINERS`, by the names the command line
takes): ``mean``, ``delta``, ``staleness``, ``elastic``. A user-defined combiner subclasses :class:`Combiner`;
:func:`register_combiner` gives it a name. Combiners run on the driver only: nothing of them reaches the executors but
the two numbers the reply carries.

>>> import numpy as np
>>> server = np.zeros(3, np.float32)
>>> DeltaCombiner().combine(server, np.ones(3, np.float32), staleness=0, num_workers=2)
>>> server
array([1., 1., 1.], dtype=float32)
"""

from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np

__all__ = [
    "Combiner", "MeanCombiner", "DeltaCombiner", "StalenessAwareDeltaCombiner", "ElasticCombiner",
    "COMBINERS", "make_combiner", "register_combiner",
]


class Combiner(abc.ABC):
    """How a push merges into the server's copy. Subclass it for a user-defined rule.

    Subclasses set :attr:`sends_delta` (what workers push) and implement :meth:`combine`; they may override
    :meth:`reply_mix` and :attr:`reply_before_combine`."""

    name: ClassVar[str] = "custom"
    """The registry name (for the command line and metrics)."""
    sends_delta: ClassVar[bool] = False
    """Workers push ``weights - last pulled weights`` (True) or their weights (False)."""
    reply_before_combine: ClassVar[bool] = False
    """The reply carries the server's copy from before this push was combined (EASGD's symmetric step: both sides
    move toward the other's old value)."""

    @abc.abstractmethod
    def combine(self, server: np.ndarray, pushed: np.ndarray, *, staleness: int, num_workers: int) -> np.ndarray | None:
        """Merge one push into the server's copy.

        Parameters
        ----------
        server : ndarray
            The server's flat float32 copy; update it in place and return None, or return a new array of the
            same shape and dtype.
        pushed : ndarray
            The worker's flat buffer (read-only): its weights, or its change since its last
            pull when :attr:`sends_delta`.
        staleness : int
            Pushes applied by other workers since this worker last pulled (0: it saw the newest copy).
        num_workers : int
            Workers in the job.
        """

    def reply_mix(self, *, num_workers: int) -> float:
        """The fraction by which a worker moves from its weights toward the reply (1: take it)."""
        return 1.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MeanCombiner(Combiner):
    """The server copy becomes the mean of itself and the pushed weights (TensorOnSpark)."""

    name = "mean"

    def combine(self, server, pushed, *, staleness, num_workers):
        np.add(server, pushed, out=server)
        server *= np.float32(0.5)


class DeltaCombiner(Combiner):
    """Adds ``scale`` times the worker's change since its last pull (DistBelief's Downpour): 1 is plain
    asynchronous SGD; ``1/num_workers`` damps K workers."""

    name = "delta"
    sends_delta = True

    def __init__(self, scale: float = 1.0):
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive number, got {scale}")
        self.scale = float(scale)

    def factor(self, staleness: int) -> float:
        """The factor on a delta pushed with this staleness."""
        return self.scale

    def combine(self, server, pushed, *, staleness, num_workers):
        f = self.factor(staleness)
        if f == 1.0:
            np.add(server, pushed, out=server)
        else:
            server += np.float32(f) * pushed

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale})"


class StalenessAwareDeltaCombiner(DeltaCombiner):
    """A delta scaled by ``scale / (1 + staleness)``: stale changes count for less."""

    name = "staleness"

    def factor(self, staleness: int) -> float:
        return self.scale / (1.0 + max(0, staleness))


class ElasticCombiner(Combiner):
    """Asynchronous elastic averaging (EASGD, Zhang, Choromanska and LeCun 2015).

    On a push of worker weights ``x``, the center ``c`` moves toward it, ``c += alpha * (x - c)``, and the reply
    (the center before this move) tells the worker to move toward the center by the same ``alpha``:
    ``x += alpha * (c - x)``. ``alpha`` is in (0, 1), by default ``beta / num_workers`` (``beta``: 0.9, the paper's).
    """

    name = "elastic"
    reply_before_combine = True

    def __init__(self, alpha: float | None = None, beta: float = 0.9):
        if alpha is not None and not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not 0 < beta <= 1:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        self.alpha = alpha
        self.beta = float(beta)

    def _alpha(self, num_workers: int) -> float:
        return self.alpha if self.alpha is not None else min(self.beta / max(1, num_workers), 0.99)

    def combine(self, server, pushed, *, staleness, num_workers):
        server += np.float32(self._alpha(num_workers)) * (pushed - server)

    def reply_mix(self, *, num_workers):
        return self._alpha(num_workers)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self.alpha}, beta={self.beta})"


COMBINERS: dict[str, type[Combiner]] = {
    "mean": MeanCombiner,
    "delta": DeltaCombiner,
    "staleness": StalenessAwareDeltaCombiner,
    "elastic": ElasticCombiner,
}
"""Combiner classes by name (``--combiner mean|delta|staleness|elastic``)."""


def register_combiner(name: str, cls: type[Combiner]) -> None:
    """Make a user-defined combiner available by ``name`` (to :func:`make_combiner`)."""
    if not (isinstance(cls, type) and issubclass(cls, Combiner)):
        raise TypeError(f"a combiner must subclass sparknet.ps.Combiner, got {cls!r}")
    key = name.lower()
    if key in COMBINERS and COMBINERS[key] is not cls:
        raise ValueError(f"a combiner named {name!r} is already registered ({COMBINERS[key].__name__})")
    COMBINERS[key] = cls


def make_combiner(spec: str | Combiner, **kwargs) -> Combiner:
    """A combiner from its registry name (keyword arguments go to its class) or as given."""
    if isinstance(spec, Combiner):
        if kwargs:
            raise ValueError("keyword arguments are for a combiner given by name")
        return spec
    if isinstance(spec, type) and issubclass(spec, Combiner):
        return spec(**kwargs)
    key = str(spec).lower()
    if key not in COMBINERS:
        raise ValueError(f"unknown combiner {spec!r}; choose one of {sorted(COMBINERS)} "
                         "or pass a sparknet.ps.Combiner instance")
    return COMBINERS[key](**kwargs)
