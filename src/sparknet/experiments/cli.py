"""``sparknet experiment NAME [--quick] [--out DIR] [options]``: the paper's experiments.

Each experiment's options are generated from the fields of its ``Config`` dataclass (the
docstring under a field is its help); an option not given keeps the default of the mode
(full, or ``--quick``). ``sparknet experiment all`` runs every experiment in order into one
folder, so ``speedup-vs-overhead`` reads the grid that ``speedup-grid`` just wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import typing

from sparknet._fields import base_type, field_docs
from sparknet.experiments import DEFAULT_OUT, EXPERIMENTS, get_experiment, run_experiment

__all__ = ["add_config_arguments", "config_overrides", "configure_command"]

log = logging.getLogger(__name__)


def add_config_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One ``--flag`` per field of ``cls``, every default ``None`` (= the mode's default)."""
    group = parser.add_argument_group("options (default: the full or --quick setting)")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp, _ = base_type(hints[f.name])  # tuple[int, ...] | None: int, nargs="+"
        is_tuple = typing.get_origin(tp) is tuple
        if is_tuple:
            tp = next((a for a in typing.get_args(tp) if a is not Ellipsis), str)
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{docs.get(f.name, '')} (full default: {default})"
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif is_tuple:
            group.add_argument(flag, type=tp, nargs="+", default=None, help=help_text)
        else:
            group.add_argument(flag, type=tp, default=None, help=help_text)


def config_overrides(args: argparse.Namespace, cls) -> dict:
    """The config fields the user gave on the command line."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in vars(args).items()
            if k in names and v is not None}


def _run(args: argparse.Namespace) -> int:
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    failed = []
    for name in names:
        overrides = config_overrides(args, get_experiment(name).Config) if args.experiment != "all" else {}
        try:
            result = run_experiment(name, quick=args.quick, out=args.out, tag=getattr(args, "tag", None), **overrides)
        except Exception as exc:
            if args.experiment != "all":
                raise
            log.error("experiment %s failed: %s: %s", name, type(exc).__name__, exc)
            failed.append(name)
            continue
        print(json.dumps({"experiment": name, "json": result.get("json_path"), "png": result.get("png_path"),
                          "wall_s": round(result["wall_s"], 1), "summary": result.get("summary")}))
    return 1 if failed else 0


def configure_command(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``sparknet experiment`` (``sparknet.cli`` lists the command)."""
    sub = parser.add_subparsers(dest="experiment", required=True, metavar="NAME")
    for name in (*EXPERIMENTS, "all"):
        doc = ("every experiment in order, into one folder" if name == "all"
               else (get_experiment(name).__doc__ or name).strip())
        p = sub.add_parser(name, help=doc.splitlines()[0], description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--quick", action="store_true", help="the small version (under 3 minutes on a quiet machine)")
        p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
        if name != "all":
            p.add_argument("--tag", default=None,
                           help=f"write {name}-TAG.json and .png, beside the untagged results (default {name}.json)")
            add_config_arguments(p, get_experiment(name).Config)
    parser.set_defaults(_run=_run)
