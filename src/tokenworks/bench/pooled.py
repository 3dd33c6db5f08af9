"""`tokenworks bench pool`: offline-throughput records of one workload, pooled against a peer.

On a shared machine one run's ratio to a peer moves with the minute it ran in, even for
the same engine on the same commit, so a goal such as "1.3x the best peer in the same
run" is judged better over many runs than by any one. This pools the rounds of several
`bench throughput` / `bench peers` records: each round pairs our figure with the peer's
of the same round (the engines ran minutes apart), and the summary gives

- each run's ratio of medians (what a record itself reports) and its rounds' ratios;
- over every round: the median ratio, the lowest and highest, how many reach the goal;
- the pooled medians: our median over all rounds against the peer's, and their ratio.

Records must hold the same workload (their manifests equal but for the round count) and
come from the same kind of machine (CPU model, core count and GPU, as the record's
hardware gives them: a ratio on one CPU says nothing of another's); records from a dirty
tree, or where the peer did not run, are left out and listed.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tokenworks.bench.report import ratio_text


@dataclass
class Run:
    """One record's rounds: our output tok/s and the peer's, round by round."""

    name: str  # the record's file stem
    commit: str
    created_unix: float
    ours: list[float]
    peer: list[float]

    @property
    def ratios(self) -> list[float]:
        return [o / p for o, p in zip(self.ours, self.peer, strict=True)]

    @property
    def ratio_of_medians(self) -> float:
        return statistics.median(self.ours) / statistics.median(self.peer)


@dataclass
class Pooled:
    peer: str
    goal: float
    runs: list[Run]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (record, why)

    @property
    def ratios(self) -> list[float]:
        return [x for run in self.runs for x in run.ratios]

    def summary(self) -> dict:
        ratios = self.ratios
        ours = [x for run in self.runs for x in run.ours]
        peer = [x for run in self.runs for x in run.peer]
        run_ratios = [run.ratio_of_medians for run in self.runs]
        return {
            "peer": self.peer,
            "goal": self.goal,
            "runs": len(self.runs),
            "rounds": len(ratios),
            "runs_at_goal": sum(r >= self.goal for r in run_ratios),
            "rounds_at_goal": sum(r >= self.goal for r in ratios),
            "rounds_faster": sum(r > 1.0 for r in ratios),
            "median_round_ratio": statistics.median(ratios),
            "lowest_round_ratio": min(ratios),
            "highest_round_ratio": max(ratios),
            "pooled_ours_tok_s": statistics.median(ours),
            "pooled_peer_tok_s": statistics.median(peer),
            "pooled_ratio": statistics.median(ours) / statistics.median(peer),
        }


def workload_key(record: dict) -> str:
    """The record's workload, its round count aside (3 or 5 rounds of one workload pool)."""
    manifest = dict((record.get("workload") or {}).get("manifest") or {})
    manifest.pop("rounds", None)
    return json.dumps(manifest, sort_keys=True)


def machine_key(record: dict) -> str:
    """The kind of machine a record ran on: CPU model, cores and GPU (memory sizes vary
    by a few MB between machines of one kind)."""
    hw = record.get("hardware") or {}
    return f"{hw.get('cpu')}, {hw.get('cores')} cores, GPU {hw.get('gpu')}"


def _run(record: dict, name: str, peer: str) -> Run | str:
    """The record's rounds against the peer, or why it cannot be pooled."""
    if record.get("kind") != "throughput":
        return f"a {record.get('kind')!r} record, not an offline throughput one"
    if (record.get("git") or {}).get("dirty"):
        return "made from a dirty tree"
    result = (record.get("peers") or {}).get(peer)
    if result is None:
        return f"no {peer} in it"
    if result.get("status") != "OK":
        return f"{peer} {result.get('status')}: {result.get('reason', '')}".rstrip(": ")
    ours = (record.get("results") or {}).get("tokenworks")
    if not ours or "output_tok_s" not in ours:
        return "no tokenworks figure in it"
    ours_rounds = [r["output_tok_s"] for r in ours.get("rounds", [])] or [ours["output_tok_s"]]
    peer_rounds = list(result.get("rounds") or [result["output_tok_s"]])
    if len(ours_rounds) != len(peer_rounds):
        return f"{len(ours_rounds)} rounds of ours against {len(peer_rounds)} of {peer}"
    if not all(isinstance(x, (int, float)) and x > 0 for x in ours_rounds + peer_rounds):
        return "a round without a positive output tok/s"
    return Run(
        name=name,
        commit=(record.get("git") or {}).get("commit") or "",
        created_unix=record.get("created_unix", 0.0),
        ours=ours_rounds,
        peer=peer_rounds,
    )


def pool(records: list[dict], peer: str = "vllm", goal: float = 1.3) -> Pooled:
    """The records' rounds against `peer`, oldest run first. Raises ValueError when the
    usable records hold more than one workload, or none are usable."""
    if goal <= 0:
        raise ValueError(f"goal {goal}: give the ratio to reach, such as 1.3")
    runs, skipped, workloads, machines = [], [], {}, {}
    for record in records:
        name = Path(record.get("_path", "?")).stem
        got = _run(record, name, peer)
        if isinstance(got, str):
            skipped.append((name, got))
            continue
        runs.append(got)
        workloads.setdefault(workload_key(record), []).append(name)
        machines.setdefault(machine_key(record), []).append(name)
    if not runs:
        why = "; ".join(f"{n}: {w}" for n, w in skipped) or "no records given"
        raise ValueError(f"nothing to pool against {peer} ({why})")
    if len(workloads) > 1:
        groups = " | ".join(", ".join(names) for names in workloads.values())
        raise ValueError(
            f"the records hold {len(workloads)} different workloads ({groups}); "
            "pool the records of one workload at a time"
        )
    if len(machines) > 1:
        groups = " | ".join(f"{m}: {', '.join(names)}" for m, names in machines.items())
        raise ValueError(
            f"the records come from {len(machines)} kinds of machine ({groups}); "
            "pool the records of one machine at a time"
        )
    runs.sort(key=lambda r: r.created_unix)
    return Pooled(peer=peer, goal=goal, runs=runs, skipped=skipped)


def markdown(pooled: Pooled, plot: str | None = None) -> str:
    s = pooled.summary()
    peer, goal = s["peer"], s["goal"]
    lines = [
        f"# Offline throughput against {peer}, pooled over {s['runs']} runs",
        "",
        f"{s['rounds']} rounds. Each round pairs our output tok/s with {peer}'s of the same "
        "round; a run's ratio is the ratio of its medians, as its record gives it.",
        "",
        "| | |",
        "|---|---|",
        f"| runs whose ratio of medians reaches {goal:g}x | {s['runs_at_goal']} of {s['runs']} |",
        f"| rounds at {goal:g}x or more | {s['rounds_at_goal']} of {s['rounds']} |",
        f"| rounds faster than {peer} | {s['rounds_faster']} of {s['rounds']} |",
        f"| median ratio of a round | {s['median_round_ratio']:.2f}x |",
        f"| lowest, highest round | {s['lowest_round_ratio']:.2f}x, "
        f"{s['highest_round_ratio']:.2f}x |",
        f"| pooled medians: ours, {peer} | {s['pooled_ours_tok_s']:.1f}, "
        f"{s['pooled_peer_tok_s']:.1f} tok/s ({s['pooled_ratio']:.2f}x) |",
        "",
        f"| record | commit | ratio of medians | rounds: ours / {peer} (ratio) |",
        "|---|---|---|---|",
    ]
    for run in pooled.runs:
        rounds = ", ".join(
            f"{o:.0f} / {p:.0f} ({ratio_text(o, p)})"
            for o, p in zip(run.ours, run.peer, strict=True)
        )
        lines.append(
            f"| `{run.name}` | {run.commit[:7]} | {run.ratio_of_medians:.2f}x | {rounds} |"
        )
    if pooled.skipped:
        lines += ["", "Left out:", ""]
        lines += [f"- `{name}`: {why}" for name, why in pooled.skipped]
    if plot:
        lines += ["", f"![ratio by round]({plot})"]
    return "\n".join(lines) + "\n"


def plot(pooled: Pooled, path: Path) -> Path:
    """Each round's ratio by run (oldest first), with the goal and parity lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(pooled.runs) + 2), 4))
    for i, run in enumerate(pooled.runs):
        ax.scatter([i] * len(run.ratios), run.ratios, color="tab:blue", s=18, zorder=3)
        ax.scatter([i], [run.ratio_of_medians], marker="_", s=300, color="black", zorder=4)
    ax.axhline(pooled.goal, color="tab:green", linestyle="--", label=f"goal {pooled.goal:g}x")
    ax.axhline(1.0, color="gray", linewidth=0.8, label="parity")
    median = statistics.median(pooled.ratios)
    ax.axhline(median, color="tab:orange", linewidth=0.8, label=f"median round {median:.2f}x")
    ax.set_xticks(range(len(pooled.runs)))
    ax.set_xticklabels([r.name.split("-")[-1] for r in pooled.runs], rotation=45, ha="right")
    ax.set_ylabel(f"tokenworks / {pooled.peer}, output tok/s")
    ax.set_title("offline throughput by round (dots) and run (bars: ratio of medians)")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_line(pooled: Pooled) -> str:
    s = pooled.summary()
    return (
        f"{s['runs']} runs, {s['rounds']} rounds against {s['peer']}: median round "
        f"{s['median_round_ratio']:.2f}x ({s['lowest_round_ratio']:.2f}x to "
        f"{s['highest_round_ratio']:.2f}x), {s['rounds_at_goal']} of {s['rounds']} rounds and "
        f"{s['runs_at_goal']} of {s['runs']} runs at {s['goal']:g}x or more; pooled medians "
        f"{s['pooled_ours_tok_s']:.1f} against {s['pooled_peer_tok_s']:.1f} tok/s "
        f"({s['pooled_ratio']:.2f}x)"
    )


def write_report(pooled: Pooled, out: str | Path) -> Path:
    """pooled-<peer>.md and its plot in `out`."""
    out = Path(out)
    png = plot(pooled, out / f"pooled-{pooled.peer}.png")
    md = out / f"pooled-{pooled.peer}.md"
    md.write_text(markdown(pooled, png.name))
    return md
