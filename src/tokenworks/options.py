"""Options as dataclass fields, their command-line flags made from the fields.

A field's metadata (`option(...)`) holds its help, and where they differ from the field's
own, its flag and argparse settings; its type and default are the field's. `add_arguments`
makes one flag per field (a bool gets --x / --no-x, a list is repeatable), `from_args`
builds the dataclass back from the parsed flags, `to_argv` writes the flags that differ
from the defaults. EngineConfig, the server's options and its limits are all made so: an
option is written once, and lands in every record as the dataclass's fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing


def option(help: str, flag: str | None = None, group: str | None = None, **argparse_kw):
    """A field's command-line metadata: its help, and where it differs from the field's
    own name (--field-name), its flag; `group`, the heading it is listed under."""
    return {"help": help, "flag": flag, "group": group, "argparse": argparse_kw}


def fields_of(cls) -> list[tuple[dataclasses.Field, type]]:
    """Each field with its type (X for X | None; list for list[X])."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        out.append((f, typing.get_origin(kind) or kind))
    return out


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def default_of(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _on_off(default: bool | None) -> str:
    return "auto" if default is None else "on" if default else "off"


def add_arguments(p: argparse.ArgumentParser, cls, heading: str | None = None) -> None:
    """One flag per field of `cls` (those without option metadata are left out); fields
    with a group of their own go under it, the others under `heading` (None: the parser's
    own list)."""
    groups: dict[str | None, argparse._ActionsContainer] = {None: p}
    if heading is not None:
        groups[None] = p.add_argument_group(heading)
    for f, kind in fields_of(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        group = groups.get(meta["group"])
        if group is None:
            group = groups[meta["group"]] = p.add_argument_group(meta["group"])
        extra = dict(meta["argparse"])
        names = [flag_of(f)] + ([extra.pop("short")] if "short" in extra else [])
        default = default_of(f)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            extra.setdefault("required", True)  # a field without a default (kw_only)
        help_text = meta["help"].replace("%", "%%")
        if not names[0].startswith("-"):  # a positional argument: its name is its dest
            group.add_argument(names[0], help=help_text, **({"type": kind} | extra))
        elif kind is bool:
            group.add_argument(
                *names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                help=help_text + f" (default: {_on_off(default)})",
            )  # fmt: skip
        elif kind is list:
            group.add_argument(
                *names, dest=f.name, action="append", default=default, help=help_text, **extra
            )
        else:
            shown = f" (default: {default})" if default is not None else ""
            if isinstance(default, tuple):  # a comma-separated list
                shown = f" (default: {','.join(map(str, default)) or 'none'})"
            group.add_argument(
                *names, dest=f.name, default=default, help=help_text + shown,
                **({"type": kind} | extra),
            )  # fmt: skip


def from_args(cls, args, **given):
    """`cls` from the flags add_arguments made (and `given` fields beside them)."""
    kw = {f.name: getattr(args, f.name) for f, _ in fields_of(cls) if hasattr(args, f.name)}
    return cls(**(kw | given))


def to_argv(cls, args) -> list[str]:
    """The flags of `cls` back as a command line: every one whose value differs from its
    field's default."""
    argv = []
    for f, kind in fields_of(cls):
        default = default_of(f)
        value = getattr(args, f.name, default)
        if value == default or value is None or "help" not in f.metadata:
            continue
        flag = flag_of(f)
        if kind is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        elif kind is list:
            for item in value:
                argv += [flag, str(item)]
        elif kind is tuple:  # a comma-separated list
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv
