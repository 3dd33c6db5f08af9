"""A hardware argument of the planners: a named accelerator from the table, or this CPU,
measured (plan/probe.py)."""

from __future__ import annotations

from tokenworks.plan.hardware import HARDWARE, Hardware
from tokenworks.plan.probe import probe

ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "4090": "rtx-4090", "mi300": "mi300x"}


def get_hardware(name: str) -> Hardware:
    key = ALIASES.get(name.lower(), name.lower())
    if key == "this-cpu":
        return probe()
    if key not in HARDWARE:
        raise ValueError(
            f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}, this-cpu "
            f"(aliases: {', '.join(ALIASES)})"
        )
    return HARDWARE[key]
