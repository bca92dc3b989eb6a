"""Enums shared by the configuration and the core, and parsing them from any case with a clear error."""

from __future__ import annotations

import enum

__all__ = ["CompressionKind", "DataMode", "Monitor", "Task", "parse_enum"]


class DataMode(enum.StrEnum):
    """How a Spark worker holds its partition (``--data-mode``): every row in memory, streamed from its
    executor's local disk, or ``auto``: chosen from the partition's size and the memory one task has."""

    AUTO = "auto"
    MEMORY = "memory"
    STREAM = "stream"


class Monitor(enum.StrEnum):
    """What early stopping (``--patience``) watches on the whole validation set."""

    LOSS = "loss"
    """The loss: lower is better (Keras' and Lightning's default)."""
    SCORE = "score"
    """The task's score (accuracy, R-squared, a multi-label net's accuracy over every label): higher is better."""


class CompressionKind(enum.StrEnum):
    """How workers encode the updates they send (``--compression``).

    A ``StrEnum``: a member equals its value (``CompressionKind.INT8 == "int8"``) and prints as it.
    """

    NONE = "none"
    """Float32 updates as they are."""
    FP16 = "fp16"
    """Half precision (IEEE float16)."""
    BF16 = "bf16"
    """Half precision (bfloat16: float32's range, fewer mantissa bits)."""
    INT8 = "int8"
    """One byte per value with a scale per chunk, the rounding error fed back into the next update."""


class Task(str, enum.Enum):
    """What a net learns (:mod:`sparknet.labels` checks its labels and scores it so)."""

    CLASSIFICATION = "classification"
    """Labels are class ids 0..C-1 (one per row, or one per position of a sequence)."""
    REGRESSION = "regression"
    """Labels are real numbers (one per row, or a vector per row)."""
    MULTILABEL = "multilabel"
    """Labels are a 0 or 1 for each output (a vector per row; one number for one output)."""
    UNLABELLED = "unlabelled"
    """No labels: the loss takes the input (an autoencoder); scored by its loss alone."""

    @property
    def float_labels(self) -> bool:
        """Whether the labels are float numbers (not int64 class ids)."""
        return self in (Task.REGRESSION, Task.MULTILABEL)


def parse_enum(cls: type[enum.Enum], value, what: str):
    """Accept an enum member or its value in any case; a clear ``ValueError`` otherwise."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(getattr(value, "value", value)).lower())  # a member of a look-alike enum reads as its value
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; choose one of {[m.value for m in cls]}") from None
