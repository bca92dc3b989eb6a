"""What a run costs, on paper: a model of time to target for K workers, tau, model size and link speed.

A round of K workers costs its local steps, its synchronisation and its evaluation::

    round = tau * step_s * max(1, K / cores)            # compute; workers beyond the cores share them
          + sync(engine, strategy, K, model bytes, link)  # the engine's own cost and the link's
          + evaluation (validation rows, split over the ranks in the barrier engine)

- the rounds engine pays one Spark job per round (``job_s``: Spark's own latency plus sparknet's
  driver work, growing by ``job_s_per_worker`` with each task) and moves the weights down and the
  update up through the driver, whose link carries all K of each
  (:meth:`~sparknet.link.LinkModel.delay`);
- the barrier engine pays one gloo ring allreduce of the flat buffer per round (``allreduce_s``
  on this machine's loopback plus :meth:`~sparknet.link.LinkModel.allreduce_delay` on the
  link); the naive scheme (``sync``) pays it every step instead.

The link costs are the very functions the engines' simulated links wait for, so a prediction and
a run over ``--link-latency/--link-bandwidth`` charge the same seconds. Time to target is
``setup_s + rounds * round``, the rounds being ``steps_to_target / tau``. Steps to a target come
from measurement (the simulator's grid) where there is one, and beyond the measured K from the
power law fitted to it (:class:`StepsToTarget`): an extrapolation, and said to be one.

:class:`Calibration` holds the machine's constants; ``sparknet experiment scaling``
(:func:`sparknet.experiments.scaling.calibrate`) measures them on this machine, checks the model
against measured runs and plots its predictions.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace

from sparknet.link import LinkModel

__all__ = ["Calibration", "RunShape", "StepsToTarget", "predict_round", "predict_run"]


@dataclass(frozen=True)
class Calibration:
    """The machine's constants (seconds). Defaults: this project's development machine (2 cores, LeNet,
    batch 64, one thread per worker, Spark local[2], Unix-socket Python workers)."""

    step_s: float = 0.0237
    """One local step of one worker with a core to itself (SGD with momentum)."""
    solver_step: dict = field(default_factory=lambda: {"sgd": 1.0, "adamw": 1.15})
    """A step of each local solver, relative to :attr:`step_s` (AdamW updates two moments a weight)."""
    cores: int = 2
    """Cores the workers share: K workers on fewer cores each run K / cores times slower."""
    threads_speedup: float = 1.67
    """One process with a thread per core against one thread (a step's speed-up)."""
    eval_s_per_row: float = 1.7e-4
    """Scoring one validation row with one thread."""
    job_s: float = 0.076
    """The rounds engine's cost per round beyond compute: a Spark job, the broadcast, the driver's sum."""
    job_s_per_worker: float = 0.005
    """What each further task adds to a round of the rounds engine (scheduling, one result to fetch)."""
    allreduce_s: float = 0.0025
    """One gloo allreduce of the model's buffer between two ranks on a free link: what it adds to a step of two
    one-thread ranks running side by side (its own time and the wait for the slower rank; measured by
    :func:`sparknet.experiments.scaling.allreduce_step_cost`)."""
    barrier_round_s: float = 0.003
    """The barrier engine's cost per round beyond its allreduce (the counts, the records, the channel)."""
    setup_s: float = 15.0
    """From the command's start to the first round (interpreter, Spark session, data, staging)."""
    model_bytes: int = 1_724_320
    """float32 bytes of the model the constants were measured with (LeNet); compute and allreduce
    scale with the model's size."""

    def to_dict(self) -> dict:
        return asdict(self)


JOB_OVER_EMPTY = 1.2
"""The rounds engine's round beyond compute (``Calibration.job_s``), as a multiple of an empty Spark job timed
in a fresh session as :func:`~sparknet.spark.backend.empty_job_s` does (measured on local[2]: 76 ms against 64 ms;
the same empty job run between two rounds takes 32 ms)."""


@dataclass(frozen=True)
class RunShape:
    """One run, as the model sees it."""

    engine: str
    """``"rounds"``, ``"barrier"`` or ``"local"`` (one process, no synchronisation)."""
    workers: int
    tau: int
    steps: int
    """Local steps per worker."""
    strategy: str = "average"
    """``"sync"`` allreduces gradients every step (barrier engine); every other strategy once a round."""
    model_bytes: int | None = None
    """float32 bytes of the model (default: the calibration's)."""
    eval_rows: float = 0.0
    """Validation rows scored per round on average (a full pass of 10,000 every round: 10,000)."""
    threads: int = 1
    """Torch threads of a one-process run (``engine="local"``)."""
    solver: str = "sgd"
    """The workers' local solver (its step time is :attr:`Calibration.solver_step` of it)."""


def predict_round(shape: RunShape, cal: Calibration, link: LinkModel | None = None) -> dict:
    """Seconds of one round of ``shape``, by part: ``compute``, ``sync``, ``link``, ``eval``, ``total``."""
    link = link or LinkModel()
    k, nbytes = shape.workers, int(shape.model_bytes or cal.model_bytes)
    scale = nbytes / cal.model_bytes  # compute and allreduce grow with the model
    step_s = cal.step_s * cal.solver_step.get(shape.solver, 1.0)
    if shape.engine == "local":
        speedup = cal.threads_speedup if shape.threads >= cal.cores else 1.0
        compute = shape.tau * step_s * scale / speedup
        ev = shape.eval_rows * cal.eval_s_per_row / speedup
        return {"compute": compute, "sync": 0.0, "link": 0.0, "eval": ev, "total": compute + ev}
    share = max(1.0, k / cal.cores)
    compute = shape.tau * step_s * scale * share
    if shape.engine == "rounds":
        sync = cal.job_s + cal.job_s_per_worker * max(k - 2, 0)
        on_link = 2 * link.delay(nbytes * k)  # K weights down and K updates up cross the driver's link
        ev = shape.eval_rows * cal.eval_s_per_row / cal.threads_speedup  # the driver scores with its threads
    elif shape.engine == "barrier":
        syncs = shape.tau if shape.strategy == "sync" else 1
        sync = cal.barrier_round_s + syncs * cal.allreduce_s * scale * (2 * (k - 1) / k) if k > 1 else 0.0
        on_link = syncs * link.allreduce_delay(nbytes, k)
        ev = shape.eval_rows / k * cal.eval_s_per_row * share  # each rank scores its share
        on_link += link.allreduce_delay(24, k) if shape.eval_rows else 0.0
    else:
        raise ValueError(f"unknown engine {shape.engine!r}; the model knows rounds, barrier and local")
    return {"compute": compute, "sync": sync, "link": on_link, "eval": ev, "total": compute + sync + on_link + ev}


def predict_run(shape: RunShape, cal: Calibration, link: LinkModel | None = None) -> dict:
    """Seconds of a whole run of ``shape``: ``in_rounds`` (every round), ``command`` (setup included)."""
    rounds = math.ceil(shape.steps / shape.tau)
    per = predict_round(shape, cal, link)
    last = predict_round(replace(shape, tau=shape.steps - (rounds - 1) * shape.tau), cal, link)
    in_rounds = (rounds - 1) * per["total"] + last["total"]
    return {"rounds": rounds, "round": per, "in_rounds": in_rounds, "command": cal.setup_s + in_rounds}


@dataclass(frozen=True)
class StepsToTarget:
    """Local steps per worker to a target accuracy: measured points ``{(K, tau): steps}`` and a power law
    ``steps = a * K ** -b`` fitted to them (at the smallest tau measured for each K) for the K beyond."""

    measured: dict = field(default_factory=dict)

    def fit(self) -> tuple[float, float]:
        """``(a, b)`` of the power law, least squares on log-log over the measured K."""
        best: dict[int, int] = {}
        for (k, _tau), steps in self.measured.items():
            best[k] = min(best.get(k, steps), steps)
        if len(best) < 2:
            raise ValueError("a power law needs steps measured at two worker counts at least")
        slope, intercept = statistics.linear_regression([math.log(k) for k in best], [math.log(best[k]) for k in best])
        return math.exp(intercept), -slope

    def steps(self, workers: int, tau: int) -> tuple[int, bool]:
        """(steps per worker, whether measured); an extrapolation rounds up to whole rounds of ``tau``."""
        if (workers, tau) in self.measured:
            return int(self.measured[(workers, tau)]), True
        a, b = self.fit()
        steps = a * workers ** -b
        return int(math.ceil(steps / tau) * tau), False
