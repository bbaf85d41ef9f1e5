"""Public names of a package, imported from their submodules on first use (PEP 562)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``name`` from submodule ``exports[name]``, kept in
    the package's ``namespace`` once imported; AttributeError for any other name."""
    def getattr_(name: str) -> Any:
        mod = exports.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{mod}", package), name)
        namespace[name] = value
        return value
    return getattr_
