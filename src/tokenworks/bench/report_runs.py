"""The commands that read records rather than measure: `tokenworks bench report`,
`compare` and `pool`."""

from __future__ import annotations

from pathlib import Path

from tokenworks.bench.peer_runs import write_peers_report
from tokenworks.bench.pooled import pool, summary_line, write_report
from tokenworks.bench.report import compare_table, load_records, render


def run_report(args) -> None:
    """Tables and plots of the records (the peer comparison's report with --peers)."""
    records = load_records(args.records)
    if args.peers:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        print(write_peers_report(records, Path(args.out)))
        return
    print(render(records, args.out))


def run_compare(args) -> None:
    """Several engines' serving runs side by side, as ratios to the first."""
    table = compare_table(load_records(args.records))
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


def run_pool(args) -> None:
    """The records of many runs pooled against a peer, and the report of them."""
    pooled = pool(load_records(args.records), args.peer, args.goal)
    md = write_report(pooled, args.out)
    print(summary_line(pooled))
    print(f"report: {md}")
