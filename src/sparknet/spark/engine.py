"""What an engine gets for one fit (:class:`EngineRun`: the plan, the data and the engines' settings,
:class:`~sparknet.config.EngineOptions`).

:meth:`SparkTrainer.fit <sparknet.spark.trainer.SparkTrainer.fit>` builds one :class:`EngineRun` (the plan, the data,
the settings) and hands it to the engine (:func:`sparknet.spark.rounds.driver.run_rounds_engine`,
:func:`sparknet.spark.barrier.driver.run_barrier_engine`, :func:`~sparknet.spark.barrier.driver.run_connect_stage`);
what an engine may ask of the driver is two calls on it: :meth:`EngineRun.emit` (a round record to the user) and
:meth:`EngineRun.save_checkpoint`. No engine sees the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sparknet.checkpoint import RoundCheckpoints, rng_state
from sparknet.config import DistributedConfig, EngineOptions
from sparknet.net import Net
from sparknet.spark.session import is_local_master
from sparknet.spark.rounds.executor import WorkerSpec
from sparknet.loop import FitPlan, ResumeState

__all__ = ["EngineRun"]


@dataclass(frozen=True, kw_only=True)
class EngineRun:
    """One fit as an engine gets it: its plan, its data, and what it may ask of the driver."""

    sc: Any
    """The SparkContext (a Spark Connect session's SparkSession on that road)."""
    group: str
    """The fit's job group (or tag): what a deadline cancels."""
    source: Any
    """What the tasks train on: the staged partitions (rounds engine) or the chunks (barrier engine)."""
    chunks: Any
    """The fit's persisted training chunks, one partition a worker."""
    spec: WorkerSpec
    """What every task needs (packed once per fit)."""
    global_flat: torch.Tensor
    """The global weights to start from."""
    plan: FitPlan
    """The fit's rules: strategy, stopping, evaluation, automatic tau, moving average, counters to go on from."""
    validation: Any
    """The validation rows as ``(x, y)`` arrays, or ``(x, y, w)`` with each row's sample weight; where they stay in
    Spark (``eval_sharded``), their :class:`~sparknet.spark.rounds.validation.ValidationShards`; ``None``: none."""
    driver_net: Net
    """The driver's net: evaluates the global weights and writes them into checkpoints."""
    broadcasts: list
    """Where broadcasts that outlive a round are kept for the fit's cleanup."""
    t_fit: float
    """``time.perf_counter()`` when the fit started (what the records' ``wall_s`` counts from)."""
    dist: DistributedConfig
    options: EngineOptions
    rows: tuple[int, ...]
    """Training rows per partition."""
    emit: Callable[..., None]
    """``emit(record, latest=None)`` hands a round record to the user (``on_round``) as it happens; ``latest``: the
    global weights after it, where the driver holds them (the trainer's ``latest_flat``)."""
    checkpoints: RoundCheckpoints | None = None
    resume: ResumeState | None = None
    """The state a resumed fit starts from (its checkpoint's), or ``None``."""
    split: dict | None = None
    """The plan each worker's layers are split over its processes by (``--model-parallel``: layer name to ``column``
    or ``row``), or ``None``."""

    def driver_address(self) -> tuple[bool, str]:
        """Whether every executor runs on this machine (a local master), and the host they reach the driver at."""
        local = is_local_master(self.sc.master)
        return local, "127.0.0.1" if local else (self.sc.getConf().get("spark.driver.host") or "127.0.0.1")

    def state_bytes(self) -> int:
        """The most bytes of one worker's state: its solver's (a few copies of the weights) and strategy's, and its
        shuffle order (8 bytes a row)."""
        return 32 * int(self.global_flat.numel()) + 8 * max(self.rows, default=0) + (1 << 20)

    def save_checkpoint(self, engine: str, state: ResumeState) -> str:
        """Write the checkpoint of round ``state.round``: its global weights, counters and workers' states, the
        strategy's (``None``: the driver's own) and the driver's RNG states; returns its path."""
        self.driver_net.set_flat(state.global_flat)
        saved = {"engine": engine, **state.counters(), "workers": state.workers,
                 "strategy": self.plan.strategy.state_dict() if state.strategy is None else state.strategy,
                 "rng": rng_state()}
        return self.checkpoints.save(state.round, self.driver_net.get_weights(), saved)
