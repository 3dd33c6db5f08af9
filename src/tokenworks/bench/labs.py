"""What every lab under labs/ shares: its flags parsed with `--fast`, the smallest run
that still shows the lab's idea (what the test suite runs; a flag given on the command
line still wins over it), and its figure saved beside its record."""

from __future__ import annotations

import argparse
from pathlib import Path


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


def save_figure(fig, out_dir: str, name: str) -> Path:
    """fig as the PNG out_dir/name (out_dir made if missing), returning its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    fig.savefig(path, dpi=110)
    return path
