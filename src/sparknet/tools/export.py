"""Export a trained net for serving outside Spark: ONNX and TorchScript.

``sparknet export --model-dir DIR --format onnx --out model.onnx`` reads a sparknet model
folder (:mod:`sparknet.model_io`) and writes one file that needs neither sparknet nor Spark
to run: an ONNX model (ONNX Runtime, or any ONNX backend) or a TorchScript archive
(``torch.jit.load``). Both take a batch of samples in the net's input shape, with any batch
size, and return the logits (the blob feeding the loss; apply a softmax for probabilities).

ONNX goes through :func:`torch.onnx.export`, which has two exporters in torch 2.13:

- ``"torchscript"`` (sparknet's default): the TorchScript-based exporter (``dynamo=False``).
  It needs nothing beyond torch, exports the layer DSL's nets (convolutions, pooling, LRN,
  batch norm, LSTMs) in about a second, and is what the tests check. torch marks it
  deprecated; torch is pinned, so it stays available.
- ``"dynamo"``: the ``torch.export``-based exporter, torch's own default, which needs the
  ``onnxscript`` package and takes about ten times as long on this kind of net.

Examples
--------
>>> from sparknet import zoo
>>> module = zoo.lenet().build(seed=0).eval()
>>> export_onnx(module, torch.zeros(2, 1, 28, 28), "lenet.onnx")          # doctest: +SKIP
>>> max_abs_diff = verify_onnx("lenet.onnx", module, torch.rand(5, 1, 28, 28))  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sparknet._enums import parse_enum

if TYPE_CHECKING:
    import torch

__all__ = ["ExportFormat", "export_onnx", "export_torchscript", "export_model", "verify_onnx", "example_input_for"]

log = logging.getLogger(__name__)

INPUT_NAME = "input"
"""Name of the exported graph's input."""
OUTPUT_NAME = "logits"
"""Name of the exported graph's output."""


class ExportFormat(str, enum.Enum):
    """What ``sparknet export`` writes."""

    ONNX = "onnx"
    """An ONNX model (``.onnx``)."""
    TORCHSCRIPT = "torchscript"
    """A TorchScript archive (``.pt``), for ``torch.jit.load``."""


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The module in eval mode (dropout off, batch norm on running statistics), restored after."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def _as_batch(example_input) -> torch.Tensor:
    import torch

    x = torch.as_tensor(example_input)
    if x.dim() < 1 or len(x) < 1:
        raise ValueError(f"example_input must be a batch with at least one sample, got shape {tuple(x.shape)}")
    return x


def export_onnx(module: torch.nn.Module, example_input, path: str | os.PathLike, *, opset: int | None = None,
                dynamic_batch: bool = True, exporter: str = "torchscript") -> Path:
    """Write ``module`` as an ONNX model; return the file written.

    Parameters
    ----------
    module : torch.nn.Module
        The net (a :class:`~sparknet.layers.GraphModule` or any module whose ``forward(x)``
        returns the output to serve). Exported in eval mode; its mode is restored after.
    example_input : Tensor or array
        A batch in the net's input shape and dtype (values do not matter). Use a batch of
        two or more: a batch of one can let an exporter fold the batch size into the graph.
    path : path
        The ``.onnx`` file (parent folders are created).
    opset : int, optional
        ONNX opset version (default: the exporter's).
    dynamic_batch : bool
        Leave the batch dimension free (named ``batch``) in the input and the output.
    exporter : {"torchscript", "dynamo"}
        Which of torch's ONNX exporters to use (see the module docstring).
    """
    import torch

    x = _as_batch(example_input)
    if exporter not in ("dynamo", "torchscript"):
        raise ValueError(f"exporter must be torchscript or dynamo, got {exporter!r}")
    if exporter == "dynamo" and importlib.util.find_spec("onnxscript") is None:
        raise ValueError("the dynamo ONNX exporter needs the onnxscript package (pip install onnxscript); "
                         "or use exporter='torchscript'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict = {"input_names": [INPUT_NAME], "output_names": [OUTPUT_NAME], "opset_version": opset,
                    "dynamo": exporter == "dynamo"}
    if exporter == "dynamo":
        kwargs.update(external_data=False, verbose=False)
        if dynamic_batch:
            kwargs["dynamic_shapes"] = ({0: torch.export.Dim("batch")},)
    elif dynamic_batch:
        kwargs["dynamic_axes"] = {INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}}
    with _eval_mode(module), torch.no_grad(), warnings.catch_warnings():
        # torch warns that the TorchScript-based exporter is deprecated; choosing it is deliberate here.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
        warnings.filterwarnings("ignore", message=r".*legacy TorchScript-based ONNX export.*")
        torch.onnx.export(module, (x,), str(path), **kwargs)
    log.info("exported ONNX model (%s exporter) to %s", exporter, path)
    return path


def export_torchscript(module: torch.nn.Module, example_input, path: str | os.PathLike, *,
                       check: bool = True) -> Path:
    """Write ``module`` as a TorchScript archive (traced in eval mode), for ``torch.jit.load``; return the file.

    Parameters
    ----------
    module, example_input, path
        As for :func:`export_onnx` (the file: ``.pt``).
    check : bool
        Have the tracer re-run the trace and compare (catches data-dependent control flow).
    """
    import torch

    x = _as_batch(example_input)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _eval_mode(module), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.trace.* is deprecated.*")
        traced = torch.jit.trace(module, (x,), check_trace=check)
        traced.save(str(path))
    log.info("exported TorchScript model to %s", path)
    return path


def verify_onnx(path: str | os.PathLike, module: torch.nn.Module, inputs, *, atol: float = 1e-5,
                rtol: float = 1e-4) -> float:
    """Check an ONNX file and compare its outputs with the module's; return the largest absolute difference.

    Runs ``onnx.checker.check_model``, then the model on ``inputs`` with ONNX Runtime when it
    is installed, else with ``onnx.reference.ReferenceEvaluator``.

    Raises
    ------
    ValueError
        When the outputs differ by more than ``atol + rtol * |expected|``.
    ImportError
        Without the ``onnx`` package (``pip install 'sparknet[onnx]'``).
    """
    import numpy as np
    import onnx
    import torch

    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    x = _as_batch(inputs)
    with _eval_mode(module), torch.no_grad():
        expected = module(x).detach().cpu().numpy()
    feed = x.cpu().numpy()
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: feed})[0]
    else:
        from onnx.reference import ReferenceEvaluator

        got = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: feed})[0]
    if got.shape != expected.shape:
        raise ValueError(f"the ONNX model gives shape {got.shape}, torch gives {expected.shape}")
    diff = float(np.max(np.abs(got - expected))) if expected.size else 0.0
    if not np.allclose(got, expected, atol=atol, rtol=rtol):
        raise ValueError(f"the ONNX model's outputs differ from torch's by up to {diff:.3g} (atol {atol})")
    return diff


def example_input_for(saved, batch_size: int = 2) -> torch.Tensor:
    """A zero batch in the input shape and dtype of a loaded model folder (``SavedModel``); a ValueError when the
    folder does not record the input shape (a plain module saved without ``input_shape``)."""
    import torch

    shape = saved.input_shape
    if shape is None:
        raise ValueError("the model folder does not record its input shape; save it with input_shape=[...]")
    dtype = next((getattr(layer, "torch_dtype", torch.float32) for layer in getattr(saved.net_params, "layers", ())
                  if getattr(layer, "shape", None)), torch.float32)
    return torch.zeros((batch_size, *shape), dtype=dtype)


def export_model(model_dir: str | os.PathLike, format: ExportFormat | str, out: str | os.PathLike, *,
                 allow_pickle: bool = False, opset: int | None = None, exporter: str = "torchscript",
                 verify: bool = False) -> Path:
    """Export a sparknet model folder to ONNX or TorchScript; return the file written.

    Parameters
    ----------
    model_dir : path
        A folder written by :func:`sparknet.model_io.save_model`.
    format : ExportFormat or str
        ``"onnx"`` or ``"torchscript"``.
    out : path
        The file to write.
    allow_pickle : bool
        Allow a folder holding a pickled plain module (trusted files only).
    opset, exporter
        For ONNX, see :func:`export_onnx`.
    verify : bool
        After writing, compare the exported model's outputs with the net's on a random
        batch (ONNX: :func:`verify_onnx`; TorchScript: ``torch.jit.load`` and an exact
        comparison).
    """
    import torch

    from sparknet import model_io

    fmt = parse_enum(ExportFormat, format, "export format")
    saved = model_io.load_model(model_dir, allow_pickle=allow_pickle)
    module = saved.module
    example = example_input_for(saved)
    if fmt is ExportFormat.ONNX:
        path = export_onnx(module, example, out, opset=opset, exporter=exporter)
    else:
        path = export_torchscript(module, example, out)
    if verify:
        shape = (3, *example.shape[1:])
        batch = (torch.rand(shape, generator=torch.Generator().manual_seed(0), dtype=example.dtype)
                 if example.dtype.is_floating_point else torch.zeros(shape, dtype=example.dtype))
        if fmt is ExportFormat.ONNX:
            diff = verify_onnx(path, module, batch)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*torch\.jit\.load.* is deprecated.*")
                loaded = torch.jit.load(str(path))
            with _eval_mode(module), torch.no_grad():
                expected, got = module(batch), loaded(batch)
            diff = float((expected - got).abs().max())
            if not torch.equal(expected, got):
                raise ValueError(f"the TorchScript model's outputs differ from the net's by up to {diff:.3g}")
        log.info("verified %s: largest difference from the net's outputs %.3g", path, diff)
    return path


def configure_command(p: argparse.ArgumentParser) -> None:
    """The arguments of ``sparknet export`` (``sparknet.cli`` lists the command)."""
    p.add_argument("--model-dir", required=True, help="sparknet model folder (as 'sparknet train' saves it)")
    p.add_argument("--format", required=True, choices=[f.value for f in ExportFormat], help="what to write")
    p.add_argument("--out", required=True, help="file to write (.onnx or .pt)")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset version (default: the exporter's)")
    p.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript",
                   help="torch's ONNX exporter (default torchscript; dynamo needs the onnxscript package)")
    p.add_argument("--verify", action="store_true",
                   help="compare the exported model's outputs with the net's (ONNX needs the onnx package)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow a model folder holding a pickled torch module (trusted files only)")
    p.set_defaults(_run=_run)


def _run(args: argparse.Namespace) -> int:
    if not Path(args.model_dir).is_dir():
        raise FileNotFoundError(f"no model folder at {args.model_dir}")
    path = export_model(args.model_dir, args.format, args.out, allow_pickle=args.allow_pickle, opset=args.opset,
                        exporter=args.exporter, verify=args.verify)
    print(path)
    return 0
