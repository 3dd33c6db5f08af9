"""`tokenworks bench report` and `bench compare`: evidence records -> Markdown and PNG.

A report puts each record's figures in tables and draws, for serving records, latency
against throughput over the sweep, the TTFT and ITL distributions, and goodput against
load. A record that says NOT_RUN is reported as NOT_RUN with its reason, never a figure.
`compare` lines up several engines' serving runs of the same workload (same manifest
sha256) as ratios to the first.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenworks.bench.serving import point_label, summary_table

NOT_RUN = "NOT_RUN"


def load_records(paths: list[str | Path]) -> list[dict]:
    records = []
    for p in paths:
        try:
            record = json.loads(Path(p).read_text())
        except FileNotFoundError:
            raise ValueError(f"{p}: no such record file") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not a JSON record ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{p} is not a record: it holds a JSON {type(record).__name__}")
        record.setdefault("_path", str(p))
        records.append(record)
    return records


def label(record: dict) -> str:
    if record.get("label"):
        return record["label"]
    engine = record.get("engine") or {}
    if "base_url" in engine:
        return f"{engine.get('served_model')} @ {engine['base_url']}"
    dtype = (record.get("model") or {}).get("dtype") or engine.get("dtype", "")
    return f"tokenworks ({dtype})" if dtype else "tokenworks"


def _scalars(d: dict, prefix: str = "", depth: int = 2) -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        if isinstance(v, bool) or isinstance(v, (int, float, str)):
            out.append((prefix + k, v))
        elif isinstance(v, dict) and depth > 0:
            out += _scalars(v, f"{prefix}{k}.", depth - 1)
    return out


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _plots(record: dict, out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record["results"]["runs"]
    files = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax in zip(("ttft_s", "tpot_s"), axes, strict=True):
        for sweep in ("rate", "max_concurrency"):  # one line per kind of sweep
            series = sorted(
                (r["figures"]["output_throughput"], 1000 * r["figures"][key]["median"], r)
                for r in runs
                if sweep in r["point"] and r["figures"].get(key)
            )
            if not series:
                continue
            ax.plot([x for x, _, _ in series], [y for _, y, _ in series], "o-", label=sweep)
            for x, y, r in series:
                ax.annotate(str(r["point"][sweep]), (x, y), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"median {key[:-2].upper()} (ms)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"latency vs throughput: {label(record)}")
    fig.tight_layout()
    files.append(out_dir / f"{stem}-latency-throughput.png")
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        done = [q for q in r["requests"] if q["ok"] and q["chunk_times"]]
        ttft = [1000 * (q["chunk_times"][0] - q["start"]) for q in done]
        itl = [
            1000 * (b - a)
            for q in done
            for a, b in zip(q["chunk_times"], q["chunk_times"][1:], strict=False)
        ]
        name = point_label(r["point"])
        if ttft:
            axes[0].hist(ttft, bins=20, alpha=0.5, label=name)
        if itl:
            axes[1].hist(itl, bins=30, alpha=0.5, label=name)
    for ax, what in zip(axes, ("TTFT (ms)", "ITL (ms)"), strict=True):
        ax.set_xlabel(what)
        ax.set_ylabel("requests" if what.startswith("TTFT") else "gaps")
        ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / f"{stem}-distributions.png")
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)

    good = [r for r in runs if "goodput" in r["figures"]]
    if good:
        fig, ax = plt.subplots(figsize=(5, 4))
        xs = [r["figures"]["request_throughput"] for r in good]
        ax.plot(xs, [r["figures"]["goodput"] for r in good], "o-", label="goodput")
        ax.plot(xs, xs, "--", alpha=0.5, label="all requests")
        ax.set_xlabel("completed requests/s (load)")
        ax.set_ylabel("requests/s meeting the SLOs")
        ax.legend()
        fig.tight_layout()
        files.append(out_dir / f"{stem}-goodput.png")
        fig.savefig(files[-1], dpi=100)
        plt.close(fig)
    return files


def render(records: list[dict], out_dir: str | Path) -> Path:
    """Write report.md (and PNGs beside it) for the records; return report.md's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# tokenworks report", ""]
    for i, record in enumerate(records):
        source = Path(record.get("_path", f"record-{i}")).name
        lines += [f"## {record.get('kind', '?')}: {label(record)}", "", f"Record: `{source}`", ""]
        if record.get("status") == NOT_RUN:
            lines += [f"**{NOT_RUN}**: {record.get('reason', 'no reason given')}", ""]
            continue
        if record.get("kind") == "serving":
            lines += [summary_table(record), ""]
            for png in _plots(record, out, f"{Path(source).stem}"):
                lines += [f"![{png.stem}]({png.name})", ""]
            continue
        rows = _scalars(record.get("results") or {})
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in rows[:60]]
        lines.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def ratio_text(a: float | None, b: float | None) -> str:
    """a / b as "1.23x", or "-" where either is missing or zero (an engine that produced
    nothing has no ratio)."""
    return f"{a / b:.2f}x" if a and b else "-"


def compare_table(records: list[dict]) -> str:
    """Serving runs of the same workload, point by point, as ratios to the first record."""
    runs = [r for r in records if r.get("kind") == "serving"]
    if not runs:
        raise ValueError("compare needs serving records (from tokenworks bench serve)")
    shas = {r["workload"]["sha256"] for r in runs if r.get("status") != NOT_RUN}
    if len(shas) > 1:
        raise ValueError("these records ran different workloads (manifest sha256 differs)")
    base = runs[0]
    header = "| point | " + " | ".join(label(r) for r in runs) + " |"
    lines = [
        "Output tokens/s (ratio to the first) and median TTFT ms, per sweep point.",
        "",
        header,
        "|---" * (len(runs) + 1) + "|",
    ]
    points = [r["point"] for r in base["results"]["runs"]] if base.get("status") != NOT_RUN else []
    for k, point in enumerate(points):
        ref = base["results"]["runs"][k]["figures"]["output_throughput"]
        cells = []
        for r in runs:
            if r.get("status") == NOT_RUN:
                cells.append(NOT_RUN)
                continue
            match = [x for x in r["results"]["runs"] if x["point"] == point]
            if not match:
                cells.append("-")
                continue
            f = match[0]["figures"]
            ttft = f"{1000 * f['ttft_s']['median']:.0f} ms" if f.get("ttft_s") else "-"
            cells.append(
                f"{f['output_throughput']:.1f} ({ratio_text(f['output_throughput'], ref)}), {ttft}"
            )
        lines.append(f"| {point_label(point)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
