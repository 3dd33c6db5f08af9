"""What the base install leaves out: each optional package's import name and the extra of
pyproject.toml that installs it, so a command that reaches one says what to install."""

from __future__ import annotations

# import name -> the extra that brings it (pyproject.toml's [project.optional-dependencies])
EXTRAS = {
    "matplotlib": "bench",
    "music21": "bench",
    "ray": "ray",
    "lm_eval": "eval",
    "transformers": "hf",
    "accelerate": "hf",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one-line message for an optional package that is not installed, or None when
    the missing module is not one of them (a broken install, not a choice)."""
    top = (error.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    install = f"pip install 'tokenworks[{extra}]'"
    return f"this needs the {top!r} package, in the {extra!r} extra: {install}"
