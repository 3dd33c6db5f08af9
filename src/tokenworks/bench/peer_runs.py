"""`tokenworks bench peers`: the same workloads on tokenworks and on every peer engine
installed here, each in its own environment, in one run; then one comparison report.

Three benchmarks, each optional (--benches):

- latency: single-stream prefill and decode (bench/latency.py), ours and each peer's
  in-process script;
- offline: a manifest's requests all at once (bench/throughput.py; default 64 x 128 in /
  128 out);
- serving: a sweep of Poisson rates and concurrencies over a manifest, our server and each
  peer's OpenAI server started alike as subprocesses and driven by the same client.

A peer that is not installed, cannot run on this machine or fails to start gets a NOT_RUN
entry (or record) with the reason, never a figure. The report (peers.md plus PNGs) quotes
every figure beside the record it comes from.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace

from tokenworks.bench import latency, throughput
from tokenworks.bench.peer_engines import (
    PeerStartError,
    discover,
    running_server,
    tokenworks_server,
)
from tokenworks.bench.report import NOT_RUN, compare_table, load_records, ratio_text
from tokenworks.bench.serving import point_label, run_serving, write_not_run
from tokenworks.config import EngineConfig, engine_argv, engine_kwargs

BENCHES = ("latency", "offline", "serving")
SERVED_MODEL = "model"  # the name every server is started with

OFFLINE_MANIFEST = {
    "kind": "random",
    "num_requests": 64,
    "seed": 0,
    "input": {"dist": "fixed", "value": 128},
    "output": {"dist": "fixed", "value": 128},
    "ignore_eos": True,
}
SERVING_MANIFEST = {
    "kind": "random",
    "num_requests": 32,
    "seed": 0,
    "input": {"dist": "fixed", "value": 128},
    "output": {"dist": "fixed", "value": 64},
    "ignore_eos": True,
}


def model_file(model: str) -> str:
    """The GGUF every engine reads (llama.cpp directly, transformers through gguf)."""
    from tokenworks.models import catalogue

    if model in catalogue.CATALOGUE:
        return str(catalogue.pull(model))
    if model.endswith(".gguf") and Path(model).is_file():
        return model
    raise ValueError(f"bench peers needs a catalogue model or a .gguf file, not {model!r}")


def _with(args, **changes):
    """The options of `bench peers` as another benchmark's runner reads them, with
    `changes` (its own options beside them)."""
    given = (
        {f.name: getattr(args, f.name) for f in fields(args)} if is_dataclass(args) else vars(args)
    )
    return SimpleNamespace(**(given | changes))


def _manifest_file(manifest: dict, out: Path, name: str) -> str:
    path = out / name
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return str(path)


def run_peers(args) -> Path:
    from tokenworks.bench.peer_engines import PEER_NAMES

    for name in args.only:
        if name not in PEER_NAMES:
            raise SystemExit(f"--only {name!r}: known peers are {', '.join(PEER_NAMES)}")
    for name in args.benches:
        if name not in BENCHES:
            raise SystemExit(f"--benches {name!r}: choose from {', '.join(BENCHES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_dir = Path(args.report)
    report_dir.mkdir(parents=True, exist_ok=True)
    threads = args.threads or 2
    args = _with(args, threads=threads, peer=[])
    gguf = model_file(args.model)
    hf_dir = args.hf_dir or str(Path(args.peers_dir) / "smol-hf")
    args = _with(args, hf_dir=hf_dir)  # for the peers that read a Hugging Face copy
    serving_manifest = _load(args.serving_manifest, SERVING_MANIFEST)
    context = max(512, 2 * _longest(serving_manifest))
    peers = discover(
        args.peers_dir,
        gguf=gguf,
        hf_dir=hf_dir,
        served_model=SERVED_MODEL,
        threads=threads,
        max_num_seqs=args.max_num_seqs,
        context_per_seq=context,
    )
    chosen = [n for n in peers if not args.only or n in args.only]
    for name in chosen:
        p = peers[name]
        print(f"{name}: {'NOT_RUN: ' + p.reason if p.reason else 'runs (' + str(p.python) + ')'}")
    records: list[Path] = []

    def split(scripts: dict) -> tuple[dict, dict]:
        run, not_run = {}, {}
        for name in chosen:
            p = peers[name]
            if p.reason:
                not_run[name] = p.reason
            elif p.python and name in scripts:
                run[name] = p.python
            else:
                not_run[name] = f"no in-process {name} script for this benchmark"
        return run, not_run

    if "latency" in args.benches:
        run, not_run = split(latency.PEER_SCRIPTS)
        records.append(latency.run_latency(args, run, not_run))
    if "offline" in args.benches:
        manifest = _load(args.offline_manifest, OFFLINE_MANIFEST)
        path = _manifest_file(manifest, report_dir, "offline-manifest.json")
        run, not_run = split(throughput.PEER_SCRIPTS)
        offline = _with(args, manifest=path, rounds=args.offline_rounds)
        records.append(throughput.run_throughput(offline, run, not_run))
    if "serving" in args.benches:
        path = _manifest_file(serving_manifest, report_dir, "serving-manifest.json")
        sweep = _with(
            args, manifest=path, served_model=SERVED_MODEL, api_key=None, in_process=False
        )
        ours = tokenworks_server(engine_argv(args), SERVED_MODEL)
        records.append(_serve(sweep, "tokenworks", our_label(args), ours, {}, engine_kwargs(args)))
        for name in chosen:
            p = peers[name]
            label_ = p.label
            if p.reason or p.server is None:
                records.append(
                    write_not_run(
                        _with(sweep, label=label_), {"engine": name}, p.reason or p.no_server
                    )
                )
                continue
            records.append(_serve(sweep, name, label_, p.server, p.server_env, {}))
    report = write_peers_report(load_records(records), report_dir)
    print(f"report: {report}")
    return report


def our_label(args) -> str:
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    quant = f", {config.quantization}" if config.quantization else ""
    return f"tokenworks ({config.resolved_dtype}{quant})"


def _load(path: str | None, default: dict) -> dict:
    from tokenworks.bench.workload import load_manifest

    return load_manifest(path) if path else dict(default)


def _longest(manifest: dict) -> int:
    def top(spec):
        if isinstance(spec, int):
            return spec
        return spec.get("value") or spec.get("high") or spec.get("max") or 2 * spec.get("mean", 512)

    return top(manifest.get("input", 128)) + top(manifest.get("output", 128))


def _serve(sweep, name, label_, argv, env, config) -> Path:
    """Start one engine's server, run the sweep against it, stop it; NOT_RUN if it fails
    to start (its log stays in the temp directory)."""
    engine = {"engine": name, "server_argv": argv, **({"config": config} if config else {})}
    log = Path(tempfile.gettempdir()) / "tokenworks-bench-peers" / f"serve-{name}.log"
    sweep = _with(sweep, label=label_)
    try:
        with running_server(argv, env, log) as url:
            print(f"{name}: serving on {url}")
            return run_serving(_with(sweep, base_url=url), engine_extra=engine)
    except PeerStartError as e:
        return write_not_run(sweep, engine, f"server did not start: {e}")


# ------------------------------------------------------------------ the report


def _rel(record: dict, report_dir: Path) -> str:
    return os.path.relpath(record["_path"], report_dir)


def latency_table(record: dict, report_dir: Path) -> list[str]:
    s = record["results"]["summary_median"]
    ours = s["tokenworks"]
    link = f"[record]({_rel(record, report_dir)})"
    lines = [
        f"Single stream, {record['workload']['manifest']['prompt_tokens']}-token prefill and "
        f"{record['workload']['manifest']['decode_tokens']}-token decode, median of "
        f"{record['workload']['manifest']['repeats']} repeats ({link}).",
        "",
        "| engine | decode tok/s | prefill tok/s | tokenworks / engine, decode | ... prefill |",
        "|---|---|---|---|---|",
        f"| tokenworks | {ours['decode_tok_s']:.1f} | {ours['prefill_tok_s']:.0f} | 1.00x "
        "| 1.00x |",
    ]
    for name, r in record["peers"].items():
        if r.get("status") != "OK":
            lines.append(f"| {name} | {r.get('status')} | | | |")
            continue
        p = s[name]
        lines.append(
            f"| {name} | {p['decode_tok_s']:.1f} | {p['prefill_tok_s']:.0f} | "
            f"{ratio_text(ours['decode_tok_s'], p['decode_tok_s'])} | "
            f"{ratio_text(ours['prefill_tok_s'], p['prefill_tok_s'])} |"
        )
    return lines


def offline_table(record: dict, report_dir: Path) -> list[str]:
    m = record["workload"]["manifest"]
    ours = record["results"]["tokenworks"]
    link = f"[record]({_rel(record, report_dir)})"
    lines = [
        f"Offline: {m.get('num_requests')} requests of {json.dumps(m.get('input'))} input and "
        f"{json.dumps(m.get('output'))} output tokens, all at once ({link}).",
        "",
        "| engine | output tok/s | how | tokenworks / engine |",
        "|---|---|---|---|",
        f"| tokenworks | {ours['output_tok_s']:.1f} | continuous batching | 1.00x |",
    ]
    for name, r in record["peers"].items():
        if r.get("status") != "OK":
            lines.append(f"| {name} | {r.get('status')} | | |")
            continue
        lines.append(
            f"| {name} | {r['output_tok_s']:.1f} | {r.get('mode', '')} | "
            f"{ratio_text(ours['output_tok_s'], r['output_tok_s'])} |"
        )
    rounds = ours.get("rounds", [])
    if len(rounds) > 1:  # medians above; every round here
        per_round = record["results"].get("ratio_per_round", {})
        lines += [
            "",
            f"Each engine ran {len(rounds)} times, in turn; the table gives medians. Per round, "
            "output tok/s (tokenworks / engine):",
            "",
            "| engine | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " |",
            "|---|" + "---|" * len(rounds),
            "| tokenworks | " + " | ".join(f"{x['output_tok_s']:.1f}" for x in rounds) + " |",
        ]
        for name, ratios in per_round.items():
            tok_s = record["peers"][name]["rounds"]
            cells = (f"{t:.1f} ({q:.2f}x)" for t, q in zip(tok_s, ratios, strict=True))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def serving_plot(records: list[dict], path: Path) -> Path:
    """Output tok/s and median TTFT per sweep point, one line per engine that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in records if r.get("status") != NOT_RUN]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in ran:
        runs = r["results"]["runs"]
        xs = [point_label(x["point"]).strip("{}").replace('"', "") for x in runs]
        axes[0].plot(xs, [x["figures"]["output_throughput"] for x in runs], "o-", label=r["label"])
        ttft = [
            1000 * x["figures"]["ttft_s"]["median"] if x["figures"].get("ttft_s") else None
            for x in runs
        ]
        axes[1].plot(xs, ttft, "o-", label=r["label"])
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("median TTFT (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("serving sweep: the same manifest, the same client")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_peers_report(records: list[dict], report_dir: Path) -> Path:
    report_dir = Path(report_dir)
    lines = ["# tokenworks and its peers", ""]
    first = records[0] if records else {}
    hw, git = first.get("hardware", {}), first.get("git", {})
    commit = (git.get("commit") or "?")[:10] + (
        " (uncommitted changes)" if git.get("dirty") else ""
    )
    lines += [
        f"Machine: {hw.get('cpu')}, {hw.get('cores')} cores; tokenworks at {commit}. Within "
        "each table every engine ran the same workload in the same run, one after the other. "
        "In the latency and offline tables, tokenworks / engine above 1 means tokenworks is "
        "faster; the serving table gives each engine's output as a multiple of tokenworks'. "
        "Every figure is in the linked record.",
        "",
    ]
    not_run: dict[str, list[str]] = {}
    for r in records:
        if r.get("kind") == "latency":
            lines += ["## Single-stream latency", "", *latency_table(r, report_dir), ""]
        elif r.get("kind") == "throughput":
            lines += ["## Offline throughput", "", *offline_table(r, report_dir), ""]
        for name, p in (r.get("peers") or {}).items():
            if p.get("status") != "OK":
                why = p.get("reason") or f"{p.get('status')}: {p.get('stderr_tail', '')[-300:]}"
                not_run.setdefault(name, []).append(f"{r['kind']}: {why.strip()}")
    serving = [r for r in records if r.get("kind") == "serving"]
    if serving:
        m = serving[0]["workload"]["manifest"]
        lines += [
            "## Serving sweep",
            "",
            f"{m.get('num_requests')} requests of {json.dumps(m.get('input'))} input and "
            f"{json.dumps(m.get('output'))} output tokens per point, streamed over HTTP "
            "from one client process. Records: "
            + ", ".join(f"[{r['label']}]({_rel(r, report_dir)})" for r in serving)
            + ".",
            "",
            compare_table(serving),
            "",
        ]
        if any(r.get("status") != NOT_RUN for r in serving):
            png = serving_plot(serving, report_dir / "peers-serving.png")
            lines += [f"![serving sweep]({png.name})", ""]
        for r in serving:
            if r.get("status") == NOT_RUN:
                name = r["engine"].get("engine", r.get("label", "?"))
                not_run.setdefault(name, []).append(f"serving: {r.get('reason', '').strip()}")
    if not_run:
        lines += ["## Not run here", ""]
        for name, whys in not_run.items():
            lines.append(f"- **{name}**: {NOT_RUN}")
            lines += [f"  - {why}" for why in dict.fromkeys(whys)]
        lines.append("")
    path = report_dir / "peers.md"
    path.write_text("\n".join(lines))
    return path
