"""Model sources, specs and architectures; `build_model` turns loaded weights into a module.

Names resolve on first use: reading a model's spec and tokenizer (`load(..., weights=False)`,
as the server's API process does) imports neither torch nor the modules built on it.
"""

from __future__ import annotations

from tokenworks.lazy import lazy_names

_HOMES = {
    "load": "tokenworks.models.loader",
    "LoadedModel": "tokenworks.models.loaded",
    "ModelLoadError": "tokenworks.models.loaded",
    "ModelSpec": "tokenworks.models.spec",
    "build_model": "tokenworks.models.build",
    "MODULES": "tokenworks.models.build",
}


__getattr__ = lazy_names(__name__, _HOMES)

__all__ = list(_HOMES)
