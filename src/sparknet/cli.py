"""The ``sparknet`` command.

``sparknet train`` flags are generated from the fields of :class:`sparknet.config.RunConfig`,
:class:`sparknet.config.DistributedConfig` and the flag dataclasses of the Caffe files and the
parameter server (the docstring under each field is its help), so the
command line never restates the configuration. Which road a run takes is decided in one
place, :func:`road`:

============================================ ==========================================
``--prototxt`` / ``--solver``                Caffe files (:mod:`sparknet.caffe.cli`)
``--strategy async``                         the parameter server (:mod:`sparknet.ps`)
one worker, the rounds engine, no master     one process (:mod:`sparknet.train`)
anything else                                the Spark engines (:mod:`sparknet.spark.run`), a net
                                             split across workers (``--model-parallel M``) too
============================================ ==========================================

Every subcommand is listed in :data:`COMMANDS`. This module loads no torch, and a command line loads the module of
the one subcommand it names: ``python -m sparknet`` reads its flags, and answers ``--help`` or a mistyped flag, in a
fraction of a second, and knows the master of a training run's session before it loads torch
(:func:`session_master`, :mod:`sparknet.__main__`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import platform
import sys
import warnings
from collections.abc import Callable, Sequence

from sparknet import __version__
from sparknet._fields import HelpFormatter, OldName, add_dataclass_arguments, from_args
from sparknet._malloc import keep_freed_memory
from sparknet.config import CaffeTrainFlags, DistributedConfig, EngineOptions, RunConfig
from sparknet.errors import SparkNetError
from sparknet.metrics import process_age_s
from sparknet.ps.config import AsyncConfig
from sparknet.roads import Road, check_road, road
from sparknet.spark.session import PANDAS_NOTICE

__all__ = ["main", "build_parser", "parse_args", "prepare", "run", "read_config", "print_config", "Road", "road",
           "session_master", "session_app_name", "train_command", "check_road", "COMMANDS"]

log = logging.getLogger("sparknet")


def _setup_logging(verbose: bool, quiet: bool) -> None:
    level = logging.DEBUG if verbose else logging.ERROR if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # Third-party chatter stays out of the user's way unless asked for.
    for noisy in ("py4j", "pyspark", "matplotlib", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)
    if verbose:  # Spark's JVMs read it when sparknet starts them (sparknet.spark.session)
        os.environ["SPARKNET_SPARK_LOG_LEVEL"] = "INFO"


_TRAIN_FLAGS = {RunConfig: "training", DistributedConfig: "distributed training", EngineOptions: "Spark engines",
                CaffeTrainFlags: None, AsyncConfig: None}
"""The dataclasses whose fields are ``sparknet train``'s flags (and the keys of a ``--config`` file), each with
the title of its flags in ``--help`` (``None``: its docstring's first line)."""
_CODE_ONLY = EngineOptions.CODE_ONLY


def _names(cls) -> list[str]:
    """The fields of ``cls`` that are flags (and ``--config`` keys)."""
    return [f.name for f in dataclasses.fields(cls) if f.name not in _CODE_ONLY]


def _configure_train(p: argparse.ArgumentParser) -> None:
    for flags, title in _TRAIN_FLAGS.items():
        add_dataclass_arguments(p, flags, skip=_CODE_ONLY, title=title or flags.__doc__.strip().splitlines()[0])
    p.add_argument("--sync-interval", dest="tau", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                   action=OldName)
    p.add_argument("--save-model", dest="model_dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                   action=OldName)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a TOML file of settings: every flag is a key (lr = 0.05, batch_size = 64 or batch-size), "
                        "the flags given here win over it")
    p.add_argument("--print-config", action="store_true",
                   help="print the settings as a TOML file (the --config file and the flags merged) and exit")
    p.add_argument("--verbose", action="store_true", help="debug logging, Spark's included")
    p.set_defaults(_run=_run_train, _session=_train_session)


def read_config(path: str) -> dict:
    """The settings of a ``--config`` TOML file as flag destinations (``batch-size`` and ``batch_size`` alike);
    ``ValueError`` naming an unknown key or a table (the file is flat: one key per flag)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not a TOML file ({e})") from None
    names = {name for cls in _TRAIN_FLAGS for name in _names(cls)}
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if isinstance(value, dict):
            raise ValueError(f"--config {path}: {key!r} is a table; write one key per flag, at the top level")
        if name not in names:
            raise ValueError(f"--config {path}: unknown setting {key!r}; the keys are sparknet train's flags "
                             "(see sparknet train --help)")
        out[name] = value
    return out


def _toml_value(value) -> str | None:
    """One value as TOML writes it (``None``: the setting is left out, TOML having no null)."""
    import enum

    if value is None:
        return None
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def print_config(args: argparse.Namespace) -> str:
    """The merged settings of a parsed ``sparknet train`` as a TOML file (what ``--config`` reads back)."""
    lines = ["# sparknet train settings (sparknet train --config FILE)"]
    for cls in _TRAIN_FLAGS:
        lines.append(f"\n# {_TRAIN_FLAGS[cls] or cls.__doc__.strip().splitlines()[0]}")
        for name in _names(cls):
            text = _toml_value(getattr(args, name))
            lines.append(f"# {name} is not set" if text is None else f"{name} = {text}")
    return "\n".join(lines) + "\n"


def train_command(run: RunConfig, dist: DistributedConfig, *, options: EngineOptions | None = None,
                  caffe: CaffeTrainFlags | None = None, parameter_server: AsyncConfig | None = None) -> dict:
    """Train as ``sparknet train`` does, on the one road these settings ask for (:func:`road`), with ``options`` on
    Spark's; returns the summary record. Each road's code is imported as it is taken."""
    caffe = caffe or CaffeTrainFlags()
    parameter_server = parameter_server or AsyncConfig()
    taken = road(dist, caffe)
    check_road(taken, run, dist, options or EngineOptions(), caffe, parameter_server)
    if taken is Road.CAFFE:
        from sparknet.caffe.cli import train_caffe_files

        return train_caffe_files(run, dist, caffe, options)
    if taken is Road.PARAMETER_SERVER:
        from sparknet.ps.session import run_async

        return run_async(run, dist, combiner=parameter_server.combiner, ps_host=parameter_server.ps_host)
    if taken is Road.ONE_PROCESS:
        from sparknet.train import train_local

        return train_local(run, dist)
    from sparknet.spark.run import train_distributed

    return train_distributed(run, dist, options)


def session_master(args: argparse.Namespace) -> str | None:
    """The master of the Spark session a parsed command line starts, as its subcommand tells (its ``_session``:
    ``train`` on the Spark engines' road, ``predict``, ``data``); ``None`` for a command that starts none or may
    start it with settings of its own, and for settings that fail their checks (the command itself reports them)."""
    tell = getattr(args, "_session", None)
    try:
        return tell(args) if tell is not None else None
    except ValueError:
        return None


def session_app_name(args: argparse.Namespace) -> str:
    """The name of the Spark session a parsed command line starts (its subcommand's ``_app_name``; ``sparknet``)."""
    return getattr(args, "_app_name", "sparknet")


def _train_session(args: argparse.Namespace) -> str | None:
    """The master of ``sparknet train``'s session: the configuration's ``resolved_master`` on the Spark engines'
    road; ``None`` on another road or with ``--print-config``."""
    if args.print_config:
        return None
    run, dist, options, caffe, parameter_server = _train_settings(args)
    taken = road(dist, caffe)
    if taken is not Road.SPARK:
        return None
    check_road(taken, run, dist, options, caffe, parameter_server)  # a run refused starts no session
    return dist.resolved_master


def _train_settings(args: argparse.Namespace) -> tuple:
    """``sparknet train``'s settings from its parsed flags, in the order of :data:`_TRAIN_FLAGS` (each checks
    itself)."""
    return tuple(from_args(cls, args) for cls in _TRAIN_FLAGS)


def _run_train(args: argparse.Namespace) -> int:
    if args.print_config:
        sys.stdout.write(print_config(args))
        return 0
    run, dist, options, caffe, parameter_server = _train_settings(args)
    summary = train_command(run, dist, options=options, caffe=caffe, parameter_server=parameter_server)
    keys = ("test_accuracy", "test_r2", "test_rmse", "test_mae", "test_f1", "test_auc", "test_loss", "wall_s",
            "samples_per_s", "steps", "rounds", "weight_bytes_per_worker", "rounds_transport", "data_mode",
            "first_round_s", "best_round", "best_epoch", "validation_weight")
    # a score the task does not have (a regressor's accuracy), or no weights, is left out, not printed as null
    result = {k: summary.get(k) for k in keys
              if k in summary and not ((k.startswith("test_") or k == "validation_weight") and summary[k] is None)}
    # wall_s is the fit (setup, rounds, evaluations); command_s what the user waited, from the process's start
    result["command_s"] = process_age_s()
    print(json.dumps(result))  # --quiet too: the run's result
    return 0


def _run_version(args: argparse.Namespace) -> int:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:  # as its package says, with nothing of it loaded
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    print(json.dumps({"sparknet": __version__, "python": platform.python_version(), "torch": installed("torch"),
                      "pyspark": installed("pyspark")}))
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None] | str]] = {
    "train": ("train a network (one process, or K Spark workers with --workers K)", _configure_train),
    "sample": ("generate text from a trained character model (char_lstm)", "sparknet.sample:configure_sample"),
    "version": ("print the versions sparknet runs with", lambda p: p.set_defaults(_run=_run_version)),
    "caffe": ("Caffe files: inspect a prototxt or .caffemodel, export a model folder, import Caffe files",
              "sparknet.caffe.command:configure_command"),
    "doctor": ("check a Spark cluster before training: versions, memory, pickling, barrier, data skew",
               "sparknet.tools.doctor:configure_command"),
    "export": ("export a trained model folder to ONNX or TorchScript for serving outside Spark",
               "sparknet.tools.export:configure_command"),
    "plot": ("draw learning curves (loss and accuracy against time and samples) from a metrics file",
             "sparknet.tools.plot:configure_command"),
    "predict": ("score Parquet data with a saved model through Spark (adds prediction, and a classifier's "
                "probability)",
                "sparknet.tools.predict:configure_command"),
    "evaluate": ("the loss and the metrics of a saved model on labelled Parquet data, scored through Spark",
                 "sparknet.tools.predict:configure_evaluate"),
    "experiment": ("reproduce the SparkNet paper's experiments (JSON + PNG per experiment)",
                   "sparknet.experiments.cli:configure_command"),
    "data": ("make a data set at scale on Spark's executors as Parquet (extended-mnist)",
             "sparknet.tools.data:configure_command"),
}
"""``sparknet NAME``: its help line and what adds its arguments and sets its runner (``_run``): a function, or
``"module:function"``, imported only for a command line that names it (the others' modules load torch)."""


def _configurer(name: str) -> Callable[[argparse.ArgumentParser], None]:
    configure = COMMANDS[name][1]
    if callable(configure):
        return configure
    module, function = configure.split(":")
    return getattr(importlib.import_module(module), function)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every subcommand listed, their arguments added to ``only``'s where it is given (a
    subcommand's name, or ``""``: none), else to all."""
    parser = argparse.ArgumentParser(prog="sparknet", description="Deep-network training on Apache Spark with PyTorch.")
    parser.add_argument("--version", action="version", version=f"sparknet {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = {}  # name -> its parser (parse_args sets train's defaults from a --config file)
    for name, (help_text, _) in COMMANDS.items():
        parser.commands[name] = sub.add_parser(name, help=help_text, description=help_text,
                                               formatter_class=HelpFormatter)
        if only is None or only == name:
            _configurer(name)(parser.commands[name])
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line parsed, with the arguments of the subcommand it names alone (no other's module loaded); for
    ``sparknet train --config FILE``, the file's settings under the flags given."""
    argv = sys.argv[1:] if argv is None else list(argv)
    named = next((a for a in argv if not a.startswith("-")), "")
    parser = build_parser(only=named if named in COMMANDS else "")
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        try:
            settings = read_config(args.config)
        except ValueError as e:
            parser.error(str(e))
        parser.commands["train"].set_defaults(**settings)  # the file's values: defaults the flags given override
        args = parser.parse_args(argv)
    return args


def prepare(args: argparse.Namespace) -> None:
    """What a parsed command sets for its process before it runs: the allocator's tunables (the driver's own steps
    and evaluations, :mod:`sparknet._malloc`) and the logs, Spark's level included (read by the JVMs sparknet
    starts)."""
    keep_freed_memory()
    _setup_logging(getattr(args, "verbose", False), getattr(args, "quiet", False))


def run(args: argparse.Namespace) -> int:
    """Run a parsed, prepared command; its exit code (2: bad settings, 1: a failed run, 130: interrupted)."""
    try:
        with warnings.catch_warnings():
            # a known warning that says nothing to a sparknet user
            warnings.filterwarnings("ignore", message=PANDAS_NOTICE, category=FutureWarning)
            return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError, FloatingPointError, ImportError) as e:
        log.error("%s", e)  # an ImportError: an optional part not installed, the message says which extra has it
        return 2
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    except SparkNetError as e:
        log.error("%s", e)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prepare(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
