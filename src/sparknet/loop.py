"""The plan and the round loop: every worker runs tau local steps, then their updates become new global weights.

A fit is one :class:`FitPlan` (strategy, :class:`StopRule`, :class:`EvalPlan`, automatic tau, moving average,
counters), and :func:`run_rounds` is SparkNet's Listing 3, the only place sparknet runs it::

    every round:
        plan   = RoundPlan(steps=tau or what the steps rule leaves, seconds=the time budget)
        update = exchange.run_round(plan, global_flat)        # local steps; sum of samples * delta
        mean   = weighted_mean(update.total, update.samples)  # the sample-weighted mean delta
        global_flat = strategy.apply(global_flat, mean, K)    # average, DiLoCo, EASGD, sync
        evaluate when due, record the round, checkpoint, stop when the StopRule says so

Engines differ only in their :class:`Exchange`: :class:`InProcessExchange` here (K nets in this process),
the rounds engine's (:mod:`sparknet.spark.rounds.driver`) and the collective one (:mod:`sparknet.collective`).
Each calls :class:`sparknet.step.WorkerStep` for a worker's local work. docs/DESIGN.md draws the whole.

No pyspark import.
"""

from __future__ import annotations

import abc
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import torch

from sparknet._enums import CompressionKind
from sparknet.config import Profile, Streaming
from sparknet.errors import EngineError, NonFiniteUpdate
from sparknet.net import EvalResult
from sparknet.step import WorkerStep, sum_stats
from sparknet.strategies import AutoTau, Downlink, TrainingStrategy, make_compressor

__all__ = ["FitPlan", "StopRule", "EarlyStop", "EvalPlan", "screen_margin", "Progress", "ResumeState", "RoundPlan",
           "RoundUpdate", "Exchange", "InProcessExchange", "NetScorer", "check_streaming", "WeightAverage",
           "returned_summary", "weighted_mean", "run_rounds"]

log = logging.getLogger(__name__)


@dataclass
class StopRule:
    """The stopping rules of a fit, evaluated identically wherever the round loop runs."""

    rounds: int | None = None
    steps: int | None = None
    """Local steps per worker, in all rounds."""
    epochs: float | None = None
    target_accuracy: float | None = None
    target_loss: float | None = None
    """Stop once the whole validation set's loss is at most this."""
    dataset_rows: int = 0
    tau: int | None = None
    round_seconds: float | None = None

    UNBOUNDED_STEPS = 1 << 40

    def steps_for_round(self, steps_done: int) -> int:
        """Local steps to ask of each worker this round (tau, capped by what ``steps`` leaves)."""
        ask = self.tau if self.tau is not None else self.UNBOUNDED_STEPS
        if self.steps is not None:
            ask = min(ask, max(self.steps - steps_done, 0))
        return ask

    def reason(self, rounds_done: int, steps_done: int, samples_done: int, scored: EvalResult | None) -> str | None:
        """Why to stop now (``None``: go on); ``scored``: this round's evaluation on the whole validation set."""
        if scored is not None and self.target_accuracy is not None and scored.score >= self.target_accuracy:
            return "target_accuracy"
        if scored is not None and self.target_loss is not None and scored.loss <= self.target_loss:
            return "target_loss"
        if self.rounds is not None and rounds_done >= self.rounds:
            return "rounds"
        if self.steps is not None and steps_done >= self.steps:
            return "steps"
        if self.epochs is not None and self.dataset_rows and samples_done >= self.epochs * self.dataset_rows:
            return "epochs"
        return None


@dataclass
class EarlyStop:
    """Early stopping (``--patience``): the best whole-set evaluation so far, its round and its weights, and how many
    evaluations since have not bettered it by more than ``min_delta``. The fit stops once they are ``patience`` and
    returns the best weights (judged, and kept, as the target is: the moving average's where there is one)."""

    patience: int
    min_delta: float = 0.0
    on_score: bool = False
    """Watch the task's score (higher is better) rather than the loss (lower is better)."""
    best: float | None = None
    best_round: int | None = None
    since: int = 0
    """Evaluations since the best."""
    scores: dict | None = None
    """The best evaluation's metrics and ``loss`` (what the fit's summary reports of the weights it returns)."""
    weights: torch.Tensor | None = field(default=None, repr=False)
    """A copy of the best weights."""
    judged: int = 0
    """The last round observed (a checkpoint written before its round was scored, behind the next one, is of a later
    round: a fit resumed from it scores that round first)."""

    def observe(self, r: int, scored: EvalResult, weights: torch.Tensor) -> None:
        """Round ``r``'s whole-set result ``scored`` of ``weights`` (copied where they are the best so far)."""
        self.judged = r
        value = scored.score if self.on_score else scored.loss
        if self.best is None:
            better = math.isfinite(value)
        else:
            better = value > self.best + self.min_delta if self.on_score else value < self.best - self.min_delta
        if better:
            self.best, self.best_round, self.since, self.weights = value, r, 0, weights.clone()
            self.scores = {**scored.metrics, "loss": scored.loss}
        else:
            self.since += 1

    @property
    def exhausted(self) -> bool:
        """Whether ``patience`` evaluations in a row have not bettered the best."""
        return self.since >= self.patience

    def counters(self) -> dict:
        """What a restart needs beside the best weights (:meth:`restore`)."""
        return {"best": self.best, "best_round": self.best_round, "since": self.since, "scores": self.scores,
                "judged": self.judged}

    def restore(self, counters: dict | None, weights: torch.Tensor | None) -> None:
        """Continue from :meth:`counters` and the best weights (a restarted stage, a resumed fit); afresh where either
        is missing."""
        if counters and counters.get("best_round") is not None and weights is not None:
            self.best, self.best_round, self.since = counters["best"], counters["best_round"], counters["since"]
            self.scores, self.weights, self.judged = counters.get("scores"), weights, counters.get("judged", 0)


@dataclass(frozen=True)
class EvalPlan:
    """When the loop evaluates the global weights, and on how many validation rows.

    Between full evaluations a round may get a *screen*: the same fixed random sample of
    ``screen_rows`` validation rows each time, a few times cheaper than the whole set. A screen is
    followed by a full evaluation in the same round when it comes within its own sampling error of
    the target accuracy (so the stopping rule acts on the whole set's accuracy), and every
    ``full_every``-th evaluation is full anyway. The round that ends the run is always evaluated
    in full.
    """

    every: int = 1
    """Rounds between evaluations."""
    screen_rows: int | None = None
    """Rows of a screen (``None`` or 0: every evaluation is full). No screen when the validation set has
    fewer than twice as many rows."""
    full_every: int = 10
    """Evaluations between full ones at the most."""
    budget: float | None = None
    """Largest share of the loop's wall time its evaluations may take (``None``: no limit). A due
    evaluation is put off to a later round while those so far have taken more; the first and the
    last are never put off."""
    overlap: bool = False
    """Evaluate a round's weights in a thread of their own while the next round trains (an engine whose loop
    runs on the driver, with a second copy of its evaluating net): the record comes out, and the target is
    judged, a round late; the last round is evaluated at once, as ever."""

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"evaluations must be at least 1 round apart, got every={self.every}")
        if self.screen_rows is not None and self.screen_rows < 0:
            raise ValueError(f"screen_rows must be 0 (no screens) or more, got {self.screen_rows}")
        if self.full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {self.full_every}")
        if self.budget is not None and not 0.0 < self.budget <= 1.0:
            raise ValueError(f"the evaluation budget is a share of the wall time in (0, 1], got {self.budget}")

    def screens(self, validation_rows: int | None) -> bool:
        """Whether a screen is worth it on a validation set of that many rows (``None``: not known, yes)."""
        return bool(self.screen_rows) and (validation_rows is None or validation_rows >= 2 * self.screen_rows)


def screen_margin(target: float, rows: int) -> float:
    """How far below ``target`` a screen of ``rows`` rows may read for the whole set to be scored: one standard
    error of a proportion near the target, and one row. A screen that reads lower by chance costs the round it
    was taken in, not the run: the next one screens again."""
    p = min(max(target, 0.0), 1.0)
    return math.sqrt(max(p * (1.0 - p), 1e-4) / rows) + 1.0 / rows


@dataclass(frozen=True)
class RoundPlan:
    """What the loop asks of every worker in one round."""

    round: int
    """Rounds done before this one (the first round is 0)."""
    steps: int
    """Local steps (tau, or what :attr:`StopRule.steps` leaves; :attr:`StopRule.UNBOUNDED_STEPS` when only seconds
    bound it)."""
    seconds: float | None = None
    """The round's time budget: a worker stops after ``steps`` or this, whichever comes first."""
    last: bool = False
    """The stop rule will end the run after this round whatever the accuracy (workers send their state back)."""


def check_streaming(strategy: TrainingStrategy, streaming: Streaming | None) -> None:
    """Refuse an overlapped or streamed exchange for a strategy whose outer step cannot take one."""
    if streaming is not None and not strategy.streams:
        raise ValueError(f"overlapped or streamed exchanges (--overlap, --fragments) need a strategy that takes a "
                         f"part of the weights a round late, average or diloco; {strategy!r} cannot")


@dataclass(frozen=True)
class RoundUpdate:
    """What an exchange hands back for one round: the workers' deltas summed by samples, and counts."""

    total: torch.Tensor | None
    """``sum_i n_i * delta_i`` over the workers whose update counts (finite, with samples); ``None``: no
    exchange finished this round (the first round of an overlapped exchange)."""
    samples: float
    """``sum_i n_i`` over those workers: what :func:`weighted_mean` divides by."""
    loss_sum: float
    """``sum_i n_i * loss_i`` over the same workers."""
    steps: int
    """Local steps of the worker that made the most."""
    processed: int
    """Samples every worker processed this round (non-finite ones too)."""
    compute_s: float
    """Seconds of local steps of the slowest worker."""
    slowest_steps: int
    """Local steps of the slowest worker (what automatic tau divides its time by)."""
    nbytes: int = 0
    """Bytes that crossed the network for this round."""
    nonfinite: tuple[int, ...] = ()
    """Workers whose loss or weights became NaN/Inf: left out of the mean."""
    sync_s: float | None = None
    """The synchronization time automatic tau observes (``None``: the round's time beyond computing)."""
    observe: bool = True
    """Whether automatic tau observes this round at all."""
    workers: int | None = None
    """Workers that ran this round, when fewer than the exchange's K (an elastic round on a cluster short of
    task slots): what the strategy's outer step counts and the record names."""
    fields: dict = field(default_factory=dict)
    """Engine-specific fields of the round record (per-worker views, retries, link waits...)."""
    part: slice | None = None
    """The weights ``total`` covers (a streamed exchange's fragment); ``None``: all of them."""


@dataclass
class Progress:
    """Counters of a fit, carried from round to round (and through checkpoints)."""

    round: int = 0
    steps_done: int = 0
    """Local steps per worker (the most of any worker, summed over rounds)."""
    samples_done: int = 0
    total_bytes: int = 0


@dataclass(kw_only=True)
class ResumeState(Progress):
    """What a checkpoint saves and a restart reads: the loop's counters and every state beside the weights."""

    global_flat: torch.Tensor | None = None
    """The global weights after round :attr:`round` (``None``: the checkpoint's weight file holds them)."""
    strategy: dict | None = None
    """The strategy's driver state (``TrainingStrategy.state_dict``)."""
    workers: dict = field(default_factory=dict)
    """Each worker's state by index (its solver, data position and strategy state): a resume is exact with them."""
    iteration: int | None = None
    """The workers' solver iteration (a restart without their states keeps the learning-rate schedule's place)."""
    downlink: dict | None = None
    """The compressed downlink's state (the rounds engine's)."""
    auto_tau: dict | None = None
    """The tau chooser's state."""
    average: torch.Tensor | None = None
    """The moving average of the global weights."""
    early_stop: dict | None = None
    """Early stopping's counters (:meth:`EarlyStop.counters`)."""
    best: torch.Tensor | None = None
    """The best weights early stopping has scored (those of ``early_stop["best_round"]``)."""

    def returned(self, plan: FitPlan) -> torch.Tensor:
        """The weights a fit of ``plan`` that ended in this state returns: the best scored where it stops early, else
        the moving average where it keeps one, else the global weights."""
        if plan.early_stop is not None and self.best is not None:
            return self.best
        return self.average if plan.weight_ema is not None else self.global_flat

    def progress(self) -> Progress:
        """The loop's counters, to continue from."""
        return Progress(**{f.name: getattr(self, f.name) for f in fields(Progress)})

    _KEPT: ClassVar[tuple[str, ...]] = ("iteration", "downlink", "auto_tau", "average", "early_stop", "best")
    """What a checkpoint keeps of the state beside the loop's counters, the strategy's and the workers' states (the
    moving average and early stopping's best weights ``None`` where the fit has none)."""

    def counters(self) -> dict:
        """The fields a checkpoint's state holds beside the weights, the strategy's and the workers' states."""
        return {**vars(self.progress()), **{key: getattr(self, key) for key in self._KEPT}}

    @classmethod
    def from_checkpoint(cls, rounds_done: int, state: dict) -> ResumeState:
        """The state a checkpoint of round ``rounds_done`` holds (``state``: what :meth:`counters` wrote, the
        strategy's and the workers')."""
        return cls(round=rounds_done, **{key: state[key] for key in ("steps_done", "samples_done", "total_bytes")},
                   **{key: state.get(key) for key in ("strategy", *cls._KEPT)}, workers=state.get("workers") or {})


@dataclass(kw_only=True)
class FitPlan:
    """A fit's rules, built once (:meth:`from_config`, or by hand) and followed by :func:`run_rounds` wherever it
    runs: on the driver, on every rank of a stage, in one process."""

    strategy: TrainingStrategy
    """The outer update (and the workers' hooks)."""
    stop: StopRule
    """Steps per round (``tau``, which :attr:`auto` overwrites) and when to stop."""
    evaluation: EvalPlan = field(default_factory=EvalPlan)
    """When to evaluate, and on how many rows."""
    auto: AutoTau | None = None
    """Chooses tau from the rounds' compute and synchronization times."""
    weight_ema: float | None = None
    """The decay of a moving average of the global weights (:class:`WeightAverage`): every evaluation scores it
    too (``val_ema_<metric>``), the target is judged on it, and it is what the fit returns."""
    average: WeightAverage | None = None
    """The moving average itself: made by :func:`run_rounds` from the starting weights unless set (a restart's)."""
    progress: Progress = field(default_factory=Progress)
    """The counters to continue from (a resumed fit's, a restarted stage's); updated in place."""
    early_stop: EarlyStop | None = None
    """Early stopping (``--patience``): every evaluation scores the whole validation set, and the fit returns the
    best weights it scored."""

    @classmethod
    def from_config(cls, dist, strategy: TrainingStrategy, *, steps: int | None = None, dataset_rows: int = 0,
                    resume: ResumeState | None = None) -> FitPlan:
        """The plan of a :class:`~sparknet.config.DistributedConfig`: its stopping rules (with ``steps``, the local
        steps per worker at most), its evaluation, automatic tau and moving average, from ``resume`` on."""
        auto = None
        if dist.auto_tau:
            auto = AutoTau(target_fraction=dist.auto_tau_target, min_tau=dist.auto_tau_min,
                           max_tau=dist.auto_tau_max, every=dist.auto_tau_every, initial=dist.tau or dist.auto_tau_min)
            if resume is not None and resume.auto_tau:
                auto.load_state_dict(resume.auto_tau)
        stop = StopRule(rounds=dist.rounds, steps=steps, epochs=dist.epochs, target_accuracy=dist.target_accuracy,
                        target_loss=dist.target_loss, dataset_rows=dataset_rows, tau=dist.tau,
                        round_seconds=dist.round_seconds)
        budget = dist.eval_budget
        if budget is None:  # toward a target the evaluations end the run, and a larger share gets there sooner
            budget = 0.25 if dist.toward_target else 0.05
        evaluation = EvalPlan(every=dist.eval_every_rounds, screen_rows=dist.eval_screen_rows or None,
                              budget=None if budget >= 1.0 else budget, overlap=dist.eval_overlap)
        early = None if dist.patience is None else EarlyStop(dist.patience, dist.min_delta,
                                                             on_score=dist.monitor == "score")
        average = None
        if resume is not None and resume.round:  # the moving average and early stopping go on as the resumed fit
            if dist.weight_ema is not None:  # left them
                if resume.average is None:
                    log.warning("the checkpoint of round %d holds no moving average: it starts from its weights",
                                resume.round)
                else:
                    average = WeightAverage(dist.weight_ema, torch.as_tensor(resume.average, dtype=torch.float32))
            if early is not None:
                if resume.best is None:
                    log.warning("the checkpoint of round %d holds no best weights of early stopping: it counts "
                                "afresh from there", resume.round)
                else:
                    early.restore(resume.early_stop, torch.as_tensor(resume.best, dtype=torch.float32))
        return cls(strategy=strategy, stop=stop, evaluation=evaluation, auto=auto, weight_ema=dist.weight_ema,
                   average=average, progress=Progress() if resume is None else resume.progress(), early_stop=early)

    def kept_state(self) -> dict:
        """The :class:`ResumeState` fields of the moving average and early stopping, as they are now (a checkpoint's;
        ``None`` where the fit keeps no such thing)."""
        average = None if self.average is None else self.average.flat
        early = self.early_stop
        if early is None or early.weights is None:
            return {"average": average, "early_stop": None, "best": None}
        return {"average": average, "early_stop": early.counters(), "best": early.weights}

    def without_state(self) -> FitPlan:
        """The plan without the moving average and early stopping's best weights (a barrier stage's ranks take
        those from the state the stage starts from, not from the plan it is shipped)."""
        early = self.early_stop
        return replace(self, average=None, early_stop=None if early is None else
                       EarlyStop(early.patience, early.min_delta, on_score=early.on_score))


class Exchange(abc.ABC):
    """How one engine runs the workers' local steps and combines their deltas."""

    engine: str = "local"
    """The engine's name in round records."""
    workers: int = 1
    """K, as the strategy's outer step counts workers."""
    compression: CompressionKind = CompressionKind.NONE
    """The codec of the updates (round records name it)."""

    @abc.abstractmethod
    def run_round(self, plan: RoundPlan, global_flat: torch.Tensor) -> RoundUpdate:
        """Every worker's local steps from ``global_flat``, and their sample-weighted sum of deltas."""

    validation_rows: int | None = None
    """Rows of the validation data (``None``: not known); the same on every rank."""

    def evaluate(self, global_flat: torch.Tensor, rows: int | None = None,
                 rest_of: int | None = None) -> EvalResult | None:
        """The global weights' loss and metrics on the validation data (``None``: no validation data).

        ``rows``: on at most that many rows, the same fixed random sample each time (a screen). ``rest_of``: on the
        rows a screen of that many leaves out (what it adds to the screen's result for the whole set's).
        """
        return None

    def evaluate_average(self, flat: torch.Tensor, rows: int | None = None,
                         rest_of: int | None = None) -> EvalResult | None:
        """Scores of the moving average of the global weights (:class:`WeightAverage`): weights no worker
        receives; by default what :meth:`evaluate` says of them."""
        return self.evaluate(flat, rows=rows) if rest_of is None else self.evaluate(flat, rest_of=rest_of)

    def background_evaluator(self) -> NetScorer | None:
        """A scorer that may run in another thread while this exchange runs rounds (its own copy of the
        evaluating net), for :attr:`EvalPlan.overlap`; ``None``: this engine cannot evaluate behind its rounds."""
        return None

    def agree(self, due: bool) -> bool:
        """Whether to evaluate, the same on every rank: an engine whose ranks each decide (from their own
        clocks) takes any rank's yes."""
        return due

    def new_global(self, global_flat: torch.Tensor, progress: Progress) -> None:
        """Called with every round's new global weights, before they are evaluated (e.g. a moving average)."""

    def stop_reason(self, record: dict, progress: Progress) -> str | None:
        """A reason of the engine's own to stop after this round (on every rank alike), or ``None``."""
        return None

    def round_done(self, record: dict, global_flat: torch.Tensor, progress: Progress) -> None:
        """Called after every round with its record (before it is emitted): checkpoints, state for a restart."""


def weighted_mean(total: torch.Tensor, samples: float) -> torch.Tensor:
    """The sample-weighted mean delta ``total / samples`` as float32 (``total`` is the weighted sum).

    Raises
    ------
    NonFiniteUpdate
        No worker's update counted (every one was empty or non-finite).
    """
    if not samples > 0:
        raise NonFiniteUpdate("no worker produced finite weights this round (every loss or update was NaN/Inf, or no "
                          "worker had data); lower the learning rate or check the data")
    return (total / samples).to(torch.float32)


def whole_or(part: slice | None, numel: int) -> slice | None:
    """``part``, or ``None`` when it covers all ``numel`` weights (what :attr:`RoundUpdate.part` says then)."""
    return None if part is None or (part.start == 0 and part.stop == numel) else part


def late_update(arrived: RoundUpdate | None, now: RoundUpdate) -> RoundUpdate:
    """What an overlapped exchange hands the loop: the sums that ``arrived`` (the previous round's), with this
    round's steps, times and bytes (``now``). In the last round ``now`` carries this round's sums too, over all
    the weights, and the update is both together: the loop's one outer step takes the two means added.
    """
    if arrived is None:
        return now
    if now.total is None:  # this round's sums are on their way
        return replace(arrived, steps=now.steps, compute_s=now.compute_s, slowest_steps=now.slowest_steps,
                       nbytes=now.nbytes, fields={**arrived.fields, **now.fields})
    total, samples, loss_sum = now.total.clone(), now.samples, now.loss_sum
    if arrived.samples > 0:
        part = arrived.part or slice(0, total.numel())
        if samples > 0:
            total[part] += arrived.total * (samples / arrived.samples)
        else:
            total.zero_()
            total[part] = arrived.total
            samples, loss_sum = arrived.samples, arrived.loss_sum
    return replace(now, total=total, samples=samples, loss_sum=loss_sum, processed=arrived.processed + now.processed,
                   nonfinite=tuple(sorted(set(arrived.nonfinite) | set(now.nonfinite))),
                   fields={**arrived.fields, **now.fields})


class WeightAverage:
    """An exponential moving average of the global weights over rounds (Polyak averaging).

    After round ``r`` (rounds done, counted from 1) the average becomes
    ``decay_r * average + (1 - decay_r) * global`` with ``decay_r = min(decay, (1 + r) / (10 + r))``:
    a short warm-up, so the initial weights weigh little once a few rounds are done.

    Parameters
    ----------
    decay : float
        The decay per round, in (0, 1) (``DistributedConfig.weight_ema``).
    flat : Tensor
        The average to start from: the initial global weights (copied).
    """

    def __init__(self, decay: float, flat: torch.Tensor):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the moving average's decay is in (0, 1), got {decay}")
        self.decay = float(decay)
        self.flat = flat.detach().to(torch.float32).clone()

    def decay_after(self, rounds_done: int) -> float:
        """The decay applied after round ``rounds_done`` (the warm-up's or :attr:`decay`, the smaller)."""
        return min(self.decay, (1 + rounds_done) / (10 + rounds_done))

    def update(self, global_flat: torch.Tensor, rounds_done: int) -> None:
        """Fold round ``rounds_done``'s new global weights into the average."""
        d = self.decay_after(rounds_done)
        self.flat.mul_(d).add_(global_flat, alpha=1 - d)


def returned_summary(rounds: list[dict], decay: float | None) -> dict:
    """A fit's summary fields about which weights it returned (none: its last global weights).

    With a moving average (``decay``): ``returned_weights`` is ``"ema"`` (the fit returns the average; its
    ``test_<metric>`` fields are the average's), ``weight_ema`` its decay, and ``test_global_<metric>`` /
    ``test_global_loss`` the last global weights' scores on the validation data (the last round's
    ``val_<metric>``). Stopped early (``--patience``, the last round's ``best_round``): ``returned_weights`` is
    ``"best"`` and ``best_round`` the round whose weights (or average) the fit returns, its ``test_<metric>`` fields
    that round's (the last record's ``best_scores``: :func:`sparknet.metrics.returned_scores`).
    """
    last = rounds[-1] if rounds else {}
    out = {}
    if decay is not None:
        out = {"returned_weights": "ema", "weight_ema": decay,
               **{f"test_global_{k[4:]}": v for k, v in last.items()
                  if k.startswith("val_") and not k.startswith("val_ema_")}}
    if "best_round" in last:
        out.update(returned_weights="best", best_round=last["best_round"])
    return out


def run_rounds(exchange: Exchange, plan: FitPlan, global_flat: torch.Tensor, *,
               on_record: Callable[[dict], None] | None = None, t0: float | None = None) -> torch.Tensor:
    """Train round after round until ``plan.stop`` says so; returns the final global weights (or their average, or
    the best weights scored where the plan stops early).

    Parameters
    ----------
    exchange : Exchange
        The engine: runs the local steps and sums the deltas.
    plan : FitPlan
        The strategy (whose :meth:`~TrainingStrategy.apply` makes the new global weights from the mean delta), the
        stopping rule, the evaluations, automatic tau, the moving average and the counters to continue from.
    global_flat : Tensor
        The global weights to start from (``strategy.init_global`` already applied).
    on_record : callable, optional
        Called with every round record.
    t0 : float, optional
        ``time.perf_counter()`` the records' ``wall_s`` counts from (default: now).
    """
    t0 = time.perf_counter() if t0 is None else t0
    if plan.weight_ema is not None and plan.average is None:
        plan.average = WeightAverage(plan.weight_ema, global_flat)
    check = _Evaluation(exchange, plan.evaluation, plan.stop, t0, plan.average, whole=plan.early_stop is not None)
    if not check.plan.overlap:
        return _loop(exchange, plan, global_flat, check, on_record, t0)
    background = exchange.background_evaluator()
    if background is None:
        raise ValueError(f"the {exchange.engine} engine evaluates where it trains and cannot evaluate behind its "
                         "rounds; train without eval_overlap (--eval-overlap), or with the rounds engine on Spark")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="sparknet-eval") as pool:  # waits for an evaluation in flight
        check.behind = (pool, background)
        return _loop(exchange, plan, global_flat, check, on_record, t0)


def _loop(exchange: Exchange, fit: FitPlan, global_flat: torch.Tensor, check: _Evaluation, on_record,
          t0: float) -> torch.Tensor:
    """:func:`run_rounds`' loop. With an overlapped evaluation (``check.behind``) a round's record waits in
    ``pending`` while its weights are scored behind the next round, and is handed on (in round order) once scored."""
    strategy, stop, progress, auto, average = fit.strategy, fit.stop, fit.progress, fit.auto, fit.average
    early = fit.early_stop
    K = exchange.workers
    # (round, record, (future, weights)) of the round scored behind this one
    pending: tuple[int, dict | None, tuple] | None = None
    if check.behind is not None and early is not None and early.judged < progress.round:
        # resumed from a checkpoint written before its round was scored: scored behind the next round, as it would
        # have been (its record was never written, and is not now)
        behind = check.submit(progress.round, global_flat, {})
        pending = None if behind is None else (progress.round, None, behind)

    def judged() -> torch.Tensor:  # the weights a target, and early stopping, judge: the average's where it is kept
        return global_flat if average is None else average.flat
    while True:
        if auto is not None:
            stop.tau = auto.tau
        steps = stop.steps_for_round(progress.steps_done)
        last = stop.reason(progress.round + 1, progress.steps_done + steps, progress.samples_done, None) is not None
        plan = RoundPlan(round=progress.round, steps=steps, seconds=stop.round_seconds, last=last)
        t_round = time.perf_counter()
        update = exchange.run_round(plan, global_flat)
        k = update.workers or K
        if update.total is not None:  # None: an overlapped exchange's first round, nothing back yet
            try:
                mean = weighted_mean(update.total, update.samples)
            except NonFiniteUpdate as exc:
                raise NonFiniteUpdate(f"round {progress.round + 1}: {exc} (non-finite workers: "
                                      f"{list(update.nonfinite)})") from None
            global_flat = strategy.apply(global_flat, mean, k, part=update.part)
        round_s = time.perf_counter() - t_round
        progress.round += 1
        progress.steps_done += update.steps
        progress.samples_done += update.processed
        progress.total_bytes += update.nbytes
        exchange.new_global(global_flat, progress)
        if average is not None:
            average.update(global_flat, progress.round)
        r = progress.round
        comm_s = max(round_s - update.compute_s, 0.0)
        record = {
            "event": "round", "round": r, "steps": update.steps, "total_steps": progress.steps_done,
            "samples": update.processed, "total_samples": progress.samples_done, "wall_s": 0.0,
            "start_s": t_round - t0, "round_s": round_s,
            "compute_s": update.compute_s, "comm_s": comm_s,
            "loss": update.loss_sum / update.samples if update.samples else math.nan,
            "bytes": update.nbytes, "total_bytes": progress.total_bytes,
            "tau": steps if steps < StopRule.UNBOUNDED_STEPS else None, "workers": k, "engine": exchange.engine,
            "strategy": getattr(strategy.name, "value", str(strategy.name)), "compression": exchange.compression,
            **update.fields,
        }
        if auto is not None:
            if update.observe:
                auto.observe(update.slowest_steps, update.compute_s, comm_s if update.sync_s is None else update.sync_s)
            record["next_tau"] = auto.tau
        if update.nonfinite:
            record["nonfinite_workers"] = len(update.nonfinite)
            log.warning("round %d: workers %s had NaN/Inf loss or weights and were left out of the average", r,
                        list(update.nonfinite))
        behind = None
        if check.behind is None:
            scored = check.round(r, global_flat, record, last=last)
            if early is not None and scored is not None:
                early.observe(r, scored, judged())
        else:  # the previous round's score decides; this round's is scored while the next one trains
            scored = None
            if pending is not None:
                (earlier_round, earlier, (future, weights)), pending = pending, None
                scored = future.result()
                if early is not None and scored is not None:
                    early.observe(earlier_round, scored, weights)
                if on_record is not None and earlier is not None:
                    on_record(earlier)
        reason = stop.reason(r, progress.steps_done, progress.samples_done, scored)
        if reason is None and early is not None and early.exhausted:
            reason = "patience"
        if check.behind is not None and not last and reason is None:
            behind = check.submit(r, global_flat, record)
        reason = reason or exchange.stop_reason(record, progress)
        if reason is not None and behind is not None:
            future, weights = behind  # the exchange stopped the run: this round is the last, scored now
            if (scored := future.result()) is not None and early is not None:
                early.observe(r, scored, weights)
            behind = None
        if reason is not None and "val_loss" not in record:
            scored = check.full(global_flat, record)
            if early is not None and scored is not None:
                early.observe(r, scored, judged())
        if reason is None and update.steps == 0:
            raise EngineError(f"round {r}: no worker made a step; check tau, steps and the data")
        if reason is not None:
            record["stop_reason"] = reason
            if early is not None and early.best_round is not None:
                record.update(best_round=early.best_round, best_scores=early.scores)
        record["wall_s"] = time.perf_counter() - t0
        exchange.round_done(record, global_flat, progress)
        record["wall_s"] = time.perf_counter() - t0
        if behind is not None:
            pending = (r, record, behind)
        elif on_record is not None:
            on_record(record)
        if reason is not None:
            return early.weights if early is not None and early.weights is not None else judged()


class _Evaluation:
    """The loop's evaluations (:class:`EvalPlan`): screens, full evaluations, and what the records say."""

    def __init__(self, exchange: Exchange, plan: EvalPlan, stop: StopRule, t0: float,
                 average: WeightAverage | None = None, *, whole: bool = False):
        self.exchange, self.plan, self.t0, self.average = exchange, plan, t0, average
        self.target = stop.target_accuracy
        # a target loss, and early stopping, are judged on the whole set: a screen goes on to a full evaluation
        self.whole = whole or stop.target_loss is not None
        self.screening = plan.screens(exchange.validation_rows)
        self.since_full = 0  # evaluations since the last full one
        self.spent_s = 0.0  # seconds evaluating so far
        self.done = 0  # evaluations so far
        self.behind = None  # (thread pool, evaluating exchange) of an overlapped evaluation

    def due(self, r: int, last: bool) -> bool:
        """Whether round ``r``'s weights are to be evaluated (every ``plan.every`` rounds, within the budget)."""
        if r % self.plan.every:
            return False
        if self.plan.budget is not None and not last:
            over = self.done > 0 and self.spent_s > self.plan.budget * (time.perf_counter() - self.t0)
            if not self.exchange.agree(not over):
                return False
        return True

    def round(self, r: int, global_flat: torch.Tensor, record: dict, *, last: bool = False) -> EvalResult | None:
        """Evaluate after round ``r`` when it is due; the whole set's result (what the targets are judged on) when
        measured, else ``None``."""
        if not self.due(r, last):
            return None
        return self._counted(global_flat, record, self.exchange, None if self.average is None else self.average.flat)

    def submit(self, r: int, global_flat: torch.Tensor, record: dict):
        """Round ``r``'s evaluation in the background when due: a future of what :meth:`round` returns, and the
        copy of the weights it judges (``None`` when none is due). It scores copies of the weights, so the loop goes
        on changing its own."""
        if not self.due(r, False):
            return None
        pool, background = self.behind
        weights = global_flat.clone()
        avg = None if self.average is None else self.average.flat.clone()
        record["eval_overlapped"] = True
        return pool.submit(self._counted, weights, record, background, avg), weights if avg is None else avg

    def _counted(self, global_flat, record, via, avg) -> EvalResult | None:
        scored = self._round(global_flat, record, via, avg)
        self.done += 1
        self.spent_s += record.get("eval_s", 0.0)  # the screen and the full pass, as the record has them
        return scored

    def _round(self, global_flat: torch.Tensor, record: dict, via: Exchange | NetScorer, avg) -> EvalResult | None:
        screen = None
        if self.screening and self.since_full + 1 < self.plan.full_every:
            rows = self.plan.screen_rows
            t = time.perf_counter()
            result = via.evaluate(global_flat, rows=rows)
            if result is None:
                return None
            record.update({f"screen_{k}": v for k, v in result.metrics.items()}, screen_loss=result.loss,
                          screen_rows=rows)
            screen = _Screen(rows, result, self._average(result, record, "screen", rows, via, avg))
            record["eval_s"] = time.perf_counter() - t
            near = self.whole or (
                self.target is not None and screen.judged.score >= self.target - screen_margin(self.target, rows))
            if not near:
                self.since_full += 1
                return None
        return self.full(global_flat, record, via, avg, screen=screen)

    def full(self, global_flat: torch.Tensor, record: dict, via: Exchange | NetScorer | None = None,
             avg=None, screen: _Screen | None = None) -> EvalResult | None:
        """Evaluate on the whole validation set (``None``: there is none), by ``via`` (default: the exchange); after
        a ``screen`` of the same weights, only the rows it left out are scored."""
        via = via or self.exchange
        if avg is None and self.average is not None:
            avg = self.average.flat
        t = time.perf_counter()
        result = via.evaluate(global_flat) if screen is None else via.evaluate(global_flat, rest_of=screen.rows)
        if result is None:
            return None
        if screen is not None:
            result = screen.result.joined(result)
        self.since_full = 0
        record.update({f"val_{k}": v for k, v in result.metrics.items()}, val_loss=result.loss)
        result = self._average(result, record, "val", None, via, avg, screen)
        record["eval_s"] = record.get("eval_s", 0.0) + time.perf_counter() - t
        return result

    def _average(self, result: EvalResult, record: dict, prefix: str, rows: int | None, via: Exchange | NetScorer,
                 avg, screen: _Screen | None = None) -> EvalResult:
        """With a moving average (``avg``, its weights): its scores beside the global weights'
        (``<prefix>_ema_<metric>``), and its result (what the target is judged on); without one: ``result``. After
        a ``screen`` of the same weights, only the rows it left out are scored."""
        if avg is None:
            return result
        if screen is None:
            avg = via.evaluate_average(avg, rows=rows)
        else:
            avg = screen.judged.joined(via.evaluate_average(avg, rest_of=screen.rows))
        record.update({f"{prefix}_ema_{k}": v for k, v in avg.metrics.items()}, **{f"{prefix}_ema_loss": avg.loss})
        return avg


@dataclass(frozen=True)
class _Screen:
    """A screen's rows and results: the global weights' (``result``) and what the target is judged on
    (``judged``: the moving average's where there is one, else ``result``)."""

    rows: int
    result: EvalResult
    judged: EvalResult


class NetScorer:
    """Scores weights with a :class:`~sparknet.net.Net` on its validation data (``None``: there is none, or no net):
    the driver-side evaluation of an exchange, and, with a net of its own, an overlapped one's."""

    def __init__(self, net):
        self.net = net

    @property
    def scores(self) -> bool:
        """Whether there is a net with validation data to score on."""
        return self.net is not None and getattr(self.net, "_val", None) is not None

    def evaluate(self, flat: torch.Tensor, rows: int | None = None, rest_of: int | None = None) -> EvalResult | None:
        if not self.scores:
            return None
        self.net.set_flat(flat)
        return self.net.evaluate(sample=rows, rest_of=rest_of)

    evaluate_average = evaluate  # a moving average's weights are scored as any others


class InProcessExchange(Exchange):
    """K workers in this process, trained one after another from the same global weights.

    What the simulator runs (iterations, not seconds, are what it measures) and what one-process
    training runs with K = 1. With compression the workers' updates go up through the codec (error
    feedback in each worker's state) and the global weights come down through a
    :class:`~sparknet.strategies.Downlink`, exactly as in the Spark engines.

    Parameters
    ----------
    nets : sequence of Net
        The workers, each with its training data set.
    strategy : TrainingStrategy
        The worker hooks (``worker_begin``, ``worker_delta``).
    evaluator : Net, optional
        Scores the global weights (as the workers received them) on its validation data.
    compression : str
        Codec of the updates and of the weights sent down.
    metrics : MetricsLogger, optional
        One-process training's progress line, moved every ``piece`` local steps; a NaN loss then stops the run at
        once (``nan_message``, with ``loss`` and ``step``). Kept: :attr:`steps_done`, :attr:`train_s`, :attr:`latest`.
    profile : Profile, optional
        Trace one round of every worker with torch's profiler (``worker-<i>``).
    """

    engine = "local"

    def __init__(self, nets: Sequence, strategy: TrainingStrategy, *, evaluator=None,
                 compression: CompressionKind | str = CompressionKind.NONE, metrics=None, piece: int = 50,
                 nan_message: str = "the loss became {loss} at step {step}; lower the learning rate (--lr) or check "
                                    "the data for NaN values", streaming: Streaming | None = None,
                 profile: Profile | None = None):
        self.nets, self.strategy, self.evaluator = list(nets), strategy, evaluator
        self._scorer = NetScorer(evaluator)
        check_streaming(strategy, streaming)
        self.streaming = streaming
        self._arrived: slice | None = None  # the part whose new global weights the workers take next round
        self._in_flight: RoundUpdate | None = None  # an overlapped exchange's sums, applied a round late
        self.workers = len(self.nets)
        self.compressor = make_compressor(compression)
        self.compression = self.compressor.kind
        self.steps = [WorkerStep(net, strategy, compression=compression, streaming=streaming, gradient_hook=False,
                                 train=None if metrics is None else self._pieces(net), profile=profile,
                                 name=f"worker-{i}")
                      for i, net in enumerate(self.nets)]
        self._down: Downlink | None = None
        self._delivered: torch.Tensor | None = None  # the global weights the last message carried
        self.bytes_moved = 0
        """Bytes sent so far: every weight message down, every update up."""
        self.metrics, self.piece, self.nan_message = metrics, int(piece), nan_message
        self.steps_done, self.train_s = 0, 0.0
        self.loss = self.accuracy = self.latest = None
        self.score_shown_as = "acc"
        """The progress line's name for :attr:`accuracy`, the latest score (``r2``: a regression's)."""

    def _deliver(self, global_flat: torch.Tensor) -> torch.Tensor:
        """The workers' copy of ``global_flat``: one downlink message per new global weights."""
        if self._down is None:
            self._down = Downlink(self.compressor, global_flat.numel())
        if self._delivered is not global_flat:
            self.bytes_moved += self.workers * self._down.message(global_flat).numel()
            self._delivered = global_flat
        return self._down.seen

    def run_round(self, plan: RoundPlan, global_flat: torch.Tensor) -> RoundUpdate:
        moved = self.bytes_moved
        seen = self._deliver(global_flat)
        streaming = self.streaming
        part = None if streaming is None else streaming.part(plan.round, seen.numel(), last=plan.last)
        total = torch.zeros_like(global_flat if part is None else global_flat[part])
        samples = processed = steps = slowest_steps = 0
        loss_sum = compute_s = 0.0
        nonfinite = []
        for i, step in enumerate(self.steps):
            result = step.run(plan.steps, seen, round=plan.round, seconds=plan.seconds, part=part,
                              arrived=self._arrived)
            stats = result.stats
            processed += stats.samples
            steps = max(steps, stats.steps)
            if stats.wall_s >= compute_s:
                compute_s, slowest_steps = stats.wall_s, stats.steps
            if not result.finite:
                nonfinite.append(i)
                continue
            self.bytes_moved += result.nbytes
            delta = result.delta if result.message is None else self.compressor.decode(result.message,
                                                                                        result.delta.numel())
            total.add_(delta, alpha=stats.samples)
            samples += stats.samples
            loss_sum += stats.loss * stats.samples
        update = RoundUpdate(total=total, samples=samples, loss_sum=loss_sum, steps=steps, processed=processed,
                             compute_s=compute_s, slowest_steps=slowest_steps, nonfinite=tuple(nonfinite),
                             nbytes=self.bytes_moved - moved, part=whole_or(part, seen.numel()))
        if streaming is None:
            return update
        if not streaming.overlap:
            self._arrived = part
            return update
        arrived, self._in_flight = self._in_flight, (None if plan.last else update)
        if plan.last:
            return late_update(arrived, update)
        self._arrived = None if arrived is None else (arrived.part or slice(0, seen.numel()))
        return late_update(arrived, replace(update, total=None, samples=0, loss_sum=0.0, processed=0))

    def _pieces(self, net):
        """The worker's local steps in pieces of ``piece`` steps, each reported to :meth:`_progress`."""

        def train(steps: int, seconds: float | None):
            done, t0 = [], time.perf_counter()
            while sum(s.steps for s in done) < steps:
                left_s = None if seconds is None else seconds - (time.perf_counter() - t0)
                if left_s is not None and left_s <= 0:
                    break
                stats = net.train(min(self.piece, steps - sum(s.steps for s in done)), max_seconds=left_s)
                self._progress(stats)
                done.append(stats)
                if stats.steps == 0:
                    break
            return sum_stats(done)

        return train

    def _progress(self, stats) -> None:
        self.steps_done += stats.steps
        self.train_s += stats.wall_s
        self.loss = stats.loss
        self.metrics.progress(stats.steps, loss=stats.loss, lr=self.nets[0].learning_rate,
                              **{self.score_shown_as: self.accuracy})
        if not stats.finite:
            raise FloatingPointError(self.nan_message.format(loss=stats.last_loss, step=self.steps_done))

    def new_global(self, global_flat: torch.Tensor, progress: Progress) -> None:
        self.latest = global_flat

    @property
    def validation_rows(self) -> int | None:
        val = None if self.evaluator is None else getattr(self.evaluator, "_val", None)
        return None if val is None else len(val[0])

    def evaluate(self, global_flat: torch.Tensor, rows: int | None = None,
                 rest_of: int | None = None) -> EvalResult | None:
        if not self._scorer.scores:  # before _deliver: no downlink message is made for nothing
            return None
        return self._scorer.evaluate(self._deliver(global_flat), rows, rest_of)

    def evaluate_average(self, flat: torch.Tensor, rows: int | None = None,
                         rest_of: int | None = None) -> EvalResult | None:
        return self._scorer.evaluate(flat, rows, rest_of)  # as it is: no worker receives it, so no message goes down


