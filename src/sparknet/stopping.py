"""When a fit stops: one rule, evaluated identically wherever a round loop runs.

The rounds engine's driver, every rank of the barrier engine and every rank of a
model-parallel stage ask the same :class:`StopRule` how many local steps the next round
takes and whether to stop. No pyspark import.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StopRule"]


@dataclass
class StopRule:
    """The stopping rules of a fit, evaluated identically wherever the round loop runs."""

    rounds: int | None = None
    max_steps: int | None = None
    """Local steps per worker, in all rounds."""
    epochs: float | None = None
    target_accuracy: float | None = None
    dataset_rows: int = 0
    tau: int | None = None
    round_seconds: float | None = None

    UNBOUNDED_STEPS = 1 << 40

    def steps_for_round(self, steps_done: int) -> int:
        """Local steps to ask of each worker this round (tau, capped by what ``max_steps`` leaves)."""
        steps = self.tau if self.tau is not None else self.UNBOUNDED_STEPS
        if self.max_steps is not None:
            steps = min(steps, max(self.max_steps - steps_done, 0))
        return steps

    def reason(self, rounds_done: int, steps_done: int, samples_done: int, accuracy: float | None) -> str | None:
        """Why to stop now (``None``: go on)."""
        if self.target_accuracy is not None and accuracy is not None and accuracy >= self.target_accuracy:
            return "target_accuracy"
        if self.rounds is not None and rounds_done >= self.rounds:
            return "rounds"
        if self.max_steps is not None and steps_done >= self.max_steps:
            return "max_steps"
        if self.epochs is not None and self.dataset_rows and samples_done >= self.epochs * self.dataset_rows:
            return "epochs"
        return None
