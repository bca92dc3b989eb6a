"""``sparknet train --strategy async``: the command line's hook into asynchronous training.

The ``train`` command turns the fields of :class:`~sparknet.ps.config.AsyncConfig` (:data:`TRAIN_FLAGS`) into
``--sync-interval``, ``--combiner`` and ``--ps-host`` and calls :func:`train_with`, which
runs :func:`~sparknet.ps.session.run_async` when ``--strategy async`` was asked for::

    sparknet train --model lenet --dataset mnist --workers 2 --strategy async \\
        --sync-interval 10 --combiner delta --steps 2000
"""

from __future__ import annotations

from sparknet.config import DistributedConfig, RunConfig, Strategy
from sparknet.ps.config import AsyncConfig
from sparknet.ps.session import run_async

__all__ = ["AsyncConfig", "TRAIN_FLAGS", "train_with"]


TRAIN_FLAGS = AsyncConfig
"""The dataclass whose fields ``sparknet train`` turns into flags."""


def train_with(run: RunConfig, dist: DistributedConfig, flags: AsyncConfig) -> dict | None:
    """Train asynchronously when ``dist.strategy`` is ``async``; ``None`` otherwise (not this part's run)."""
    if dist.strategy is not Strategy.ASYNC:
        return None
    return run_async(run, dist, sync_interval=flags.sync_interval, combiner=flags.combiner, ps_host=flags.ps_host)
