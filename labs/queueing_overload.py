"""Lab: queueing under overload, on the real model, straight into the engine's front.

Requests arrive as a Poisson process at rising rates. Below the engine's capacity the
time to first token stays near one prefill. Near capacity the queue builds and TTFT
climbs steeply, as queueing theory says it must when utilisation approaches 1. Past
capacity a bounded queue (`max_waiting`) keeps waiting requests from piling up without
end: the excess is refused at once (HTTP 429/529 in the server), so the requests that are
admitted still get a bounded TTFT.

    python labs/queueing_overload.py [--rates 1,2,4,8,16] [--requests 32]

Writes an evidence record and a PNG (TTFT median and p90, and the refused share, against
the offered rate).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenworks import LLM  # noqa: E402
from tokenworks.bench.client import run_in_process  # noqa: E402
from tokenworks.bench.labs import parse_lab_args  # noqa: E402
from tokenworks.bench.metrics import compute  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.bench.workload import build_requests  # noqa: E402
from tokenworks.front.core_client import CoreClient  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rates", default="1,2,4,8,16", help="offered req/s, comma-separated")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-waiting", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(rates="4", requests=6, input_tokens=16, output_tokens=4))
    rates = [float(r) for r in args.rates.split(",")]

    llm = LLM(
        args.model,
        threads=2,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        enable_prefix_caching=False,  # every prompt is new work
    )
    manifest = {
        "kind": "random",
        "num_requests": args.requests,
        "seed": 0,
        "input": args.input_tokens,
        "output": args.output_tokens,
        "ignore_eos": True,
    }
    requests = build_requests(manifest, llm.engine.spec.vocab_size)
    front = CoreClient(engine=llm.engine)
    front.start()
    points = []
    try:
        for rate in rates:
            results, duration = asyncio.run(run_in_process(front, requests, rate=rate, seed=1))
            figures = compute(results, duration)
            figures["refused"] = sum(1 for r in results if not r.ok and "full" in (r.error or ""))
            points.append(
                {"rate": rate, "figures": figures, "requests": [r.__dict__ for r in results]}
            )
            ttft = figures["ttft_s"]
            print(
                f"{rate:5.1f} req/s offered: {figures['completed']} done, "
                f"{figures['refused']} refused, TTFT p50 {1000 * ttft['median']:.0f} ms "
                f"p90 {1000 * ttft['p90']:.0f} ms"
            )
    finally:
        front.shutdown()

    record = make_record(
        kind="lab-queueing-overload",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={**manifest, "rates": rates, "arrivals": "Poisson", "client": "in-process"},
        results={"points": points},
        seeds=[0, 1],
    )
    path = write_record(record, args.out)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [p["rate"] for p in points]
    for key, style in (("median", "o-"), ("p90", "s--")):
        ax1.plot(xs, [1000 * p["figures"]["ttft_s"][key] for p in points], style, label=key)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("offered load (requests/s, Poisson)")
    ax1.set_ylabel("TTFT of admitted requests (ms)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(xs, [p["figures"]["refused"] / args.requests for p in points], "o-", color="C3")
    ax2.plot(xs, [p["figures"]["request_throughput"] for p in points], "^-", color="C2")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("offered load (requests/s, Poisson)")
    ax2.set_ylabel("refused share (red) / completed req/s (green)")
    ax2.grid(alpha=0.3)
    fig.suptitle(
        f"queueing under overload: max_num_seqs {args.max_num_seqs}, "
        f"max_waiting {args.max_waiting}, {args.input_tokens} in / {args.output_tokens} out"
    )
    fig.tight_layout()
    png = Path(args.out) / "lab-queueing-overload.png"
    fig.savefig(png, dpi=100)
    print(f"record: {path}\nplot: {png}")


if __name__ == "__main__":
    main()
