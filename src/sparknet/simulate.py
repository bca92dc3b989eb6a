"""K logical workers in one process, running the very strategy code the Spark engines run.

Iterations, not seconds, are what this counts: how many rounds and local steps a strategy
needs to reach a target accuracy for a given K and tau (the SparkNet paper's Figure 3 is
built this way, with S = 0). It is :func:`sparknet.loop.run_rounds` with an
:class:`~sparknet.loop.InProcessExchange`: workers train one after another on their own
shards, from the same global weights, and their deltas are combined as on Spark.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from sparknet.config import CompressionKind, Strategy, Streaming, parse_enum
from sparknet.loop import EvalPlan, FitPlan, InProcessExchange, StopRule, run_rounds
from sparknet.step import worker_seed
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.strategies import make_strategy

__all__ = ["SimulationResult", "simulate"]

log = logging.getLogger(__name__)


@dataclass
class SimulationResult:
    """What a simulated run took, and whether it reached its target."""

    strategy: str
    workers: int
    tau: int
    reached: bool
    rounds: int
    steps_per_worker: int
    total_steps: int
    bytes: int
    accuracy: float
    wall_s: float
    history: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def simulate(net_params, train, test, *, workers: int, tau: int, strategy: Strategy | str = "average",
             solver: SolverConfig | None = None, batch_size: int = 64, target_accuracy: float | None = None,
             steps: int = 10000, eval_every_steps: int | None = None, eval_samples: int | None = None,
             compression: CompressionKind | str = CompressionKind.NONE, seed: int = 0,
             strategy_options: dict | None = None, weight_ema: float | None = None, overlap: bool = False,
             fragments: int = 1) -> SimulationResult:
    """Train ``workers`` logical workers with ``strategy`` until the target or ``steps``.

    Parameters
    ----------
    net_params : NetParams (or a module factory)
        The network; each worker builds its own copy.
    train, test : ArrayDataset
        Training data (sharded evenly across workers) and the evaluation set.
    tau : int
        Local steps per round (for ``sync``: steps between evaluations).
    steps : int
        Local steps per worker at most.
    eval_every_steps : int, optional
        Evaluate the global weights every this many local steps (rounded up to whole
        rounds); default every round.
    compression : str
        none, fp16, bf16 or int8 (with error feedback) for the workers' deltas.
    weight_ema : float, optional
        Keep a moving average of the global weights with this decay per round
        (:class:`~sparknet.loop.WeightAverage`): the history's ``accuracy`` (and the target) is then the
        average's, ``global_accuracy`` the global weights'.
    overlap, fragments : optional
        Each round's average applied one round late, and one of ``fragments`` parts of the weights exchanged a
        round (:class:`~sparknet.config.Streaming`; average and diloco).
    """
    if workers < 1 or tau < 1:
        raise ValueError(f"workers and tau must be at least 1, got {workers}, {tau}")
    name = parse_enum(Strategy, strategy, "strategy")
    solver = solver or SolverConfig()
    t0 = time.perf_counter()
    test_x, test_y = (test.x, test.y) if eval_samples is None else (test.x[:eval_samples], test.y[:eval_samples])
    evaluator = Net(net_params, solver, batch_size=batch_size, seed=seed)
    evaluator.set_validation_data((test_x, test_y))
    strat = make_strategy(name, **{"num_workers": workers, **(strategy_options or {})})
    if name is Strategy.SYNC:
        # Gradients averaged every step over K equal batches = one step on a K-times larger batch.
        net = Net(net_params, solver, batch_size=batch_size * workers, seed=seed)
        net.set_training_data(train)
        nets = [net]
    else:
        nets = []
        for i in range(workers):
            net = Net(net_params, solver, batch_size=batch_size, seed=worker_seed(seed, i))
            net.set_training_data(train.shard(i, workers))
            nets.append(net)
    streaming = Streaming(overlap=overlap, fragments=fragments) if overlap or fragments != 1 else None
    exchange = InProcessExchange(nets, strat, evaluator=evaluator, compression=compression, streaming=streaming)
    history: list[dict] = []

    def on_record(record: dict) -> None:
        if "val_accuracy" in record:
            history.append({"round": record["round"], "steps": record["total_steps"],
                            "accuracy": record["val_accuracy"], "bytes": exchange.bytes_moved,
                            "wall_s": time.perf_counter() - t0})
            if weight_ema is not None:
                history[-1].update(accuracy=record["val_ema_accuracy"], global_accuracy=record["val_accuracy"])
            log.debug("%s K=%d tau=%d round %d: accuracy %.4f", name.value, workers, tau, record["round"],
                      record["val_accuracy"])

    eval_rounds = max(1, math.ceil((eval_every_steps or tau) / tau))
    plan = FitPlan(strategy=strat, stop=StopRule(steps=steps, target_accuracy=target_accuracy, tau=tau),
                   evaluation=EvalPlan(every=eval_rounds), weight_ema=weight_ema)
    run_rounds(exchange, plan, strat.init_global(evaluator.get_flat()), on_record=on_record)
    acc = history[-1]["accuracy"]
    reached = target_accuracy is not None and acc >= target_accuracy
    steps = plan.progress.steps_done
    # sync sends every step's gradient, up and down
    sent = 2 * workers * evaluator.get_flat().numel() * 4 * steps if name is Strategy.SYNC else exchange.bytes_moved
    return SimulationResult(name.value, workers, tau, reached, plan.progress.round, steps, steps * workers,
                            sent if workers > 1 else 0, acc, time.perf_counter() - t0, history)
