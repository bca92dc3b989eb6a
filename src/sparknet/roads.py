"""The roads a training run takes — one process, Spark's engines, the parameter server, Caffe files — and what each
reads: a setting given (other than its default) that the road taken would leave unread is refused before anything
starts, whether ``sparknet train`` or a program calls the road's entry point. A run trains as asked or not at all."""

from __future__ import annotations

import enum

from sparknet._fields import changed, flag
from sparknet.config import CaffeTrainFlags, DistributedConfig, Engine, EngineOptions, RunConfig, Strategy

AsyncConfig = "AsyncConfig"
"""The parameter server's settings (:class:`sparknet.ps.config.AsyncConfig`), known here by name: the parameter
server's own entry point checks its road, so this module imports nothing of it."""

__all__ = ["Road", "road", "check_road"]


class Road(enum.Enum):
    """The road a ``sparknet train`` takes (:func:`road`)."""

    CAFFE = "caffe"
    """Caffe files (:mod:`sparknet.caffe.cli`)."""
    PARAMETER_SERVER = "parameter server"
    """``--strategy async`` (:mod:`sparknet.ps`)."""
    ONE_PROCESS = "one process"
    """One worker, the rounds engine, no master (:mod:`sparknet.train`)."""
    SPARK = "spark"
    """The Spark engines (:mod:`sparknet.spark.run`)."""


def road(dist: DistributedConfig, caffe: CaffeTrainFlags | None = None) -> Road:
    """The one road these settings ask for: Caffe files win over everything else; then the parameter server
    (``--strategy async``); then one process (:attr:`~sparknet.config.DistributedConfig.one_process`: the local
    engine, or one worker of the rounds engine with no ``--master``); otherwise the Spark engines (``--model-parallel
    M`` splits the net across the barrier engine's workers)."""
    if caffe is not None and caffe.given:
        return Road.CAFFE
    if dist.strategy is Strategy.ASYNC:
        return Road.PARAMETER_SERVER
    if dist.one_process:
        return Road.ONE_PROCESS
    return Road.SPARK


_AUTO_TAU = ("auto_tau", "auto_tau_target", "auto_tau_min", "auto_tau_max", "auto_tau_every")
_EXCHANGE = (*_AUTO_TAU, "data_mode", "stream_buffer_mb", "compression", "link_latency", "link_bandwidth")
"""What only the Spark engines' workers read: the automatic tau of their exchange, how they hold their rows, what
their exchange sends and over which link."""

_UNREAD: dict[Road, tuple[str, str | None, dict[type, tuple[str, ...] | None]]] = {
    Road.ONE_PROCESS: ("a run of one worker in this process, without Spark,",
                       "train on Spark with --workers K, or with --master URL for one worker",
                       {RunConfig: ("gpus_per_worker",),
                        DistributedConfig: ("strategy", "master", "eval_every_rounds", "eval_sharded", "warmup_steps",
                                            *_EXCHANGE),
                        EngineOptions: None, AsyncConfig: None, CaffeTrainFlags: None}),
    Road.PARAMETER_SERVER: ("the async strategy's parameter server (epochs, not rounds, each evaluated and, with "
                            "--checkpoint-dir, checkpointed; no Spark engine)", "choose another --strategy",
                            {RunConfig: ("eval_every", "gpus_per_worker"),
                             DistributedConfig: ("engine", "rounds", "eval_every_rounds", "eval_screen_rows",
                                                 "eval_budget", "eval_overlap", "eval_sharded", *_EXCHANGE),
                             EngineOptions: None, CaffeTrainFlags: None}),
    Road.SPARK: ("a run on Spark", None, {RunConfig: ("eval_every",), AsyncConfig: None, CaffeTrainFlags: None}),
    Road.CAFFE: ("a Caffe run (its net's data layers say what trains on what; --caffe-sources binds others)", None,
                 {RunConfig: ("model", "dataset", "data", "validation_data", "features_col", "label_col", "weight_col",
                              "task", "profile_dir", "profile_round"),
                  AsyncConfig: None}),
}
"""Each road, what to do instead, and the settings it does not read (``None``: none of that kind); given, they are
refused."""

_JUDGED = ("target_accuracy", "target_loss", "patience", "monitor", "min_delta", "eval_every_rounds",
           "eval_screen_rows", "eval_budget", "eval_overlap", "eval_sharded")
"""What sparknet's own evaluation of a fit reads: when to score the weights, and the target (or the early stop) it
judges."""


def _caffe_unread(dist: DistributedConfig) -> tuple:
    """What a Caffe run does not read beyond :data:`_UNREAD`'s Caffe road, as its workers train: in one process its
    rounds end where its solver displays, tests and snapshots, its tests are its test nets' and its snapshots its
    checkpoints; on the rounds engine its test nets score the weights, which the fit itself does not; on the barrier
    engine the fit scores the primary test net every test_interval."""
    if dist.one_process:
        return ("a Caffe run of one worker in this process (its tests and snapshots are its solver's)",
                "train on Spark with --workers K, or with --master URL for one worker",
                {RunConfig: ("gpus_per_worker",),
                 DistributedConfig: ("strategy", "tau", "round_seconds", *_JUDGED, *_EXCHANGE, "checkpoint_dir",
                                     "checkpoint_every", "checkpoint_keep", "resume"),
                 EngineOptions: None})
    if dist.engine is Engine.ROUNDS:
        return ("a Caffe run on the rounds engine (its test nets score the weights, at its test_interval)",
                "add --engine barrier, whose fit scores the primary test net", {DistributedConfig: _JUDGED})
    return ("a Caffe run on the barrier engine (it scores the primary test net every test_interval)", None,
            {DistributedConfig: ("eval_every_rounds",)})


_WHOSE = {"eval_every": "on Spark: --eval-every-rounds N", "eval_every_rounds": "in one process: --eval-every STEPS",
          AsyncConfig: "--strategy async's", CaffeTrainFlags: "a Caffe run's, with --prototxt or --solver",
          EngineOptions: "the Spark engines'"}
"""Whose a setting is, said beside it when refused: a field's name, else its kind."""


def check_road(taken: Road, *settings) -> None:
    """Refuse, before anything starts, the settings given (other than their defaults) that the road ``taken`` would
    leave unread: a run trains as asked or not at all. ``settings``: the dataclasses of ``sparknet train``'s flags
    (``RunConfig``, ``DistributedConfig``, ``EngineOptions``, ``CaffeTrainFlags``, ``AsyncConfig``)."""
    checks = [_UNREAD[taken]]
    dist = next((s for s in settings if isinstance(s, DistributedConfig)), None)
    if taken is Road.CAFFE and dist is not None:
        checks.append(_caffe_unread(dist))
    for subject, instead, unread in checks:
        kinds = [(part, _kind(part, unread)) for part in settings]
        given = [(name, _WHOSE.get(name, _WHOSE.get(kind))) for part, kind in kinds if kind is not None
                 for name in changed(part, unread[kind])]
        if given:
            flags = [flag(name) + (f" ({whose})" if whose else "") for name, whose in given]
            them = "it" if len(given) == 1 else "them"
            raise ValueError(f"{subject} does not read {', '.join(flags)}: "
                             + (f"{instead}, or drop {them}" if instead else f"drop {them}"))


def _kind(settings, table: dict):
    """The key of ``table`` that ``settings`` is of: its class, or its class's name (``None``: neither)."""
    kind = type(settings)
    return kind if kind in table else kind.__name__ if kind.__name__ in table else None
