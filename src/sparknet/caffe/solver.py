"""Caffe solver prototxt -> :class:`CaffeSolver` (a :class:`~sparknet.solvers.SolverConfig` plus
Caffe's own run settings).

>>> solver = load_solver_prototxt("mnist/lenet_solver.prototxt")      # doctest: +SKIP
>>> solver.config.type, solver.config.lr_policy                       # doctest: +SKIP
(<SolverType.SGD: 'sgd'>, <LRPolicy.INV: 'inv'>)
>>> train_net = solver.load_net("TRAIN")                              # doctest: +SKIP

Every solver type is read from the current ``type: "Adam"`` string and from the legacy
``solver_type: ADAM`` enum; every learning-rate policy; ``momentum``, ``momentum2``,
``delta``, ``rms_decay``, ``weight_decay``, ``regularization_type``, ``iter_size``,
``max_iter``, ``clip_gradients``; and the settings only a Caffe run has (``net``,
``test_iter``, ``test_interval``, ``display``, ``snapshot``, ``random_seed``, ...), which
live on :class:`CaffeSolver` beside the ``SolverConfig``. The ``net:`` path of BVLC files, relative to
Caffe's source root (``examples/mnist/...``), is found by :func:`resolve_net_path`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from sparknet.caffe import _schema
from sparknet.caffe.prototxt import (CaffeNet, DataBinding, PrototxtError, _enum_name, _f, load_net_prototxt,
                                     parse_text, read_text, resolve_net_path)
from sparknet.solvers import LRPolicy, SolverConfig, SolverType

logger = logging.getLogger(__name__)

__all__ = ["CaffeSolver", "NetStateSpec", "load_solver_prototxt", "resolve_net_path"]

# Caffe's solver type strings (its registry names, lower-cased); the legacy enum's names are their upper case.
_SOLVER_TYPES = {t.value: t for t in (SolverType.SGD, SolverType.NESTEROV, SolverType.ADAGRAD, SolverType.RMSPROP,
                                      SolverType.ADADELTA, SolverType.ADAM, SolverType.ADAMW)}


@dataclass(frozen=True)
class NetStateSpec:
    """A Caffe ``NetState``: the phase, level and stages a train or test net is built with."""

    phase: str = "TEST"
    """``"TRAIN"`` or ``"TEST"``."""
    level: int = 0
    """Caffe's net level (matched against a rule's ``min_level``/``max_level``)."""
    stages: tuple[str, ...] = ()
    """Stages (matched against a rule's ``stage``/``not_stage``)."""


@dataclass(kw_only=True)
class CaffeSolver:
    """A parsed Caffe solver: the optimisation settings and Caffe's run settings.

    Iteration counts (``test_interval``, ``display``, ``snapshot``, ``max_iter``) are in
    Caffe's unit, optimizer updates; each update sees ``iter_size`` minibatches.
    """

    config: SolverConfig
    """The update rule and learning-rate policy, for :func:`sparknet.optimizers.build_optimizer`."""
    net: str | None = None
    """The ``net:`` (or ``train_net:``) path exactly as the file says it."""
    net_path: Path | None = None
    """``net`` resolved to a file that exists (see :func:`resolve_net_path`), else ``None``."""
    net_text: str | None = None
    """An inline ``net_param``/``train_net_param``, as prototxt text, when the solver has one."""
    test_nets: tuple[str, ...] = ()
    """Separate ``test_net:`` paths, as written (rare; most files use one ``net``)."""
    train_state: NetStateSpec = field(default_factory=lambda: NetStateSpec("TRAIN"))
    """State the training net is built with."""
    test_states: tuple[NetStateSpec, ...] = ()
    """One state per test net (``test_state``); empty means one plain TEST net."""
    test_iter: tuple[int, ...] = ()
    """Test batches per test net, one entry per test net."""
    test_interval: int = 0
    """Updates between tests (0: never)."""
    test_compute_loss: bool = False
    test_initialization: bool = True
    """Run a test before the first update."""
    display: int = 0
    """Updates between progress lines (0: none)."""
    average_loss: int = 1
    """Displayed loss is averaged over this many updates."""
    snapshot: int = 0
    """Updates between snapshots (0: only at the end when ``snapshot_after_train``)."""
    snapshot_prefix: str | None = None
    snapshot_format: str = "BINARYPROTO"
    snapshot_after_train: bool = True
    random_seed: int | None = None
    """Seed for initialisation and shuffling; ``None`` when the file leaves it at -1."""
    solver_mode: str = "GPU"
    device_id: int = 0
    weights: tuple[str, ...] = ()
    """``weights:`` .caffemodel files to fine-tune from."""
    source_path: Path | None = None
    """The solver file, when it was read from one."""

    @property
    def test_plan(self) -> list[tuple[NetStateSpec, int]]:
        """``(state, test_iter)`` for each test net Caffe would run.

        Raises :class:`PrototxtError` (naming the file) when the counts of ``test_iter`` and test nets differ.
        """
        states = self.test_states or (NetStateSpec("TEST"),)
        if not self.test_iter:
            return []
        if len(self.test_iter) != len(states):
            where = str(self.source_path or "<text>")
            raise PrototxtError(f"{where}: {len(self.test_iter)} test_iter values for {len(states)} test nets; "
                                "give one test_iter per test_state", path=where)
        return list(zip(states, self.test_iter))

    def load_net(self, phase: str = "TRAIN", *, stages: tuple[str, ...] | None = None, level: int | None = None,
                 sources: dict[str, DataBinding | str] | None = None, net: str | os.PathLike | None = None) -> CaffeNet:
        """Load the solver's net for ``phase``.

        Parameters
        ----------
        phase : {"TRAIN", "TEST"}
        stages, level : optional
            The net state; defaults come from ``train_state`` (TRAIN) or the first
            ``test_state`` (TEST), as Caffe does.
        sources : dict, optional
            Data source bindings, passed to :func:`~sparknet.caffe.load_net_prototxt`.
        net : path, optional
            Use this net file instead of the solver's ``net``.

        Raises
        ------
        FileNotFoundError
            The solver's ``net`` was not found and no ``net`` is given.
        PrototxtError
            The net is wrong (see :func:`~sparknet.caffe.load_net_prototxt`), or the inline ``net_param`` is empty.
        """
        phase = phase.upper()
        state = self.train_state if phase == "TRAIN" else (self.test_states or (NetStateSpec("TEST"),))[0]
        stages = tuple(state.stages) if stages is None else tuple(stages)
        level = state.level if level is None else level
        if net is not None:
            target: Any = net
        elif self.net_path is not None:
            target = self.net_path
        elif self.net_text is not None:
            if not self.net_text.strip():
                where = str(self.source_path or "<text>")
                raise PrototxtError(f"{where}: the solver's inline net_param is empty; give its layers, or a net: "
                                    "file", path=where)
            target = self.net_text
        else:
            raise FileNotFoundError(f"{self.source_path or '<text>'}: the solver's net {self.net!r} was not found next "
                                    "to the solver or in its parent folders; pass net=PATH")
        try:
            return load_net_prototxt(target, phase=phase, stages=stages, level=level, sources=sources)
        except PrototxtError as exc:
            if net is not None or self.source_path is None or str(self.source_path) in str(exc):
                raise
            # the file at fault is the net: say which solver named it
            raise PrototxtError(f"{exc} (the net of {self.source_path})", layer=exc.layer, path=exc.path,
                                line=exc.line, column=exc.column) from None


def _state(msg: Any, default_phase: str) -> NetStateSpec:
    name = _enum_name(msg, "phase") if msg.HasField("phase") else default_phase
    return NetStateSpec(phase=name, level=int(msg.level), stages=tuple(msg.stage))


def _solver_type(msg: Any, where: str) -> SolverType:
    legacy = None
    if msg.HasField("solver_type"):
        legacy = _SOLVER_TYPES[_enum_name(msg, "solver_type").lower()]
    if msg.HasField("type"):
        key = msg.type.strip().lower()
        if key not in _SOLVER_TYPES:
            raise PrototxtError(f"{where}: unknown solver type {msg.type!r}; Caffe's are SGD, Nesterov, AdaGrad, "
                                "RMSProp, AdaDelta, Adam", path=where)
        current = _SOLVER_TYPES[key]
        if legacy is not None and legacy is not current:
            raise PrototxtError(f"{where}: type {msg.type!r} and solver_type {legacy.name} disagree; keep one",
                                path=where)
        return current
    return legacy if legacy is not None else SolverType.SGD


def load_solver_prototxt(path_or_text: str | os.PathLike, *, net: str | os.PathLike | None = None) -> CaffeSolver:
    """Parse a Caffe solver prototxt.

    Parameters
    ----------
    path_or_text : str or path
        The solver file, or its text.
    net : path, optional
        Overrides the file's ``net:`` (the path is used as given).

    Returns
    -------
    CaffeSolver

    Raises
    ------
    PrototxtError
        A syntax error (naming the file, line and column), an unknown solver type or
        learning-rate policy, or values ``SolverConfig`` rejects (naming the file).
    """
    text, path, where = read_text(path_or_text)
    msg = parse_text(text, _schema.SolverParameter(), where)

    solver_type = _solver_type(msg, where)
    policy_name = msg.lr_policy.strip().lower() if msg.HasField("lr_policy") else "fixed"
    if not msg.HasField("lr_policy"):
        logger.warning("%s: no lr_policy; using 'fixed'", where)
    try:
        policy = LRPolicy.parse(policy_name)
    except ValueError as exc:
        raise PrototxtError(f"{where}: {exc}", path=where) from None
    if not msg.HasField("base_lr"):
        raise PrototxtError(f"{where}: base_lr is not set", path=where)

    settings: dict[str, Any] = dict(
        type=solver_type,
        **{name: _f(getattr(msg, name)) for name in ("base_lr", "momentum", "momentum2", "weight_decay", "delta",
                                                     "rms_decay", "gamma", "power", "clip_gradients")},
        regularization=msg.regularization_type,
        lr_policy=policy,
        stepsize=int(msg.stepsize),
        stepvalues=tuple(int(v) for v in msg.stepvalue),
        iter_size=int(msg.iter_size),
        caffe_history=solver_type in (SolverType.SGD, SolverType.NESTEROV),  # Caffe's momentum rule, exactly
        caffe_delta=solver_type is SolverType.ADAM,  # and where Adam's delta enters
    )
    if solver_type in (SolverType.ADAGRAD, SolverType.RMSPROP) and settings["momentum"]:
        # Caffe refuses these too: its AdaGrad and RMSProp have no momentum term
        name = "AdaGrad" if solver_type is SolverType.ADAGRAD else "RMSProp"
        raise PrototxtError(f"{where}: momentum cannot be used with {name} (momentum: {settings['momentum']:g}); "
                            "drop it, as Caffe requires", path=where)
    if solver_type is SolverType.RMSPROP and not 0 <= settings["rms_decay"] < 1:
        raise PrototxtError(f"{where}: rms_decay should lie between 0 and 1, got {settings['rms_decay']:g}",
                            path=where)
    if msg.max_iter > 0:
        settings["max_iter"] = int(msg.max_iter)
    else:
        logger.warning("%s: no max_iter; using SolverConfig's default", where)
    if policy is not LRPolicy.STEP and settings["stepsize"] <= 0:
        settings.pop("stepsize")  # unused; Caffe's 0 would only matter to the step policy
    try:
        config = SolverConfig(**settings)
    except ValueError as exc:
        raise PrototxtError(f"{where}: {exc}", path=where) from None

    if net is not None:
        net_field = os.fspath(net)
        net_path: Path | None = Path(net_field)
    else:
        net_field = msg.net if msg.HasField("net") else (msg.train_net if msg.HasField("train_net") else None)
        net_path = resolve_net_path(net_field, path) if net_field else None
        if net_field and net_path is None:
            logger.warning("%s: net %r not found near the solver; pass net=PATH to load it", where, net_field)
    inline = next((getattr(msg, name) for name in ("net_param", "train_net_param") if msg.HasField(name)), None)
    net_text = text_format.MessageToString(inline) if inline is not None else None

    solver = CaffeSolver(
        config=config, net=net_field, net_path=net_path, net_text=net_text, test_nets=tuple(msg.test_net),
        train_state=_state(msg.train_state, "TRAIN") if msg.HasField("train_state") else NetStateSpec("TRAIN"),
        test_states=tuple(_state(s, "TEST") for s in msg.test_state),
        test_iter=tuple(int(v) for v in msg.test_iter),
        **{name: getattr(msg, name) for name in ("test_interval", "test_compute_loss", "test_initialization", "display",
                                                 "average_loss", "snapshot", "snapshot_after_train", "device_id")},
        snapshot_prefix=msg.snapshot_prefix if msg.HasField("snapshot_prefix") else None,
        snapshot_format=_enum_name(msg, "snapshot_format"),
        random_seed=int(msg.random_seed) if msg.random_seed >= 0 else None,
        solver_mode=_enum_name(msg, "solver_mode"),
        weights=tuple(msg.weights),
        source_path=path,
    )
    logger.debug("%s: %s, lr policy %s", where, config.type.name, config.lr_policy.name)
    return solver
