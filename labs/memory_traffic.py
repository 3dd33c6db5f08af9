"""Lab: memory moves whole lines, not the bytes a program asks for.

A CPU's cache moves 64-byte lines; a GPU's memory moves 32-byte sectors. Reading every
s-th float32 of an array asks for 4 bytes in every 4s, but while 4s is under a line every
line is still moved: the useful bytes a second fall as 1/s until each element has a line
of its own (s = 16 on this CPU), then stay there. The lab reads the same number of useful
float32 values at each stride from an array too big for the caches, and sets beside the
measured share of stride 1's useful rate two models:

- this CPU's: one 64-byte line moved per min(s, 16) elements, so a share of 1 / min(s, 16);
- a GPU warp's (`tokenworks plan traffic`, plan/traffic.py): 32 threads each reading one
  float32 at stride s, the 32-byte sectors their addresses touch.

    python labs/memory_traffic.py [--strides 1,2,4,8,16,32] [--values-mib 64]

Writes an evidence record and a PNG (measured share against both models).
"""

from __future__ import annotations

import argparse
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.plan.traffic import coalescing_efficiency  # noqa: E402

LINE = 64  # bytes a cache line holds on x86-64


def useful_rate(x: torch.Tensor, stride: int, n: int, repeats: int) -> float:
    """Useful bytes a second reading n float32 values, every stride-th of x (best of
    repeats: the noise on a shared machine only ever slows a read)."""
    view = x[: n * stride].view(n, stride)[:, 0]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        view.sum()
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--strides", default="1,2,4,8,16,32", help="elements between reads")
    ap.add_argument("--values-mib", type=int, default=64, help="useful bytes read at each stride")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(strides="1,4,16", values_mib=8, repeats=2))

    torch.set_num_threads(args.threads)
    strides = [int(s) for s in args.strides.split(",")]
    n = args.values_mib * 2**20 // 4
    x = torch.ones(n * max(strides))  # every page touched once before timing
    rows = []
    for s in strides:
        rate = useful_rate(x, s, n, args.repeats)
        rows.append({"stride": s, "useful_bytes_per_s": rate,
                     "cpu_model_share": 1 / min(s, LINE // 4),
                     "gpu_warp_efficiency": coalescing_efficiency(s)})  # fmt: skip
    base = rows[0]["useful_bytes_per_s"] if strides[0] == 1 else None
    for r in rows:
        r["measured_share"] = r["useful_bytes_per_s"] / base if base else None

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(strides, [r["measured_share"] for r in rows], "o-", label="measured (this CPU)")
    ax.plot(strides, [r["cpu_model_share"] for r in rows], "--", label="64-byte lines (model)")
    ax.plot(strides, [r["gpu_warp_efficiency"] for r in rows], ":",
            label="32-byte sectors, one warp (plan traffic)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("stride (float32 elements)")
    ax.set_ylabel("useful bytes / s, as a share of stride 1")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = save_figure(fig, args.out, "lab-memory-traffic.png")

    record = make_record(
        kind="lab.memory_traffic",
        engine={"threads": args.threads, "torch": torch.__version__},
        model={"name": None},
        workload={"strides": strides, "values_mib": args.values_mib, "repeats": args.repeats},
        results={"rows": rows, "line_bytes": LINE, "figure": str(png)},
        seeds=[],
    )
    path = write_record(record, args.out)
    for r in rows:
        share = f"{r['measured_share']:.3f}" if r["measured_share"] else "-"
        print(f"stride {r['stride']:>3}: {r['useful_bytes_per_s'] / 1e9:6.2f} GB/s useful, "
              f"{share} of stride 1 (lines: {r['cpu_model_share']:.3f}, "
              f"a GPU warp's sectors: {r['gpu_warp_efficiency']:.3f})")  # fmt: skip
    print(f"record {path}, figure {png}")


if __name__ == "__main__":
    main()
