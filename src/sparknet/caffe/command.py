"""``sparknet caffe``'s arguments, read with no torch loaded; each subcommand's work is :mod:`sparknet.caffe.cli`'s,
imported when it runs."""

from __future__ import annotations

import argparse
import importlib

from sparknet._fields import OldName

__all__ = ["configure_command"]


def _runner(name: str):
    """The subcommand's runner, :mod:`sparknet.caffe.cli`'s ``name``, imported when the command runs."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module("sparknet.caffe.cli"), name)(args)

    return run


def configure_command(p: argparse.ArgumentParser) -> None:
    """The arguments of ``sparknet caffe`` (``sparknet.cli`` lists the command)."""
    sub = p.add_subparsers(dest="caffe_command", required=True)

    q = sub.add_parser("inspect", help="a net's layers and shapes, a solver's settings, or a .caffemodel's weights",
                       description="Describe a Caffe file: a net prototxt (layers, bottoms, tops, output shapes, "
                                   "parameter counts), a solver prototxt (its settings) or a .caffemodel.")
    q.add_argument("file", help="a net prototxt, a solver prototxt or a .caffemodel")
    q.add_argument("--kind", choices=["auto", "net", "solver", "caffemodel"], default="auto",
                   help="what the file is (default: told from its name and content)")
    q.add_argument("--phase", choices=["TRAIN", "TEST"], default="TRAIN", type=str.upper,
                   help="which phase of a net to show (default TRAIN)")
    q.add_argument("--stage", action="append", default=[], help="a net state stage (repeatable)")
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")
    q.set_defaults(_run=_runner("run_inspect"))

    e = sub.add_parser("export", help="write PREFIX.prototxt and PREFIX.caffemodel from a sparknet model folder")
    e.add_argument("--model-dir", required=True, help="sparknet model folder")
    e.add_argument("--out", required=True, help="output prefix: PREFIX.prototxt and PREFIX.caffemodel are written")
    e.set_defaults(_run=_runner("run_export"))

    i = sub.add_parser("import", help="a sparknet model folder from a Caffe net prototxt and .caffemodel")
    i.add_argument("--prototxt", required=True, help="Caffe net prototxt")
    i.add_argument("--weights", default=None, help=".caffemodel with the weights (default: the fillers' weights)")
    i.add_argument("--solver", default=None, help="solver prototxt to store with the model (optional)")
    i.add_argument("--model-dir", default=None, help="model folder to write")
    i.add_argument("--out", dest="model_dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS, action=OldName)
    i.add_argument("--phase", choices=["TRAIN", "TEST"], default="TRAIN", type=str.upper,
                   help="which phase of the net to keep (default TRAIN)")
    i.add_argument("--seed", type=int, default=0, help="seed of the filler weights when no --weights is given")
    i.add_argument("--overwrite", action="store_true", help="replace an existing model folder")
    i.set_defaults(_run=_runner("run_import"))
