"""Names a package resolves on first use (PEP 562), so that importing it (and the command line's
``--help``) loads no torch, Triton or model code."""
from __future__ import annotations

import importlib

__all__ = ["lazy_exports"]


def lazy_exports(package: str, table: dict, namespace: dict):
    """``(__getattr__, __dir__)`` for ``package``: a name in ``table`` (name -> relative module)
    is imported on first access and cached in ``namespace`` (the package's globals); any other
    name raises AttributeError."""
    def __getattr__(name):
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
