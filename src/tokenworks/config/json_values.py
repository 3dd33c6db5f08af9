"""Options given as one JSON object on the command line (vLLM's --speculative-config,
--kv-events-config): read into their dataclass, unknown keys refused by name."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable


def json_object(value, cls, name: str, example: str):
    """`value` as a dict of cls's fields (from a JSON string, the command line's, or a
    dict, the Python API's), or itself where it is a cls already."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e}): {value!r}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object such as {example}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; known: {sorted(known)}")
    return dict(value)


def json_arg(parse: Callable) -> Callable[[str], object]:
    """An argparse type for a JSON option: a bad value's own reason, not argparse's
    generic one."""

    def read(text: str):
        try:
            return parse(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    return read
