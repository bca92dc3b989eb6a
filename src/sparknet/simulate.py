"""K logical workers in one process, running the very strategy code the Spark engines run.

Iterations, not seconds, are what this counts: how many rounds and local steps a strategy
needs to reach a target accuracy for a given K and tau (the SparkNet paper's Figure 3 is
built this way, with S = 0). Workers train one after another on their own shards, from
the same global weights, and their deltas are combined exactly as on Spark.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from sparknet.config import Strategy, parse_enum
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.strategies import Downlink, WorkerState, make_compressor, make_strategy

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
             max_steps: int = 10000, eval_every_steps: int | None = None, eval_samples: int | None = None,
             compression: str = "none", seed: int = 0, strategy_options: dict | None = None) -> SimulationResult:
    """Train ``workers`` logical workers with ``strategy`` until the target or ``max_steps``.

    Parameters
    ----------
    net_params : NetParams (or a module factory)
        The network; each worker builds its own copy.
    train, test : ArrayDataset
        Training data (sharded evenly across workers) and the evaluation set.
    tau : int
        Local steps per round (for ``sync``: steps between evaluations).
    max_steps : int
        Local steps per worker at most.
    eval_every_steps : int, optional
        Evaluate the global weights every this many local steps (rounded up to whole
        rounds); default every round.
    compression : str
        none, fp16, bf16 or int8 (with error feedback) for the workers' deltas.
    """
    if workers < 1 or tau < 1:
        raise ValueError(f"workers and tau must be at least 1, got {workers}, {tau}")
    name = parse_enum(Strategy, strategy, "strategy")
    solver = solver or SolverConfig()
    t0 = time.perf_counter()
    test_x, test_y = (test.x, test.y) if eval_samples is None else (test.x[:eval_samples], test.y[:eval_samples])
    evaluator = Net(net_params, solver, batch_size=batch_size, seed=seed)
    evaluator.set_validation_data((test_x, test_y))
    eval_rounds = max(1, math.ceil((eval_every_steps or tau) / tau))
    nbytes = evaluator.get_flat().numel() * 4
    history: list[dict] = []

    if name is Strategy.SYNC:
        # Gradients averaged every step over K equal batches = one step on a K-times larger batch.
        net = Net(net_params, solver, batch_size=batch_size * workers, seed=seed)
        net.set_training_data(train)
        steps = rounds = 0
        acc = float("nan")
        reached = False
        while steps < max_steps:
            n = min(tau, max_steps - steps)
            net.train(n)
            steps += n
            rounds += 1
            if rounds % eval_rounds == 0 or steps >= max_steps:
                evaluator.set_flat(net.get_flat())
                acc = evaluator.test()
                history.append({"round": rounds, "steps": steps, "accuracy": acc})
                if target_accuracy is not None and acc >= target_accuracy:
                    reached = True
                    break
        return SimulationResult(name.value, workers, tau, reached, rounds, steps, steps * workers,
                                2 * workers * nbytes * steps if workers > 1 else 0, acc, time.perf_counter() - t0, history)

    options = dict(strategy_options or {})
    options.setdefault("num_workers", workers)
    strat = make_strategy(name, **options)
    compressor = make_compressor(compression)
    nets, states = [], []
    for i in range(workers):
        net = Net(net_params, solver, batch_size=batch_size, seed=seed + 1000 * i)
        net.set_training_data(train.shard(i, workers))
        nets.append(net)
        states.append(WorkerState())
    global_flat = strat.init_global(evaluator.get_flat())
    # The workers hold ``seen``, the global weights as the downlink delivered them (exact without
    # compression; with it, each round's message is the compressed gap to the driver's exact
    # weights, so what one message loses the next carries): the Spark engines' own Downlink.
    down = Downlink(compressor, global_flat.numel())
    sent = workers * down.message(global_flat).numel()  # the initial weights, down
    seen = down.seen
    steps = rounds = 0
    acc = float("nan")
    reached = False
    while steps < max_steps:
        n = min(tau, max_steps - steps)
        acc_delta = torch.zeros_like(global_flat)
        total = 0
        for net, state in zip(nets, states):
            strat.worker_begin(state, net, seen)
            stats = net.train(n)
            delta = strat.worker_delta(state, net, seen)
            c = compressor.compress(delta, state)
            sent += c.nbytes  # the delta up
            acc_delta.add_(compressor.decompress(c), alpha=stats.samples)
            total += stats.samples
        global_flat = strat.apply(global_flat, acc_delta / max(total, 1), workers)
        sent += workers * down.message(global_flat).numel()  # the new global weights down
        seen = down.seen
        steps += n
        rounds += 1
        if rounds % eval_rounds == 0 or steps >= max_steps:
            evaluator.set_flat(seen)
            acc = evaluator.test()
            history.append({"round": rounds, "steps": steps, "accuracy": acc, "bytes": sent})
            log.debug("%s K=%d tau=%d round %d: accuracy %.4f", name.value, workers, tau, rounds, acc)
            if target_accuracy is not None and acc >= target_accuracy:
                reached = True
                break
    return SimulationResult(name.value, workers, tau, reached, rounds, steps, steps * workers,
                            sent if workers > 1 else 0, acc, time.perf_counter() - t0, history)
