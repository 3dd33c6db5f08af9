"""Lab: attention a tile at a time, exact, without the score matrix.

A prompt of L tokens attends causally (8 query heads sharing 2 KV heads, 64-wide) two ways:

- naive: the whole score matrix S = QK^T in float32 (heads x L x L), its softmax, then PV;
- tiled (ops/tiled_attention.py): 64 keys at a time with an online softmax, a running
  maximum and sum rescaling what came before, so no score row is ever held whole.

Both are compared with the float64 definition (their largest error), timed, and their
memory counted: the scores each holds at once, and the bytes the tiled form read and wrote
(counted as it ran) beside `plan traffic`'s model of naive and tiled attention.

    python labs/tiled_attention.py [--lengths 256,1024,4096] [--tile 64]

Writes an evidence record and a PNG (bytes moved and scores held, per length).
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
from tokenworks.ops.tiled_attention import Traffic, tiled_sequence_attention  # noqa: E402
from tokenworks.plan.traffic import (  # noqa: E402
    AttentionShape,
    naive_attention_bytes,
    tiled_attention_bytes,
)

HEADS, KV_HEADS, DIM = 8, 2, 64


def naive(q, keys, values, scale, dtype=torch.float32) -> torch.Tensor:
    """softmax(QK^T) V with the whole causal score matrix: q [L, H, D] -> [L, H * D]."""
    n, h, d = q.shape
    k = keys.to(dtype).repeat_interleave(h // keys.shape[0], 0)
    v = values.to(dtype).repeat_interleave(h // values.shape[0], 0)
    s = q.to(dtype).transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, L, L]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(n, h * d)


def row(length: int, tile: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, HEADS, DIM, generator=g)
    keys, values = (torch.randn(KV_HEADS, length, DIM, generator=g) for _ in range(2))
    scale = DIM**-0.5
    exact = naive(q, keys, values, scale, torch.float64)
    t0 = time.perf_counter()
    full = naive(q, keys, values, scale)
    t1 = time.perf_counter()
    counted = Traffic()
    tiled = tiled_sequence_attention(q, keys, values, scale, tile=tile, traffic=counted)
    t2 = time.perf_counter()
    shape = AttentionShape(length, length, DIM, HEADS, KV_HEADS)
    return {
        "length": length,
        "naive_max_error": float((full.double() - exact).abs().max()),
        "tiled_max_error": float((tiled.double() - exact).abs().max()),
        "naive_s": t1 - t0,
        "tiled_s": t2 - t1,
        "naive_scores_held_bytes": HEADS * length * length * 4,
        "tiled_scores_held_bytes": HEADS * tile * tile * 4,  # one query tile by one key tile
        "tiled_bytes_counted": counted.read + counted.written,
        "tiled_bytes_plan": tiled_attention_bytes(shape, tile, tile),
        "naive_bytes_plan": naive_attention_bytes(shape),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="256,1024,4096", help="prompt lengths")
    ap.add_argument("--tile", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(lengths="128,256"))

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = [row(n, args.tile, args.seed) for n in lengths]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    ax1.plot(lengths, [r["naive_bytes_plan"] for r in rows], "o-", label="naive (plan)")
    ax1.plot(lengths, [r["tiled_bytes_plan"] for r in rows], "s-", label="tiled (plan)")
    ax1.plot(lengths, [r["tiled_bytes_counted"] for r in rows], "x", label="tiled (counted)")
    ax1.set_title("bytes moved")
    ax2.plot(lengths, [r["naive_scores_held_bytes"] for r in rows], "o-", label="naive")
    ax2.plot(lengths, [r["tiled_scores_held_bytes"] for r in rows], "s-", label="tiled")
    ax2.set_title("score bytes held at once")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("prompt length")
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = save_figure(fig, args.out, "lab-tiled-attention.png")

    record = make_record(
        kind="lab.tiled_attention",
        engine={"threads": args.threads, "tile": args.tile, "torch": torch.__version__},
        model={"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM},
        workload={"lengths": lengths, "causal": True},
        results={"rows": rows, "figure": str(png)},
        seeds=[args.seed],
    )
    path = write_record(record, args.out)
    for r in rows:
        print(f"L {r['length']:>5}: error vs float64 naive {r['naive_max_error']:.1e}, "
              f"tiled {r['tiled_max_error']:.1e}; time naive {r['naive_s'] * 1e3:.1f} ms, "
              f"tiled {r['tiled_s'] * 1e3:.1f} ms; scores held "
              f"{r['naive_scores_held_bytes'] / 2**20:.1f} MiB against "
              f"{r['tiled_scores_held_bytes'] / 2**10:.0f} KiB; bytes moved, tiled: counted "
              f"{r['tiled_bytes_counted'] / 2**20:.1f} MiB, plan "
              f"{r['tiled_bytes_plan'] / 2**20:.1f} MiB (naive plan "
              f"{r['naive_bytes_plan'] / 2**20:.1f} MiB)")  # fmt: skip
    print(f"record {path}, figure {png}")


if __name__ == "__main__":
    main()
