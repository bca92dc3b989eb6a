"""``sparknet train --model-parallel M``: layers split across workers, on Spark, from the command line.

The ``train`` command turns the fields of :class:`ModelParallelFlags` into
``--model-parallel``, ``--parallel-plan`` and ``--max-weight-bytes``; with M > 1 it calls
:func:`train_model_parallel`, otherwise :func:`check_unsplit` before the usual engines::

    sparknet train --model mlp --dataset mnist --workers 4 --engine barrier --model-parallel 2 \\
        --tau 20 --rounds 5 --solver-type rmsprop --lr 1e-3 --save-model runs/mlp-mp
    sparknet train --model mlp --dataset mnist --workers 2 --max-weight-bytes 1e6   # refused: over budget

W = ``--workers`` tasks form D = W / M replicas of the net, each split across M tasks; the
replicas combine every ``--tau`` steps with the chosen ``--strategy`` (average, diloco,
easgd). Which layers split: ``--parallel-plan ip1=column,ip2=row``, else the net's own
``parallel=`` fields, else consecutive Linear layers in column/row pairs. With
``--max-weight-bytes`` and no ``--model-parallel``, an unsplit run whose weights exceed the
budget is refused (with the M that would fit) and a run within it goes on as usual.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from sparknet._app import build_model, load_training_data
from sparknet._enums import CompressionKind
from sparknet.config import DistributedConfig, Engine, RunConfig, Strategy
from sparknet.parallel.runner import ModelParallelJob, default_plan
from sparknet.parallel.spark import fit_model_parallel
from sparknet.parallel.tensor import check_weight_budget
from sparknet.spark.run import train_distributed

__all__ = ["ModelParallelFlags", "train_model_parallel", "check_unsplit", "parse_plan"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ModelParallelFlags:
    """Model parallelism (layers split across --model-parallel M workers; barrier engine)"""

    model_parallel: int = 1
    """M: workers each copy of the net is split across (workers must be a multiple of M; needs --engine barrier)."""
    parallel_plan: str | None = None
    """Which layers split, LAYER=column|row|none,... (default: the net's parallel= fields, else Linear pairs)."""
    max_weight_bytes: float | None = None
    """Bytes of weights one worker may hold (e.g. 16e6); a run over it is refused before training."""

    def __post_init__(self):
        if self.model_parallel < 1:
            raise ValueError(f"--model-parallel must be at least 1, got {self.model_parallel}")
        if self.max_weight_bytes is not None and not self.max_weight_bytes > 0:
            raise ValueError(f"--max-weight-bytes must be positive, got {self.max_weight_bytes}")
        if self.parallel_plan is not None:
            parse_plan(self.parallel_plan)

    @property
    def budget(self) -> int | None:
        """``max_weight_bytes`` as a whole number of bytes."""
        return None if self.max_weight_bytes is None else int(self.max_weight_bytes)


def parse_plan(text: str) -> dict[str, str | None]:
    """``"ip1=column,ip2=row,ip3=none"`` -> ``{"ip1": "column", "ip2": "row", "ip3": None}``."""
    plan: dict[str, str | None] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, mode = item.partition("=")
        mode = mode.strip().lower()
        if not sep or not name.strip() or mode not in ("column", "row", "none"):
            raise ValueError(f"--parallel-plan: {item!r} is not LAYER=column, LAYER=row or LAYER=none "
                             "(e.g. --parallel-plan ip1=column,ip2=row)")
        plan[name.strip()] = None if mode == "none" else mode
    if not plan:
        raise ValueError("--parallel-plan is empty; give LAYER=column|row|none pairs separated by commas")
    return plan


def _refusals(run: RunConfig, dist: DistributedConfig, flags: ModelParallelFlags) -> str | None:
    """What this run asks for that model-parallel training cannot do (the first thing), or ``None``."""
    m = flags.model_parallel
    if dist.engine is not Engine.BARRIER:
        return (f"--model-parallel runs its workers together in one barrier stage; add --engine barrier "
                f"(the {dist.engine.value} engine does not split layers)")
    if dist.workers % m:
        return (f"{dist.workers} workers do not divide into model-parallel groups of {m}; use --workers "
                f"{max(m, dist.workers - dist.workers % m)} or another multiple of {m}")
    if dist.strategy in (Strategy.SYNC, Strategy.ASYNC):
        return (f"the {dist.strategy.value} strategy does not know about split layers; use --strategy average, "
                "diloco or easgd with --model-parallel")
    if dist.tau is None or dist.round_seconds is not None:
        return ("--model-parallel needs a fixed --tau and no --round-seconds: the workers of one model copy "
                "must make the same steps")
    if dist.compression is not CompressionKind.NONE or dist.auto_tau or dist.link() is not None:
        return ("--model-parallel does not support --compression, --auto-tau or a simulated link; drop "
                "--compression, --auto-tau, --link-latency and --link-bandwidth")
    if dist.warmup_steps:
        return "--model-parallel does not run a warm-up on the driver; drop --warmup-steps"
    if dist.weight_ema is not None:
        return "--model-parallel returns the global weights, not a moving average of them; drop --weight-ema"
    if dist.epochs is not None:
        return "--model-parallel stops on --steps, --rounds or --target-accuracy; use those instead of --epochs"
    if run.device != "cpu":
        return "--model-parallel splits layers over CPU gloo groups; use --device cpu"
    if run.model.lower() == "char_lstm" or run.dataset.lower() == "shakespeare":
        return ("--model-parallel on Spark takes one class label per row; train char_lstm with "
                "examples/char_lstm.py (see docs/MODEL_PARALLEL.md)")
    return None


def check_unsplit(run: RunConfig, flags: ModelParallelFlags) -> None:
    """Before an unsplit run (M = 1): refuse ``--parallel-plan``, and a net over ``--max-weight-bytes``.

    Over the budget, :class:`~sparknet.parallel.WeightBudgetError` (a ``ValueError`` naming the
    M that fits); within it, the usual engines train.
    """
    if flags.parallel_plan is not None:
        raise ValueError("--parallel-plan needs --model-parallel M with M > 1")
    if flags.budget is None:
        return
    _, _, info = load_training_data(run)
    net_params = build_model(run, info)
    # the plan --model-parallel 2 would use, so the refusal can name the M that fits
    need = check_weight_budget(net_params, flags.budget, 1, default_plan(net_params, 2))
    log.info("%s bytes of weights per worker, within --max-weight-bytes %s", f"{need:,}", f"{flags.budget:,}")


def train_model_parallel(run: RunConfig, dist: DistributedConfig, flags: ModelParallelFlags) -> dict:
    """Train split across ``flags.model_parallel`` workers per copy of the net; returns the summary record.

    A run that model parallelism cannot do (see the module docstring) is refused with a
    ``ValueError`` that says what to change, before anything starts.
    """
    if flags.model_parallel < 2:
        raise ValueError("model-parallel training needs --model-parallel M with M > 1")
    reason = _refusals(run, dist, flags)
    if reason is not None:
        raise ValueError(reason)
    return _train(run, dist, flags)


def _train(run: RunConfig, dist: DistributedConfig, flags: ModelParallelFlags) -> dict:
    options = {k: v for k, v in dist.strategy_options().items() if k != "num_workers"}

    def fit(spark, df, test, net_params, on_round):
        job = ModelParallelJob(net=net_params, worker=run.worker(), model_parallel=flags.model_parallel,
                               strategy=dist.strategy.value, strategy_options=options, tau=dist.tau,
                               rounds=dist.rounds, target_accuracy=dist.target_accuracy,
                               eval_every_rounds=dist.eval_every_rounds,
                               plan=parse_plan(flags.parallel_plan) if flags.parallel_plan else None,
                               max_weight_bytes=flags.budget)
        log.info("training %s on %s: %d workers = %d copies x %d shards (barrier engine, %s, tau=%d) on %s",
                 run.model, run.dataset if run.data is None else run.data, dist.workers,
                 dist.workers // flags.model_parallel, flags.model_parallel, dist.strategy.value, dist.tau,
                 spark.sparkContext.master)
        result = fit_model_parallel(net_params, df, job=job, workers=dist.workers, validation=test, spark=spark)
        for record in result.history:
            on_round(record)
        log.info("weight bytes per worker: %s (whole model: %s)",
                 ", ".join(f"{b:,}" for b in result.summary["weight_bytes_per_worker"]),
                 f"{result.summary['whole_weight_bytes']:,}")
        return result

    return train_distributed(run, dist, fit=fit, config={"model_parallel": dataclasses.asdict(flags)})
