"""What an engine gets for one fit (:class:`EngineRun`), and the engines' settings (:class:`EngineOptions`).

:meth:`SparkTrainer.fit <sparknet.spark.trainer.SparkTrainer.fit>` builds one :class:`EngineRun` (the plan, the data,
the settings) and hands it to the engine (:func:`sparknet.spark.rounds.driver.run_rounds_engine`,
:func:`sparknet.spark.barrier.driver.run_barrier_engine`, :func:`~sparknet.spark.barrier.driver.run_connect_stage`);
what an engine may ask of the driver is two calls on it: :meth:`EngineRun.emit` (a round record to the user) and
:meth:`EngineRun.save_checkpoint`. No engine sees the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sparknet.checkpoint import RoundCheckpoints, rng_state
from sparknet.config import DistributedConfig
from sparknet.faults import faults_from
from sparknet.link import LinkModel
from sparknet.net import Net
from sparknet.spark.session import is_local_master
from sparknet.spark.rounds.executor import WorkerSpec
from sparknet.loop import FitPlan, ResumeState

__all__ = ["EngineOptions", "EngineRun"]


@dataclass(kw_only=True)
class EngineOptions:
    """Settings of the Spark engines beyond :class:`~sparknet.config.DistributedConfig`."""

    staging_dir: str | None = None
    """Rounds engine: where executors keep each partition's arrays (default: their Spark local directory)."""
    storage_level: str = "MEMORY_AND_DISK"
    """How Spark caches the converted training chunks (a ``pyspark.StorageLevel`` name; ``MEMORY_AND_DISK_2``
    keeps a copy on a second host, so a partition that moves after a host is lost trains on the same rows in
    the same order)."""
    worker_state_on_driver: bool | None = None
    """Rounds engine: every task also sends its solver and strategy state to the driver each round, and a
    partition that moves to another host (a host lost) continues from it instead of from a fresh solver.
    Default: on a cluster (not on a local master, whose executors share one disk and find the state there)."""
    elastic_after_s: float | None = 60.0
    """Rounds engine: how long the cluster may have fewer task slots than workers (a host lost) before
    each round trains only as many workers as there are slots, a different few each round in turn, so
    that a round takes the time of one task again and every partition's rows still get their turn
    (a host that comes back is used again from the next round). Until then, and always with ``None``,
    Spark runs the K tasks in waves on the hosts left, and the weights are those of an undisturbed run.
    Needs the driver to hold the workers' states (:attr:`worker_state_on_driver`, on by default on a
    cluster). Barrier engine: how long a failed stage waits for the slots of all its workers before it starts
    again with as many whole workers (each of its ``procs_per_worker`` processes on a slot) as the cluster has
    slots for, their partitions holding every row (a worker left takes those of one that left), their solver
    states afresh. Once the cluster has the slots of more whole workers, the stage of fewer is stopped after its
    round and started again with them (all of them: each on its own partition). With ``None`` the stage waits
    :attr:`rendezvous_timeout_s` for all of them, then fails."""
    rounds_transport: str = "socket"
    """Rounds engine: how the weights and updates travel. ``socket``: through an authenticated socket on the
    driver beside each round's Spark job (:mod:`sparknet.spark._relay`: a Unix socket only the user can open on a
    local master, TCP with CurveZMQ and one key per fit on a cluster), so a round costs little more than Spark's
    job; should a task not reach it (a firewall between the executors and the
    driver), that fit goes on through Spark. ``spark``: through a broadcast and the task results, nothing
    but Spark's own connections."""
    warmup_max_samples: int = 20_000
    """Most training rows collected to the driver for the warm-up steps."""
    warmup_max_bytes: int = 256 << 20
    """Most feature bytes collected to the driver for the warm-up steps."""
    rendezvous_timeout_s: float = 180.0
    """Barrier engine: longest wait for every task to start and join the process group."""
    collective_timeout_s: float = 300.0
    """Barrier engine: longest wait of one collective (the gloo process group's timeout)."""
    driver_timeout_s: float | None = None
    """Barrier engine: longest silence from the stage between two rounds before the driver cancels it
    (default: collective_timeout_s + round_seconds + 60)."""
    round_timeout_s: float | None = None
    """Rounds engine: longest wait for one round's Spark job; past it the job is cancelled and a
    DeadlineExceeded names the round and the tasks not finished. Default: 30 minutes for the first
    round of a fit, then 20 times the slowest step time seen so far times the round's steps, at
    least 10 minutes, bounded by round_seconds for time-budgeted rounds
    (:func:`sparknet.spark.backend.default_round_deadline`)."""
    data_timeout_s: float = 3600.0
    """Longest wait for one Spark job on the fit's data (conversion and check, staging, the validation
    collect, the warm-up sample); past it the jobs are cancelled and a DeadlineExceeded says which."""
    max_restarts: int = 3
    """Barrier engine: how many times a failed stage is started again from the driver's newest state."""
    state_every_rounds: int = 1
    """Barrier engine: rounds between the global weights and strategy state sent to the driver (what a
    restart starts from)."""
    fault: str | None = None
    """Injected faults for reliability tests, e.g. ``rank=1,round=3,kind=kill`` (see sparknet.faults; default none:
    faults are set here only, never read from the environment)."""
    link: LinkModel | None = None
    """A simulated slow network (:class:`sparknet.link.LinkModel`): in the rounds engine each task waits
    ``link.delay(bytes)`` for its download of the weights and again for its upload; in the barrier engine
    every rank waits the collective's delay before each collective (each step's, for sync). The waits are
    recorded per round (``link_s``). Default: ``dist.link_latency``/``dist.link_bandwidth``, else none."""

    CODE_ONLY: ClassVar[frozenset[str]] = frozenset({"fault", "link"})
    """Fields set in code only, never flags or Params: injected faults (reliability tests) and a link model
    (``--link-latency`` and ``--link-bandwidth`` make one)."""

    def holds_worker_state(self, master: str) -> bool:
        """Whether the driver holds the workers' states (:attr:`worker_state_on_driver`) on ``master``."""
        return not is_local_master(master) if self.worker_state_on_driver is None else self.worker_state_on_driver

    def __post_init__(self):
        from pyspark import StorageLevel

        if not hasattr(StorageLevel, str(self.storage_level)):
            raise ValueError(f"unknown storage level {self.storage_level!r} (e.g. MEMORY_AND_DISK, DISK_ONLY)")
        for name in ("warmup_max_samples", "warmup_max_bytes", "state_every_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.rounds_transport not in ("socket", "spark"):
            raise ValueError(f"rounds_transport must be 'socket' or 'spark', got {self.rounds_transport!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, got {self.max_restarts}")
        faults_from(self.fault)  # a bad fault spec fails here, not on the executors
        if self.link is not None and not isinstance(self.link, LinkModel):
            raise ValueError(f"link must be a sparknet.link.LinkModel (e.g. LinkModel.parse('50ms', '100Mbit')), "
                             f"got {type(self.link).__name__}")
        if self.elastic_after_s is not None and not (math.isfinite(self.elastic_after_s) and self.elastic_after_s >= 0):
            raise ValueError(f"elastic_after_s must be 0 or more seconds, or None (never), got {self.elastic_after_s}")
        for name in ("rendezvous_timeout_s", "collective_timeout_s", "driver_timeout_s", "round_timeout_s",
                     "data_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")


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
    validation: tuple | None
    """The validation rows as ``(x, y)`` arrays, or ``None``."""
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
