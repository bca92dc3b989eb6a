"""Parsing sparknet's string enums from any case, with a clear error."""

from __future__ import annotations

import enum

__all__ = ["parse_enum"]


def parse_enum(cls: type[enum.Enum], value, what: str):
    """Accept an enum member or its value in any case; a clear ``ValueError`` otherwise."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; choose one of {[m.value for m in cls]}") from None
