"""Training strategies: what a worker does around its local steps, and how the results merge.

The engines (one process, Spark rounds, Spark barrier) all run the same loop::

    global_flat = strategy.init_global(initial_weights)           # driver / every rank
    every round:
        worker:  strategy.worker_begin(state, net, global_flat)   # load (or pull toward) the global weights
                 net.train(tau, max_seconds, after_backward=strategy.after_backward)
                 delta = strategy.worker_delta(state, net, global_flat)   # what is sent: change since global
        engine:  mean_delta = sum(n_i * delta_i) / sum(n_i)          # weights = samples processed
        driver:  global_flat = strategy.apply(global_flat, mean_delta, num_workers)

Deltas are one flat float32 buffer each (one message per worker per round). A strategy
keeps its driver-side state (e.g. DiLoCo's outer momentum) on the object and its
worker-side state in a ``WorkerState`` the engine keeps per worker.

This module never imports pyspark.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparknet.config import Strategy

__all__ = ["TrainingStrategy", "WorkerState", "Average", "make_strategy"]


@dataclass
class WorkerState:
    """What one worker keeps between rounds (its own weights for EASGD, error-feedback residuals...)."""

    local_flat: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


class TrainingStrategy(abc.ABC):
    """One way of combining K workers' local training. Subclasses override the hooks they need."""

    name: Strategy
    #: Whether the engine must call :meth:`after_backward` (gradient allreduce every step).
    needs_gradient_hook: bool = False
    #: Whether workers keep their own weights between rounds instead of restarting from the global ones.
    keeps_local_weights: bool = False

    def init_global(self, flat: torch.Tensor) -> torch.Tensor:
        """The global weights training starts from (driver side)."""
        return flat.clone()

    def worker_begin(self, state: WorkerState, net, global_flat: torch.Tensor) -> None:
        """Load the global weights into the worker's net before its local steps."""
        net.set_flat(global_flat)

    def worker_delta(self, state: WorkerState, net, global_flat: torch.Tensor) -> torch.Tensor:
        """The worker's message for this round: its weights minus the global weights."""
        return net.get_flat() - global_flat

    @abc.abstractmethod
    def apply(self, global_flat: torch.Tensor, mean_delta: torch.Tensor, num_workers: int) -> torch.Tensor:
        """New global weights from the sample-weighted mean of the workers' deltas."""

    def after_backward(self, net) -> None:  # pragma: no cover - only strategies that need it override
        """Called between backward and the optimizer step (gradient strategies)."""

    def state_dict(self) -> dict:
        """Driver-side state for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Average(TrainingStrategy):
    """SparkNet's scheme: the new global weights are the sample-weighted mean of the workers'."""

    name = Strategy.AVERAGE

    def apply(self, global_flat, mean_delta, num_workers):
        return global_flat + mean_delta


_REGISTRY: dict[Strategy, Callable[..., TrainingStrategy]] = {Strategy.AVERAGE: Average}


def register(name: Strategy, factory: Callable[..., TrainingStrategy]) -> None:
    """Make a strategy available to :func:`make_strategy` (and so to the CLI)."""
    _REGISTRY[name] = factory


def make_strategy(name: Strategy | str, **options) -> TrainingStrategy:
    """Build the strategy called ``name`` with its options."""
    from sparknet.config import parse_enum

    key = parse_enum(Strategy, name, "strategy")
    if key not in _REGISTRY:
        raise ValueError(f"strategy {key.value!r} is not available in this engine")
    return _REGISTRY[key](**options)
