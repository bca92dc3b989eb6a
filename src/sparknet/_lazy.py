"""Names of a package imported when first asked for: a package that lists its API in ``__init__`` without loading
what the API needs (torch), so that the ``sparknet`` command reads its flags, and starts Spark, first."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str | None]) -> tuple[Callable[[str], object], Callable[[], list]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``, whose name N is ``exports[N]``'s attribute N (a
    module name; ``"module:name"`` for another name there), or the submodule ``package.N`` itself where that is
    ``None``; each imported once, when first asked for."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if exports[name] is None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            module, _, attribute = exports[name].partition(":")
            value = getattr(importlib.import_module(module), attribute or name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
