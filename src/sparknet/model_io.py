"""Saving a trained model to a folder and reading it back.

A sparknet model folder holds::

    sparknet_model.json     the manifest: format name and version, what each file is, checksums
    net.json                the net definition, ``NetParams.to_dict()``   (layer-DSL nets)
    module.pt               a pickled ``torch.nn.Module``                  (plain modules only)
    weights.safetensors     the weights, ``WeightCollection.save``
    solver.json             the solver it was trained with, ``SolverConfig.to_dict()`` (optional)
    config.json             the run configuration, any JSON object (optional)

A layer-DSL net is stored as data (JSON plus safetensors) and loads without running any
code from the file. A plain ``torch.nn.Module`` can only be stored by pickling it: such a
folder is for **trusted files only** (unpickling runs code named in the file), and
:func:`load_model` refuses it unless called with ``allow_pickle=True``.

The same content travels as a mapping of file name to bytes (:func:`pack_model`,
:func:`unpack_model`): that is what a Spark ML model broadcasts to its executors and
stores beside its metadata, so a model never crosses the wire as a pickled torch object.

A folder may be a local path or a URI that :func:`sparknet._fs.filesystem` accepts
(``s3://``, ``s3a://``, ``gs://``, ``hdfs://``...). Its files are written in place with the
manifest last, so a folder whose save stopped part way has no manifest and does not load.

Examples
--------
>>> save_model("out/lenet", net)                       # doctest: +SKIP
>>> loaded = load_model("out/lenet")                   # doctest: +SKIP
>>> loaded.predict(x).argmax(1)                        # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import pickle
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pyarrow import fs as pafs

from sparknet._fs import filesystem
from sparknet.layers import NetParams
from sparknet.metrics import json_safe
from sparknet.net import Net
from sparknet.solvers import SolverConfig
from sparknet.weights import WeightCollection

__all__ = ["MANIFEST_NAME", "FORMAT_NAME", "FORMAT_VERSION", "SavedModel", "pack_model", "unpack_model", "save_model",
           "load_model", "read_model_files", "write_model_files", "model_id", "input_shape_of"]

log = logging.getLogger(__name__)

MANIFEST_NAME = "sparknet_model.json"
"""Name of the manifest file inside a model folder."""
FORMAT_NAME = "sparknet.model"
"""The manifest's ``format`` value."""
FORMAT_VERSION = 1
"""The newest format version this code writes and reads."""

_NET_JSON = "net.json"
_MODULE_PICKLE = "module.pt"
_WEIGHTS = "weights.safetensors"
_SOLVER = "solver.json"
_CONFIG = "config.json"
_KINDS = ("netparams", "module")
_LISTED = ("net", "weights", "solver", "config")  # the manifest's entries that name a file of the folder
_FILES = {MANIFEST_NAME, _NET_JSON, _MODULE_PICKLE, _WEIGHTS, _SOLVER, _CONFIG}


@dataclass
class SavedModel:
    """A model read back from a folder or from packed files.

    Attributes
    ----------
    net : Net
        A :class:`~sparknet.net.Net` holding the stored weights (in eval mode); its
        ``predict(x)`` returns the logits.
    weights : WeightCollection
        The stored weights (CPU tensors).
    net_params : NetParams or None
        The layer-DSL definition, for nets stored as JSON.
    solver : SolverConfig or None
        The solver the model was trained with, when stored.
    config : dict or None
        The run configuration, when stored.
    input_shape : tuple of int or None
        The shape of one sample the net takes (no batch dimension), when known.
    manifest : dict
        The manifest as read.
    """

    net: Net
    weights: WeightCollection
    net_params: Any = None
    solver: SolverConfig | None = None
    config: dict | None = None
    input_shape: tuple[int, ...] | None = None
    manifest: dict = field(default_factory=dict)

    @property
    def module(self) -> torch.nn.Module:
        """The torch module (weights loaded)."""
        return self.net.module

    @torch.no_grad()
    def predict(self, x) -> torch.Tensor:
        """Logits for a batch of features, each sample reshaped to the net's input: a layer-DSL net's own
        sample shape (``input_shape`` holds as many values: :func:`unpack_model` checks it), else ``input_shape``
        when that is known."""
        t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
        shape = input_shape_of(self.net_params) or self.input_shape
        if shape is not None and tuple(t.shape[1:]) != tuple(shape):
            t = t.reshape(len(t), *shape)
        return self.net.predict(t)


def input_shape_of(net_params) -> tuple[int, ...] | None:
    """The per-sample shape of a layer-DSL net's first input (its batch dimension dropped)."""
    return getattr(net_params, "sample_shape", None)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- packing ---------------------------------------------------------------------------------
def pack_model(net, weights: WeightCollection | None = None, *, solver: SolverConfig | None = None,
               config: Mapping | None = None, input_shape=None,
               metadata: Mapping[str, Any] | None = None) -> dict[str, bytes]:
    """The files of a model folder, as a mapping of file name to bytes.

    Parameters
    ----------
    net : Net, NetParams, GraphModule or torch.nn.Module
        The model. A ``Net`` gives its definition, weights and solver. A NetParams (or a
        GraphModule built from one, which keeps it as ``net_params``) is stored as JSON; any
        other module is pickled (trusted files only).
    weights : WeightCollection, optional
        The weights; required with a NetParams, otherwise taken from the module.
    solver : SolverConfig, optional
        Stored as ``solver.json``.
    config : mapping, optional
        Any JSON-able run configuration, stored as ``config.json``.
    input_shape : sequence of int, optional
        The shape of one sample (no batch dimension); default: from the NetParams' first
        input layer.
    metadata : mapping, optional
        JSON-able extra facts kept in the manifest under ``"metadata"``.

    Returns
    -------
    dict of str to bytes
        ``sparknet_model.json`` and the files it lists.

    Raises
    ------
    TypeError
        A plain module that cannot be pickled, or a configuration or metadata that is not JSON-able.
    ValueError
        A NetParams without ``weights``.
    """
    net_params = module = None
    if isinstance(net, Net):
        net_params, module = net.net_params, net.module
        weights = net.get_weights() if weights is None else weights
        solver = net.solver if solver is None else solver
    elif isinstance(net, NetParams):
        net_params = net
        if weights is None:
            raise ValueError("a NetParams definition carries no weights: pass weights=")
    elif isinstance(net, torch.nn.Module):
        module = net
        net_params = net.net_params if isinstance(getattr(net, "net_params", None), NetParams) else None
    else:
        raise TypeError(f"cannot save a {type(net).__name__}: give a Net, NetParams or torch.nn.Module")
    if weights is None:
        weights = Net(module).get_weights()
    input_shape = input_shape_of(net_params) if input_shape is None else input_shape

    files: dict[str, bytes] = {}
    if net_params is not None:
        files[_NET_JSON] = json.dumps(net_params.to_dict(), indent=1).encode()
    else:
        buf = io.BytesIO()
        try:
            torch.save(module, buf)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # a lambda, a lock or a local class inside it
            raise TypeError(f"cannot save this {type(module).__name__}: it cannot be pickled ({e}); build the net "
                            "from a NetParams (stored as JSON), or keep what cannot be pickled off the "
                            "module") from None
        files[_MODULE_PICKLE] = buf.getvalue()
    files[_WEIGHTS] = weights.to_bytes()
    if solver is not None:
        files[_SOLVER] = json.dumps(solver.to_dict(), indent=1).encode()
    if config is not None:
        files[_CONFIG] = json.dumps(_jsonable(config), indent=1).encode()
    from sparknet import __version__

    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "kind": "module" if net_params is None else "netparams",
        "net": _MODULE_PICKLE if net_params is None else _NET_JSON, "weights": _WEIGHTS,
        "solver": _SOLVER if solver is not None else None, "config": _CONFIG if config is not None else None,
        "input_shape": None if input_shape is None else [int(d) for d in input_shape],
        "num_parameters": int(weights.numel), "torch_version": torch.__version__, "sparknet_version": __version__,
        "sha256": {name: _sha256(data) for name, data in files.items()}, "metadata": _jsonable(dict(metadata or {})),
    }
    files[MANIFEST_NAME] = json.dumps(manifest, indent=1).encode()
    return files


def model_id(files: Mapping[str, bytes]) -> str:
    """A content hash of packed model files (same content, same id)."""
    h = hashlib.sha256()
    for name in sorted(set(files) - {MANIFEST_NAME}):
        h.update(name.encode() + b"\0" + _sha256(files[name]).encode())
    return h.hexdigest()[:32]


def _parse_manifest(data: bytes, where: str) -> dict:
    """The manifest, checked entry by entry: a ``ValueError`` naming ``where`` and the first entry that is wrong."""
    manifest = _json_file(data, MANIFEST_NAME, where)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{where}: {MANIFEST_NAME} is not a sparknet model manifest "
                         f"(expected format {FORMAT_NAME!r})")
    version = manifest.get("format_version")
    if type(version) is not int or version < 1:
        raise ValueError(f"{where}: {MANIFEST_NAME} has no valid format_version (got {version!r})")
    if version > FORMAT_VERSION:
        raise ValueError(f"{where}: the model was written in format version {version} by sparknet "
                         f"{manifest.get('sparknet_version', '?')}; this sparknet reads up to version "
                         f"{FORMAT_VERSION}: upgrade sparknet to load it")
    for key in ("kind", "net", "weights"):
        if key not in manifest:
            raise ValueError(f"{where}: {MANIFEST_NAME} lacks the {key!r} entry; the model folder is corrupt")
    if manifest["kind"] not in _KINDS:
        raise ValueError(f"{where}: unknown model kind {manifest['kind']!r} in {MANIFEST_NAME}")

    def wrong(key: str, what: str):
        return ValueError(f"{where}: {MANIFEST_NAME}'s {key!r} entry is {str(manifest[key])[:80]!r}, not {what}; "
                          "the model folder is corrupt")

    for key in _LISTED:
        name = manifest.get(key)
        if name is None and key in ("solver", "config"):
            continue
        if not isinstance(name, str) or posixpath.basename(name) != name or name in ("", ".", ".."):
            raise wrong(key, "the name of a file in the folder")
    sums = manifest.get("sha256")
    if sums is not None and not (isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values())):
        raise wrong("sha256", "file names and their SHA-256 sums")
    shape = manifest.get("input_shape")
    if shape is not None and not (isinstance(shape, list) and all(type(d) is int and d > 0 for d in shape)):
        raise wrong("input_shape", "a list of positive whole numbers")
    if not isinstance(manifest.get("metadata", {}), dict):
        raise wrong("metadata", "a JSON object")
    return manifest


def _json_file(data: bytes, name: str, where: str):
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested too deep to read
        raise ValueError(f"{where}: {name} is not valid JSON ({e}); the model folder is corrupt") from None


def _shapes(weights: WeightCollection) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(name, i, tuple(t.shape)) for name, i, t in weights.tensors()]


def _definition(files: Mapping[str, bytes], manifest: dict, weights: WeightCollection, where: str):
    """The stored NetParams, checked to build and to fit the stored weights before any tensor is allocated."""
    name = manifest["net"]
    try:
        net_params = NetParams.from_dict(_json_file(files[name], name, where))
        with torch.device("meta"):  # shapes only: a definition of 10**12 outputs costs nothing before it is refused
            wanted = WeightCollection(net_params.build(seed=0).layer_weights())
    except ValueError as e:
        raise ValueError(f"{where}: cannot read the net definition {name}: {e}") from e
    except (TypeError, KeyError, AttributeError, RuntimeError, RecursionError) as e:  # a value of the wrong type
        raise ValueError(f"{where}: cannot read the net definition {name}: {type(e).__name__}: {e}") from None
    if _shapes(wanted) != _shapes(weights):
        diff = next(((a, b) for a, b in zip(_shapes(wanted), _shapes(weights)) if a != b), None)
        detail = (f"the net's {diff[0]} against the file's {diff[1]}" if diff else
                  f"{len(_shapes(wanted))} tensors in the net, {len(_shapes(weights))} in the file")
        raise ValueError(f"{where}: {manifest['weights']} does not fit the net of {name} ({detail}); "
                         "the model folder is corrupt")
    shape, own = manifest.get("input_shape"), net_params.sample_shape
    if shape is not None and own is not None and math.prod(shape) != math.prod(own):
        raise ValueError(f"{where}: {MANIFEST_NAME}'s input_shape {shape} does not fit the net's input "
                         f"{list(own)}; the model folder is corrupt")
    return net_params


def unpack_model(files: Mapping[str, bytes], *, device: str | torch.device = "cpu", allow_pickle: bool = False,
                 where: str = "model") -> SavedModel:
    """Build the model that :func:`pack_model` packed.

    Parameters
    ----------
    files : mapping of str to bytes
        The packed files.
    device : str or torch.device
        Where the net lives.
    allow_pickle : bool
        Let a pickled plain ``torch.nn.Module`` load. Unpickling runs code named in the
        file: only for files you trust.
    where : str
        Names the source in error messages.

    Raises
    ------
    ValueError
        Naming ``where``: a manifest, file or checksum missing or wrong, weights that do not fit the net, a newer
        format version, or a pickled module without ``allow_pickle``.
    """
    if MANIFEST_NAME not in files:
        raise ValueError(f"{where}: no {MANIFEST_NAME}; not a sparknet model folder")
    manifest = _parse_manifest(files[MANIFEST_NAME], where)
    sums = manifest.get("sha256") or {}
    for name in filter(None, map(manifest.get, _LISTED)):
        if name not in files:
            raise ValueError(f"{where}: {name} is listed in {MANIFEST_NAME} but missing")
        if name in sums and _sha256(files[name]) != sums[name]:
            raise ValueError(f"{where}: {name} does not match its checksum; the file is corrupt")

    try:
        weights = WeightCollection.from_bytes(files[manifest["weights"]])
    except ValueError as e:
        raise ValueError(f"{where}: cannot read {manifest['weights']}: {e}") from None
    net_params = None
    if manifest["kind"] == "netparams":
        net_params = _definition(files, manifest, weights, where)
        net = Net(net_params, device=device)
    else:
        if not allow_pickle:
            raise ValueError(f"{where}: this model is a pickled torch module ({manifest['net']}); loading it "
                             "runs code from the file. Pass allow_pickle=True only if you trust it.")
        module = torch.load(io.BytesIO(files[manifest["net"]]), map_location="cpu", weights_only=False)
        net = Net(module, device=device)
    net.set_weights(weights)
    net.module.eval()
    solver = None
    if manifest.get("solver"):
        try:
            solver = SolverConfig.from_dict(_json_file(files[manifest["solver"]], manifest["solver"], where))
        except (ValueError, TypeError, AttributeError) as e:  # a setting missing, unknown or of the wrong type
            raise ValueError(f"{where}: cannot read the solver {manifest['solver']}: {e}") from None
    config = _json_file(files[manifest["config"]], manifest["config"], where) if manifest.get("config") else None
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"{where}: {manifest['config']} holds a {type(config).__name__}, not a configuration "
                         "(a JSON object); the model folder is corrupt")
    shape = manifest.get("input_shape")
    return SavedModel(net=net, weights=weights, net_params=net_params, solver=solver, config=config,
                      input_shape=None if shape is None else tuple(shape), manifest=manifest)


def input_columns(saved: SavedModel) -> list[dict] | None:
    """The columns of the table a model trained on, in order, each ``{"name", "kind"}`` (a number or an array a row:
    :func:`sparknet._parquet.feature_column`), as its metadata keeps them; ``None`` where it does not say."""
    return (saved.manifest.get("metadata") or {}).get("features") or None


# -- folders ---------------------------------------------------------------------------------
def write_model_files(path: str | os.PathLike, files: Mapping[str, bytes], *,
                      overwrite: bool = False) -> Path | str:
    """Write packed files as a model folder, the manifest last.

    With ``overwrite``, a folder holding a manifest, or only model files (a save that stopped
    part way), is replaced; any other folder is left alone. The new model is written whole
    beside it first (``<folder>.saving-<id>``) and only then takes its place: on a local disk by
    two renames (the old folder moved aside, then deleted), on an object store, which cannot
    rename a folder, by deleting the old objects and copying the new ones in, the manifest last.
    A save that fails before the swap leaves the old model as it was; one that fails in an object
    store's copy says where the new model lies whole. Returns the folder: a ``Path`` when it is
    local, else the URI as given. A new folder whose write fails (``OSError``) is deleted before
    the error is raised; a save killed part way leaves a folder without a manifest, which does not
    load.
    """
    fs, root = filesystem(path)
    info = fs.get_file_info(root)
    replace = info.type != pafs.FileType.NotFound
    if replace:
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        if info.type != pafs.FileType.Directory:
            raise ValueError(f"{path} exists and is not a folder; not overwriting it")
        names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(root))}
        if MANIFEST_NAME not in names and not names <= _FILES:
            raise ValueError(f"{path} exists and is not a sparknet model folder; not overwriting it")
    order = [n for n in files if n != MANIFEST_NAME] + [MANIFEST_NAME]  # a folder loads once its manifest is there
    target = f"{root}.saving-{os.urandom(4).hex()}" if replace else root
    _write_folder(fs, target, files, order, str(path))
    if replace:
        _swap_in(fs, target, root, order, str(path))
    log.info("saved model to %s", path)
    return Path(root) if isinstance(fs, pafs.LocalFileSystem) else os.fspath(path)


def _write_folder(fs, folder: str, files: Mapping[str, bytes], order: list[str], path: str) -> None:
    """``files`` into a new ``folder`` in ``order`` (the manifest last); the folder is deleted if a write fails."""
    fs.create_dir(folder, recursive=True)
    try:
        for name in order:
            with fs.open_output_stream(f"{folder}/{name}") as f:
                f.write(files[name])
    except OSError:
        _quietly_delete(fs, folder, f"the save of {path} failed: it is incomplete and does not load")
        raise


def _swap_in(fs, saved: str, root: str, names: list[str], path: str) -> None:
    """The whole new model in ``saved`` takes the place of the old one in ``root``."""
    if fs.type_name == "local":
        aside = f"{root}.replaced-{os.urandom(4).hex()}"
        try:
            fs.move(root, aside)
        except OSError:
            _quietly_delete(fs, saved)
            raise
        try:
            fs.move(saved, root)
        except OSError:
            try:
                fs.move(aside, root)
            except OSError:
                log.error("the old model of %s is at %s and the new one at %s: the swap failed half way", path,
                          aside, saved)
                raise
            _quietly_delete(fs, saved)
            raise
        _quietly_delete(fs, aside)
        return
    try:  # an object store: no folder renames; the old objects go, the new ones are copied in, the manifest last
        fs.delete_dir(root)
        for name in names:
            fs.copy_file(f"{saved}/{name}", f"{root}/{name}")
    except OSError as exc:
        raise OSError(f"could not put the new model in place of the old one at {path} ({exc}); the new model is "
                      f"whole at {saved}") from exc
    _quietly_delete(fs, saved)


def _quietly_delete(fs, folder: str, why: str = "left from a model save") -> None:
    """Delete ``folder`` if it is there; a failure is a warning saying ``why`` it would have gone."""
    try:
        if fs.get_file_info(folder).type != pafs.FileType.NotFound:
            fs.delete_dir(folder)
    except OSError:
        log.warning("could not delete %s (%s); delete it by hand", folder, why)


def read_model_files(path: str | os.PathLike) -> dict[str, bytes]:
    """The files of a model folder (the manifest and what it lists), as name to bytes."""
    fs, root = filesystem(path)

    def read(name: str) -> bytes:
        try:
            with fs.open_input_stream(f"{root}/{name}") as f:
                return f.read()
        except OSError:
            if name == MANIFEST_NAME:
                raise ValueError(f"{path}: no {MANIFEST_NAME}; not a sparknet model folder") from None
            raise ValueError(f"{path}: {name} is listed in {MANIFEST_NAME} but missing") from None

    data = read(MANIFEST_NAME)
    manifest = _parse_manifest(data, str(path))  # its file names are names of files in the folder
    return {MANIFEST_NAME: data, **{name: read(name) for name in filter(None, map(manifest.get, _LISTED))}}


def save_model(path: str | os.PathLike, net, weights: WeightCollection | None = None, *,
               solver: SolverConfig | None = None, config: Mapping | None = None, input_shape=None,
               metadata: Mapping[str, Any] | None = None, overwrite: bool = False) -> Path | str:
    """Save a model to a folder or URI (:func:`write_model_files`); see :func:`pack_model` for the arguments."""
    files = pack_model(net, weights, solver=solver, config=config, input_shape=input_shape, metadata=metadata)
    return write_model_files(path, files, overwrite=overwrite)


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu",
               allow_pickle: bool = False) -> SavedModel:
    """Load a model folder (a path or URI) written by :func:`save_model`; see :func:`unpack_model`."""
    return unpack_model(read_model_files(path), device=device, allow_pickle=allow_pickle, where=str(path))


def _jsonable(obj):
    """``obj`` as plain JSON (:func:`~sparknet.metrics.json_safe`, NaN and infinity kept), checked."""
    out = json_safe(obj, finite=False)
    try:
        json.dumps(out)
    except TypeError as e:
        raise TypeError(f"model config and metadata must be JSON-able: {e}") from None
    return out
