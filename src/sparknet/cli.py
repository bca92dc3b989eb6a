"""The ``sparknet`` command.

``sparknet train`` flags are generated from the fields of :class:`sparknet.config.RunConfig`
and :class:`sparknet.config.DistributedConfig` (the docstring under each field is its help),
so the command line never restates the configuration.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import json
import logging
import os
import sys
import types
import typing
import warnings
from collections.abc import Callable, Sequence

from sparknet.config import DistributedConfig, Engine, RunConfig

__all__ = ["main", "build_parser"]

log = logging.getLogger("sparknet")

_SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {}


def subcommand(name: str, help: str):
    """Register ``sparknet NAME``: decorates ``configure(parser)``, which sets ``_run`` as a default."""

    def deco(configure):
        _SUBCOMMANDS[name] = (help, configure)
        return configure

    return deco


def field_docs(cls) -> dict[str, str]:
    """The docstrings written under each field of a dataclass (its help texts)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp):
    """(type, optional) from an annotation such as ``int | None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, *, skip: Sequence[str] = (), title: str | None = None) -> None:
    """Add one ``--flag`` per field of ``cls`` (defaults taken from the dataclass)."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, optional = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = docs.get(f.name, "")
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            group.add_argument(flag, choices=[m.value for m in tp], default=default.value if isinstance(default, enum.Enum) else default,
                               help=help_text)
        elif typing.get_origin(tp) is tuple:
            group.add_argument(flag, type=int, nargs="*", default=default, help=help_text)
        else:
            group.add_argument(flag, type=tp, default=default, help=help_text + (" (optional)" if optional and default is None else ""))
    return None


def _from_args(cls, args: argparse.Namespace):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def _setup_logging(verbose: bool, quiet: bool) -> None:
    level = logging.DEBUG if verbose else logging.ERROR if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # Third-party chatter stays out of the user's way unless asked for.
    for noisy in ("py4j", "pyspark", "matplotlib", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)
    if verbose:  # Spark's JVMs read it when sparknet starts them (sparknet.spark._session)
        os.environ["SPARKNET_SPARK_LOG_LEVEL"] = "INFO"


def _quiet_warnings() -> None:
    """Known warnings that say nothing to a sparknet user (only inside a command's run)."""
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)


@subcommand("train", "train a network (one process, or K Spark workers with --workers K)")
def _configure_train(p: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(p, RunConfig, title="training")
    add_dataclass_arguments(p, DistributedConfig, title="distributed training")
    for extra in _train_extensions():
        add_dataclass_arguments(p, extra, title=extra.__doc__.strip().splitlines()[0] if extra.__doc__ else None)
    p.add_argument("--verbose", action="store_true", help="debug logging, Spark's included")
    p.set_defaults(_run=_run_train)


def _train_extensions() -> list:
    """Config dataclasses of optional parts that add flags to ``sparknet train``.

    Each part's module exposes its dataclass as ``TRAIN_FLAGS`` and a runner
    ``train_with(run, dist, flags) -> summary | None`` (``None``: not mine, go on).
    """
    import importlib

    out = []
    for module in _TRAIN_EXTENSION_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue
            raise
        out.append(mod.TRAIN_FLAGS)
    return out


_TRAIN_EXTENSION_MODULES = ("sparknet.caffe.cli", "sparknet.parallel.cli", "sparknet.ps.cli")


def _run_train(args: argparse.Namespace) -> int:
    import importlib

    run = _from_args(RunConfig, args)
    dist = _from_args(DistributedConfig, args)
    summary = None
    for extra in _train_extensions():
        mod = importlib.import_module(extra.__module__)
        summary = mod.train_with(run, dist, _from_args(extra, args))
        if summary is not None:
            break
    if summary is None and dist.workers == 1 and args.engine == Engine.ROUNDS.value and args.master is None:
        from sparknet.train import train_local

        summary = train_local(run, dist)
    elif summary is None:
        from sparknet.spark.run import train_distributed

        summary = train_distributed(run, dist)
    keys = ("test_accuracy", "wall_s", "samples_per_s", "steps", "rounds", "weight_bytes_per_worker")
    print(json.dumps({k: summary.get(k) for k in keys if k in summary}))  # --quiet too: the run's result
    return 0


@subcommand("sample", "generate text from a trained character model (char_lstm)")
def _configure_sample(p: argparse.ArgumentParser) -> None:
    from sparknet.sample import configure_sample, run_sample

    configure_sample(p)
    p.set_defaults(_run=run_sample)


@subcommand("version", "print the versions sparknet runs with")
def _configure_version(p: argparse.ArgumentParser) -> None:
    def run(args):
        import platform

        import torch

        from sparknet import __version__

        info = {"sparknet": __version__, "python": platform.python_version(), "torch": torch.__version__}
        try:
            import pyspark

            info["pyspark"] = pyspark.__version__
        except ImportError:
            info["pyspark"] = None
        print(json.dumps(info))
        return 0

    p.set_defaults(_run=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparknet", description="Deep-network training on Apache Spark with PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _load_plugins()
    for name, (help_text, configure) in _SUBCOMMANDS.items():
        configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def _load_plugins() -> None:
    """Import modules that register further subcommands (each optional part registers its own)."""
    import importlib

    for module in ("sparknet.caffe.cli", "sparknet.tools", "sparknet.experiments.cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module and not module.startswith(str(e.name)):
                raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(getattr(args, "verbose", False), getattr(args, "quiet", False))
    try:
        with warnings.catch_warnings():
            _quiet_warnings()
            return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    except Exception as e:
        from sparknet.errors import SparkNetError

        if isinstance(e, SparkNetError):
            log.error("%s", e)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
