"""Settings of asynchronous training through a parameter server (``--strategy async``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparknet.ps.combiners import COMBINERS

__all__ = ["AsyncConfig"]


@dataclass(kw_only=True)
class AsyncConfig:
    """Asynchronous training through a parameter server (--strategy async)

    A worker pushes and pulls every ``--tau`` local steps, as the synchronous strategies average.
    """

    combiner: str = field(default="delta", metadata={"choices": lambda: sorted(COMBINERS), "type": str.lower})
    """How a push merges into the server's copy (async strategy)."""
    ps_host: str | None = None
    """Address the parameter server binds to (default: loopback in local mode, the driver's host on a cluster)."""

    def __post_init__(self):
        if str(self.combiner).lower() not in COMBINERS:
            raise ValueError(f"unknown combiner {self.combiner!r}; choose one of {sorted(COMBINERS)}")
        self.combiner = str(self.combiner).lower()
