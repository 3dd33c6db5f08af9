"""Model sources, specs and architectures; `build_model` turns loaded weights into a module.

Names resolve on first use: reading a model's spec and tokenizer (`load(..., weights=False)`,
as the server's API process does) imports neither torch nor the modules built on it.
"""

from __future__ import annotations

_HOMES = {
    "load": "tokenworks.models.loader",
    "LoadedModel": "tokenworks.models.loaded",
    "ModelLoadError": "tokenworks.models.loaded",
    "ModelSpec": "tokenworks.models.spec",
    "build_model": "tokenworks.models.build",
    "MODULES": "tokenworks.models.build",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)


__all__ = list(_HOMES)
