"""When a fit stops and when it evaluates: rules evaluated identically wherever a round loop runs.

The rounds engine's driver, every rank of the barrier engine and every rank of a
model-parallel stage ask the same :class:`StopRule` how many local steps the next round
takes and whether to stop, and follow the same :class:`EvalPlan`. No pyspark import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StopRule", "EvalPlan", "screen_margin"]


@dataclass
class StopRule:
    """The stopping rules of a fit, evaluated identically wherever the round loop runs."""

    rounds: int | None = None
    steps: int | None = None
    """Local steps per worker, in all rounds."""
    epochs: float | None = None
    target_accuracy: float | None = None
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

    def reason(self, rounds_done: int, steps_done: int, samples_done: int, accuracy: float | None) -> str | None:
        """Why to stop now (``None``: go on)."""
        if self.target_accuracy is not None and accuracy is not None and accuracy >= self.target_accuracy:
            return "target_accuracy"
        if self.rounds is not None and rounds_done >= self.rounds:
            return "rounds"
        if self.steps is not None and steps_done >= self.steps:
            return "steps"
        if self.epochs is not None and self.dataset_rows and samples_done >= self.epochs * self.dataset_rows:
            return "epochs"
        return None


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
    """How far below ``target`` a screen of ``rows`` rows may read and the whole set still reach it: three
    standard errors of a proportion near the target, and one row."""
    p = min(max(target, 0.0), 1.0)
    return 3.0 * math.sqrt(max(p * (1.0 - p), 1e-4) / rows) + 1.0 / rows
