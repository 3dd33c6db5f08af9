"""A package's names, imported where they live on first use (PEP 562's module __getattr__):
importing the package, or a light module of it, then loads nothing heavy (nor torch)."""

from __future__ import annotations

import importlib


def lazy_names(package: str, homes: dict[str, str]):
    """The module __getattr__ of `package`: each name of `homes` read from its module."""

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    return __getattr__
