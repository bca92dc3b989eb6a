"""Reading Caffe text-format files: path-or-text handling and errors that name the file."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from sparknet.errors import GraphError

logger = logging.getLogger(__name__)

__all__ = ["PrototxtError", "read_text", "parse_text"]


class PrototxtError(GraphError):
    """A Caffe file is wrong: a syntax error, an unsupported layer, a bad graph.

    The message starts with the file name (and ``line:column`` for syntax errors), so
    ``str(error)`` alone tells the user where to look.

    Attributes
    ----------
    layer : str or None
        The layer at fault, when the fault is one layer's.
    path : str or None
        The file (``"<text>"`` when the prototxt was given as a string).
    line, column : int or None
        Where a syntax error is, 1-based.
    """

    def __init__(
        self,
        message: str,
        layer: str | None = None,
        path: str | None = None,
        line: int | None = None,
        column: int | None = None,
    ):
        super().__init__(message, layer=layer)
        self.path = path
        self.line = line
        self.column = column

    def __reduce__(self):
        return (type(self), (self.args[0], self.layer, self.path, self.line, self.column))


def read_text(path_or_text: str | os.PathLike) -> tuple[str, Path | None, str]:
    """Return ``(text, path or None, display name)`` for a file path or prototxt text.

    A ``str`` is taken as a path when such a file exists, as text when it contains a
    newline, ``{`` or ``:``; otherwise it is a missing file (``FileNotFoundError``).
    """
    if isinstance(path_or_text, os.PathLike):
        path = Path(path_or_text)
        return path.read_text(encoding="utf-8"), path, str(path)
    if not isinstance(path_or_text, str):
        raise TypeError(f"expected a path or prototxt text, got {type(path_or_text).__name__}")
    looks_like_text = any(c in path_or_text for c in "\n{:") and len(path_or_text) > 0
    if not looks_like_text or (len(path_or_text) < 4096 and os.path.isfile(path_or_text)):
        path = Path(path_or_text)
        if not path.is_file():
            raise FileNotFoundError(f"no such Caffe file: {path_or_text}")
        return path.read_text(encoding="utf-8"), path, str(path)
    return path_or_text, None, "<text>"


def parse_text(text: str, message: Any, name: str) -> Any:
    """Parse protobuf text ``text`` into ``message``; a syntax error names ``name`` and the line."""
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        line = exc.GetLine() if hasattr(exc, "GetLine") else None
        column = exc.GetColumn() if hasattr(exc, "GetColumn") else None
        detail = str(exc)
        # ParseError's text starts with "line:column : "; keep only the explanation.
        if line is not None and detail.startswith(f"{line}:"):
            detail = detail.split(" : ", 1)[-1]
        where = f"{name}:{line}:{column}" if line is not None else name
        raise PrototxtError(f"{where}: syntax error: {detail}", path=name, line=line, column=column) from None
    return message
