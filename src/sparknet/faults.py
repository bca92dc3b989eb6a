"""Fault injection for reliability tests: make worker r fail at round n, on one attempt only.

A fault is written ``rank=1,round=3,kind=kill[,attempt=0]`` (several joined by ``;``) and given
to :class:`~sparknet.spark.EngineOptions` as ``fault=``: in code only, never read from the
environment, so no setting a production run inherits can make its workers fail. The driver parses
it and ships it to the executors inside the job (so it reaches every worker however the cluster was
started). Rounds count from 1, as in the round records.

Kinds:

- ``raise``: the worker raises :class:`InjectedFault` (a task failure);
- ``exit``: its Python process ends with ``os._exit(17)``;
- ``kill``: it sends itself SIGKILL (a Python worker lost without a word);
- ``hang``: it sleeps (at most ``hang_s``, an hour by default) instead of finishing the round;
- ``nan``: its weights become NaN after the round's steps (the non-finite guard's case).

``attempt`` is the Spark task attempt (rounds engine) or the stage restart (barrier engine)
on which the fault fires, 0 by default: the retry or restart then runs clean.

>>> parse_faults("rank=1,round=3,kind=kill")
(Fault(rank=1, round=3, kind='kill', attempt=0),)
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

__all__ = ["Fault", "InjectedFault", "KINDS", "parse_faults", "faults_from", "due_fault"]

log = logging.getLogger(__name__)

KINDS = ("raise", "exit", "kill", "hang", "nan")
_KEYS = ("rank", "round", "kind", "attempt", "hang_s")
_EXAMPLE = "e.g. rank=1,round=3,kind=kill"


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


@dataclass(frozen=True)
class Fault:
    """Worker ``rank`` fails at round ``round`` (from 1) on attempt ``attempt``, by ``kind``."""

    rank: int
    round: int
    kind: str
    attempt: int = 0
    hang_s: float = 3600.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.rank < 0 or self.round < 1 or self.attempt < 0:
            raise ValueError(f"a fault needs rank >= 0, round >= 1 and attempt >= 0, got rank={self.rank}, "
                             f"round={self.round}, attempt={self.attempt}")
        if not self.hang_s > 0:
            raise ValueError(f"hang_s must be positive, got {self.hang_s}")

    def __repr__(self) -> str:  # hang_s only when it was changed
        extra = f", hang_s={self.hang_s}" if self.hang_s != 3600.0 else ""
        return f"Fault(rank={self.rank}, round={self.round}, kind={self.kind!r}, attempt={self.attempt}{extra})"

    def due(self, rank: int, round: int, attempt: int) -> bool:
        """Whether this fault fires for worker ``rank`` in round ``round`` (from 1) on ``attempt``."""
        return rank == self.rank and round == self.round and attempt == self.attempt

    def fire(self, net=None) -> None:
        """Fail as ``kind`` says. ``nan`` needs the worker's :class:`~sparknet.net.Net`."""
        what = f"injected fault: worker {self.rank}, round {self.round}, attempt {self.attempt}, kind {self.kind}"
        log.warning("%s", what)
        if self.kind == "raise":
            raise InjectedFault(what)
        if self.kind == "exit":
            os._exit(17)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # pragma: no cover - the signal arrives first
        if self.kind == "hang":
            deadline = time.monotonic() + self.hang_s
            while time.monotonic() < deadline:
                time.sleep(0.1)
            return
        if self.kind == "nan":
            if net is None:
                raise ValueError("a nan fault needs the worker's net")
            flat = net.get_flat()
            flat.fill_(float("nan"))
            net.set_flat(flat)


def _parse_one(text: str) -> Fault:
    values: dict = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or key not in _KEYS:
            raise ValueError(f"bad fault {text!r}: {item!r} is not one of {', '.join(k + '=' for k in _KEYS)} "
                             f"({_EXAMPLE})")
        if key in values:
            raise ValueError(f"bad fault {text!r}: {key} given twice")
        values[key] = value
    missing = [k for k in ("rank", "round", "kind") if k not in values]
    if missing:
        raise ValueError(f"bad fault {text!r}: missing {', '.join(missing)} ({_EXAMPLE})")
    try:
        numbers = {k: int(values[k]) for k in ("rank", "round", "attempt") if k in values}
        if "hang_s" in values:
            numbers["hang_s"] = float(values["hang_s"])
    except ValueError:
        raise ValueError(f"bad fault {text!r}: rank, round and attempt are whole numbers, hang_s seconds "
                         f"({_EXAMPLE})") from None
    return Fault(kind=values["kind"].lower(), **numbers)


def parse_faults(text: str | None) -> tuple[Fault, ...]:
    """Faults from their text form (``;`` between faults); empty text means none."""
    if text is None or not str(text).strip():
        return ()
    return tuple(_parse_one(part) for part in str(text).split(";") if part.strip())


def faults_from(config: str | Fault | tuple | list | None = None) -> tuple[Fault, ...]:
    """The faults a run was configured with (none by default; the environment is never read)."""
    if not config:  # None, "" or no faults
        return ()
    if isinstance(config, Fault):
        return (config,)
    if isinstance(config, str):
        return parse_faults(config)
    out = tuple(config)
    for f in out:
        if not isinstance(f, Fault):
            raise TypeError(f"faults must be Fault objects or their text form, got {type(f).__name__}")
    return out


def due_fault(faults, rank: int, round: int, attempt: int) -> Fault | None:
    """The first of ``faults`` due for this worker, round (from 1) and attempt, if any."""
    return next((f for f in faults or () if f.due(rank, round, attempt)), None)
