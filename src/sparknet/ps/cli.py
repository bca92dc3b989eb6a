"""``sparknet train --strategy async``: the command line's hook into asynchronous training.

The ``train`` command turns the fields of :class:`AsyncConfig` (:data:`TRAIN_FLAGS`) into
``--sync-interval``, ``--combiner`` and ``--ps-host`` and calls :func:`train_with`, which
runs :func:`~sparknet.ps.session.run_async` when ``--strategy async`` was asked for::

    sparknet train --model lenet --dataset mnist --workers 2 --strategy async \\
        --sync-interval 10 --combiner delta --steps 2000
"""

from __future__ import annotations

from dataclasses import dataclass

from sparknet.config import DistributedConfig, RunConfig, Strategy
from sparknet.ps.combiners import COMBINERS

__all__ = ["AsyncConfig", "TRAIN_FLAGS", "train_with"]


@dataclass(kw_only=True)
class AsyncConfig:
    """Asynchronous training through a parameter server (--strategy async)"""

    sync_interval: int = 10
    """Local steps between a worker's push-and-pull with the parameter server (async strategy)."""
    combiner: str = "delta"
    """How a push merges into the server's copy: mean, delta, staleness or elastic (async strategy)."""
    ps_host: str | None = None
    """Address the parameter server binds to (default: loopback in local mode, the driver's host on a cluster)."""

    def __post_init__(self):
        if self.sync_interval < 1:
            raise ValueError(f"sync_interval must be at least 1, got {self.sync_interval}")
        if str(self.combiner).lower() not in COMBINERS:
            raise ValueError(f"unknown combiner {self.combiner!r}; choose one of {sorted(COMBINERS)}")
        self.combiner = str(self.combiner).lower()


TRAIN_FLAGS = AsyncConfig
"""The dataclass whose fields ``sparknet train`` turns into flags."""


def train_with(run: RunConfig, dist: DistributedConfig, flags: AsyncConfig) -> dict | None:
    """Train asynchronously when ``dist.strategy`` is ``async``; ``None`` otherwise (not this part's run)."""
    if dist.strategy is not Strategy.ASYNC:
        return None
    from sparknet.ps.session import run_async

    return run_async(run, dist, sync_interval=flags.sync_interval, combiner=flags.combiner, ps_host=flags.ps_host)
