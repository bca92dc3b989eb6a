"""Settings of asynchronous training through a parameter server (``--strategy async``)."""

from __future__ import annotations

from dataclasses import dataclass

from sparknet.ps.combiners import COMBINERS

__all__ = ["AsyncConfig"]


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
