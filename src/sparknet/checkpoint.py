"""Checkpoints: written manifest last, kept in a rotation, read back exactly.

A checkpoint is a folder ``ckpt-RRRRRRRR`` (the round) holding

- ``weights.safetensors`` — the global weights (a :class:`WeightCollection`);
- ``state.pt`` — solver, strategy, RNG and data-position state: tensors, numbers, strings,
  lists and dicts only, read back with ``torch.load(weights_only=True)`` so no arbitrary
  object is ever unpickled;
- ``manifest.json`` — format version, round, steps, the model's fingerprint (layer names
  and shapes), the run configuration, and a SHA-256 of the two other files.

The files are written in place, the manifest last: a folder without a manifest (a save
that stopped part way) is incomplete, is never listed, and is deleted by the rotation, so a
reader never sees half a checkpoint. Object stores, which cannot rename a folder, work the
same way as a local disk. The newest ``keep`` are kept. A local path, ``file://``,
``s3://`` (``s3a://``, ``s3n://``), ``gs://``, ``hdfs://`` or another scheme pyarrow can
write is accepted (:func:`sparknet._fs.filesystem`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pyarrow import fs as pafs

from sparknet._fs import filesystem
from sparknet.config import check_at_least
from sparknet.model_io import _quietly_delete, _sha256, _write_folder
from sparknet.weights import WeightCollection

__all__ = ["Checkpoint", "CheckpointManager", "model_fingerprint", "CheckpointError"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or belongs to another model."""


class _Damaged(CheckpointError):
    """A checkpoint's files are missing or fail their SHA-256: an older one may still load."""


def model_fingerprint(weights: WeightCollection) -> str:
    """A short hash of layer names, tensor shapes and dtypes: equal for the same architecture."""
    h = hashlib.sha256()
    for name, i, t in weights.tensors():
        h.update(f"{name}/{i}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


@dataclass
class Checkpoint:
    """What :meth:`CheckpointManager.load` returns."""

    round: int
    weights: WeightCollection
    state: dict
    manifest: dict
    path: str


class CheckpointManager:
    """Saves and finds checkpoints under one folder or URI.

    Parameters
    ----------
    uri : str
        A local folder or a filesystem URI.
    keep : int
        How many of the newest checkpoints to keep (older ones are deleted after a save).
    """

    def __init__(self, uri: str, keep: int = 3):
        check_at_least(1, keep=keep)
        self.uri = str(uri)
        self.keep = int(keep)
        try:
            self.fs, self.root = filesystem(self.uri)
        except (ValueError, OSError) as e:
            raise CheckpointError(f"cannot use {self.uri} as --checkpoint-dir: {str(e).splitlines()[0]}") from None
        try:
            self.fs.create_dir(self.root, recursive=True)
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint folder {self.uri}: {e}; choose a writable "
                                  "--checkpoint-dir") from None

    def check_writable(self) -> None:
        """Fail now, before training, if the folder cannot be written."""
        probe = f"{self.root}/.write-test-{uuid.uuid4().hex[:8]}"
        try:
            with self.fs.open_output_stream(probe) as f:
                f.write(b"ok")
            self.fs.delete_file(probe)
        except OSError as e:
            raise CheckpointError(f"the checkpoint folder {self.uri} is not writable ({e}); choose another "
                                  "--checkpoint-dir or fix its permissions") from None

    # -- writing ------------------------------------------------------------------------------
    def save(self, round: int, weights: WeightCollection, state: dict | None = None, *,
             config: dict | None = None, extra: dict | None = None) -> str:
        """Write the checkpoint of ``round`` (the manifest last, which makes it complete); returns its path."""
        if round < 0:
            raise ValueError(f"round must be non-negative, got {round}")
        buf = io.BytesIO()
        torch.save(_plain(state or {}), buf)
        files = {"weights.safetensors": weights.to_bytes(), "state.pt": buf.getvalue()}
        manifest = {
            "format": "sparknet-checkpoint", "format_version": FORMAT_VERSION, "round": int(round),
            "time": time.time(), "fingerprint": model_fingerprint(weights), "numel": weights.numel,
            "config": config or {}, "extra": extra or {},
            "sha256": {name: _sha256(data) for name, data in files.items()},
        }
        files["manifest.json"] = json.dumps(manifest, indent=1, default=str).encode()
        final = f"{self.root}/ckpt-{round:08d}"
        try:
            if self.fs.get_file_info(final).type != pafs.FileType.NotFound:
                self.fs.delete_dir(final)  # an older save of this round goes first, its manifest with it
            _write_folder(self.fs, final, files, list(files), final)
        except OSError as e:
            _quietly_delete(self.fs, final, "a checkpoint whose save failed")
            raise CheckpointError(f"could not write checkpoint {final}: {e}") from None
        log.info("checkpoint of round %d written to %s", round, final)
        self._rotate()
        return final

    def _rotate(self) -> None:
        complete, incomplete = self._scan()
        for r in complete[:-self.keep] + incomplete:
            _quietly_delete(self.fs, f"{self.root}/ckpt-{r:08d}", "an old or incomplete checkpoint")

    # -- reading ------------------------------------------------------------------------------
    def rounds(self) -> list[int]:
        """Rounds of the complete checkpoints present (their manifest and the files it lists), oldest first."""
        return self._scan()[0]

    def _scan(self) -> tuple[list[int], list[int]]:
        """The rounds of the complete checkpoints and of the incomplete ones, each oldest first.

        A folder that cannot be read now (a network error) is in neither list: it is neither
        loaded nor deleted.
        """
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except OSError:
            return [], []
        complete, incomplete = [], []
        for info in infos:
            m = _NAME.match(info.base_name)
            if not m or info.type != pafs.FileType.Directory:
                continue
            try:
                problem = self._incomplete(info.path)
            except OSError as e:
                log.warning("cannot read checkpoint %s now (%s); leaving it out", info.path, e)
                continue
            if problem:
                log.warning("skipping incomplete checkpoint %s: %s", info.path, problem)
            (incomplete if problem else complete).append(int(m.group(1)))
        return sorted(complete), sorted(incomplete)

    def _incomplete(self, path: str) -> str | None:
        """Why the checkpoint folder ``path`` is incomplete, or None."""
        names = {info.base_name for info in self.fs.get_file_info(pafs.FileSelector(path))}
        if "manifest.json" not in names:
            return "no manifest.json (its save stopped before the end)"
        with self.fs.open_input_stream(f"{path}/manifest.json") as f:
            data = f.read()
        try:
            listed = json.loads(data)["sha256"]
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deep to read
            listed = None
        if not isinstance(listed, dict):
            return "manifest.json is cut short or not a checkpoint manifest"
        missing = [name for name in listed if name not in names]
        return f"{', '.join(missing)} missing" if missing else None

    def latest(self) -> int | None:
        """The newest checkpoint's round, or None."""
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def load(self, round: int | None = None, *, expect_fingerprint: str | None = None) -> Checkpoint:
        """Read a checkpoint, verifying hashes and, if given, the model.

        By default the newest complete one whose files match their SHA-256; a damaged one is
        skipped with a warning and the one before it is read.
        """
        if round is not None:
            return self._load(round, expect_fingerprint)
        damaged = []
        for r in reversed(self.rounds()):
            try:
                return self._load(r, expect_fingerprint)
            except _Damaged as e:
                log.warning("%s; trying the checkpoint before it", e)
                damaged.append(str(e))
        raise CheckpointError(f"no checkpoint in {self.uri} to resume from"
                              + (f" ({'; '.join(damaged)})" if damaged else ""))

    def _load(self, round: int, expect_fingerprint: str | None) -> Checkpoint:
        path = f"{self.root}/ckpt-{round:08d}"
        try:
            files = {}
            for name in ("manifest.json", "weights.safetensors", "state.pt"):
                with self.fs.open_input_stream(f"{path}/{name}") as f:
                    files[name] = f.read()
        except OSError as e:
            raise _Damaged(f"checkpoint {path} is incomplete: {e}") from None
        try:
            manifest = json.loads(files["manifest.json"])
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested too deep to read
            raise _Damaged(f"{path}/manifest.json is not JSON ({e})") from None
        if (not isinstance(manifest, dict) or manifest.get("format") != "sparknet-checkpoint"
                or manifest.get("format_version") != FORMAT_VERSION):
            raise CheckpointError(f"{path} is not a sparknet checkpoint of format {FORMAT_VERSION}")
        _check_manifest(manifest, round, path)
        for name in _HASHED:
            if _sha256(files[name]) != manifest["sha256"][name]:
                raise _Damaged(f"{path}/{name} does not match its recorded SHA-256: the file is corrupt")
        if expect_fingerprint is not None and manifest["fingerprint"] != expect_fingerprint:
            raise CheckpointError(f"checkpoint {path} belongs to another model (fingerprint {manifest['fingerprint']}, "
                                  f"this model's is {expect_fingerprint}); resume with the same --model, or choose "
                                  "another --checkpoint-dir")
        try:
            weights = WeightCollection.from_bytes(files["weights.safetensors"])
        except ValueError as e:
            raise _Damaged(f"{path}/weights.safetensors cannot be read: {e}") from None
        if model_fingerprint(weights) != manifest["fingerprint"]:
            raise _Damaged(f"{path}/weights.safetensors holds another model (fingerprint {model_fingerprint(weights)}) "
                           f"than its manifest records ({manifest['fingerprint']}): the checkpoint is corrupt")
        try:
            state = torch.load(io.BytesIO(files["state.pt"]), weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch's restricted unpickler fails on a bad file with a dozen types
            raise _Damaged(f"{path}/state.pt cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(state, dict):
            raise _Damaged(f"{path}/state.pt holds a {type(state).__name__}, not a checkpoint's state (a dict)")
        return Checkpoint(round=round, weights=weights, state=state, manifest=manifest, path=path)


_HASHED = ("weights.safetensors", "state.pt")
"""The files a manifest records the SHA-256 of."""


def _check_manifest(manifest: dict, round: int, path: str) -> None:
    """Raise :class:`_Damaged` naming the first entry of a parsed manifest that is missing or of the wrong type."""
    def damaged(problem: str) -> _Damaged:
        return _Damaged(f"{path}/manifest.json {problem}: the checkpoint is corrupt")

    sums = manifest.get("sha256")
    if not isinstance(sums, dict) or sorted(sums) != sorted(_HASHED):
        raise damaged(f"records SHA-256 sums for {sorted(sums) if isinstance(sums, dict) else sums!r}, not for "
                      f"{' and '.join(_HASHED)}")
    if not all(isinstance(digest, str) for digest in sums.values()):
        raise damaged("records a SHA-256 sum that is not a string")
    if type(manifest.get("round")) is not int or manifest["round"] != round:
        raise damaged(f"records round {manifest.get('round')!r} in the folder of round {round}")
    if not isinstance(manifest.get("fingerprint"), str):
        raise damaged(f"records the fingerprint {manifest.get('fingerprint')!r}, not a string")
    for key in ("config", "extra"):
        if not isinstance(manifest.get(key, {}), dict):
            raise damaged(f"records a {key} that is not a JSON object ({type(manifest[key]).__name__})")


def _plain(value: Any):
    """Keep what ``torch.load(weights_only=True)`` accepts; turn enums and tuples into plain values."""
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, int) else k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "value") and hasattr(type(value), "__members__"):
        return value.value
    raise TypeError(f"checkpoint state holds a {type(value).__name__}; only tensors, numbers, strings, lists and "
                    "dicts are stored")


class RoundCheckpoints:
    """A fit's checkpoint folder: when to write, and the run's settings recorded beside the state."""

    def __init__(self, folder: str, *, every: int, keep: int, config: dict):
        self.every = every
        self.manager = CheckpointManager(folder, keep=keep)
        self.manager.check_writable()
        self.config = config
        self.written: list[int] = []

    def resume(self, weights: WeightCollection) -> Checkpoint | None:
        """The newest checkpoint, checked to be of the model of ``weights``; None (with a warning) if there is none."""
        if self.manager.latest() is None:
            log.warning("--resume: no checkpoint in %s yet; starting from the beginning", self.manager.uri)
            return None
        return self.manager.load(expect_fingerprint=model_fingerprint(weights))

    def due(self, rounds_done: int) -> bool:
        return rounds_done % self.every == 0

    def save(self, rounds_done: int, weights: WeightCollection, state: dict) -> str:
        path = self.manager.save(rounds_done, weights, state, config=self.config)
        self.written.append(rounds_done)
        return path


def open_checkpoints(dist, config: dict, net) -> tuple[RoundCheckpoints | None, Checkpoint | None]:
    """``dist``'s checkpoint folder, checked writable (None if it names none), and, with ``dist.resume``, its newest
    checkpoint, checked to be of ``net``'s model (None if there is none yet)."""
    if dist is None or not dist.checkpoint_dir:
        return None, None
    checkpoints = RoundCheckpoints(dist.checkpoint_dir, every=dist.checkpoint_every, keep=dist.checkpoint_keep,
                                   config=config)
    return checkpoints, checkpoints.resume(net.get_weights()) if dist.resume else None


def rng_state() -> dict:
    """Python's, numpy's and torch's global generator states (for a checkpoint)."""
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "numpy_pos": int(np_state[2]), "python": list(random.getstate()[1]),
            "python_version": random.getstate()[0]}


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"]))
    random.setstate((state["python_version"], tuple(state["python"]), None))
