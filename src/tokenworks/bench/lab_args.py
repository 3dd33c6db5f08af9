"""What every lab under labs/ parses the same way: its own flags, and `--fast`, the
smallest run that still shows the lab's idea (what the test suite runs; a flag given on
the command line still wins over it)."""

from __future__ import annotations

import argparse


def parse_lab_args(parser: argparse.ArgumentParser, fast: dict, argv=None) -> argparse.Namespace:
    """parser's arguments, with `fast` (dest -> value) as the defaults under --fast."""
    shown = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in fast.items())
    parser.add_argument(
        "--fast", action="store_true", help=f"a small run that still shows the idea: {shown}"
    )
    args = parser.parse_args(argv)
    if args.fast:
        parser.set_defaults(**fast)
        args = parser.parse_args(argv)
    return args
