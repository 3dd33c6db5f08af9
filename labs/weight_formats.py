"""Lab: what each weight format stores, and what it loses, on trained weights.

The reference is a trained model's own weights: tensors the catalogue's Gemma 3 270M file
keeps in Q8_0 and Q6_K (its most precise ones, 8.5 and 6.6 bits a weight), dequantised.
Each is quantised again to every format tokenworks executes and read back the way the
engine reads it (GGUF blocks through the C kernels' dequantisation, kernels/blocks.py; the
int8 rows and int4 groups of ops/linear.py):

- bits a weight: what the format stores, scales and minimums included;
- relative error: the RMS of (read back - reference) over the RMS of the reference;
- worst error: the largest |read back - reference| over the largest |reference|.

The error is reconstruction only: what it does to a model's output is the separate
measurement `tokenworks bench quant` makes (perplexity, greedy agreement, speed).

    python labs/weight_formats.py [--model gemma3-270m] [--tensors 4]

Writes an evidence record and a PNG (error against bits a weight, per format).
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import gguf  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.kernels import blocks  # noqa: E402
from tokenworks.models import catalogue  # noqa: E402
from tokenworks.ops.linear import int4_quantize, q4_blocks, q4_dequantize  # noqa: E402

Q = gguf.GGMLQuantizationType
GGUF_FORMATS = {"Q8_0": Q.Q8_0, "Q5_0": Q.Q5_0, "Q4_1": Q.Q4_1, "Q4_0": Q.Q4_0}


def gguf_round_trip(w: np.ndarray, qtype) -> tuple[torch.Tensor, float]:
    """w quantised by the gguf package, read back by tokenworks: (weights, bits a weight)."""
    data = gguf.quants.quantize(w, qtype)
    back = blocks.dequantize(blocks.from_array(int(qtype), w.shape, data))
    return back, data.nbytes * 8 / w.size


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, float]:
    """ops/linear.py's Int8Linear: one float scale per output row (bfloat16 kept)."""
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None])
    return q * scale.bfloat16().float()[:, None], 8 + 16 / w.shape[1]


def int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, float]:
    """ops/linear.py's int4: groups of 32, each with a bfloat16 scale and minimum, in the
    20-byte blocks the C kernels read."""
    q, sz = int4_quantize(w)
    packed = q4_blocks(q, sz)
    return q4_dequantize(packed, w.shape[1]), packed.numel() * 8 / w.numel()


def errors(ref: torch.Tensor, got: torch.Tensor) -> dict:
    diff = (got.float() - ref).double()
    return {
        "relative_rms": float(diff.pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()),
        "worst": float(diff.abs().max() / ref.abs().max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tensors", type=int, default=4, help="of each reference type")
    ap.add_argument("--references", default="Q8_0,Q6_K", help="the file's stored types to take")
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(tensors=1, references="Q8_0"))
    references = args.references.split(",")

    path = catalogue.pull(args.model)
    reader = gguf.GGUFReader(path)
    chosen = []
    for kind in references:
        found = [t for t in reader.tensors if t.tensor_type.name == kind and len(t.shape) == 2]
        found = [t for t in found if t.n_elements <= 2**21]  # skip the vocabulary tables
        chosen += found[: args.tensors]
    rows = []
    for t in chosen:
        shape = (int(t.shape[1]), int(t.shape[0]))  # gguf lists the fastest dimension first
        ref_np = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        ref = torch.from_numpy(np.ascontiguousarray(ref_np, dtype=np.float32))
        row = {"tensor": t.name, "stored_as": t.tensor_type.name, "shape": list(shape)}
        for name, qtype in GGUF_FORMATS.items():
            back, bits = gguf_round_trip(ref.numpy(), qtype)
            row[name] = {"bits_per_weight": bits, **errors(ref, back)}
        for name, fn in (("int8-row", int8_rows), ("int4-g32", int4_groups)):
            back, bits = fn(ref)
            row[name] = {"bits_per_weight": bits, **errors(ref, back)}
        rows.append(row)
    formats = [*GGUF_FORMATS, "int8-row", "int4-g32"]
    summary = {}
    for f in formats:  # a tensor stored in format f comes back exactly: it is left out
        others = [r for r in rows if r["stored_as"] != f] or rows
        summary[f] = {
            "bits_per_weight": rows[0][f]["bits_per_weight"],
            "relative_rms": float(np.mean([r[f]["relative_rms"] for r in others])),
            "worst": float(max(r[f]["worst"] for r in others)),
            "tensors": len(others),
        }

    fig, ax = plt.subplots(figsize=(6, 4))
    for f in formats:
        s = summary[f]
        ax.scatter(s["bits_per_weight"], s["relative_rms"])
        ax.annotate(f, (s["bits_per_weight"], s["relative_rms"]), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("bits a weight")
    ax.set_ylabel("relative RMS error (mean over tensors)")
    ax.set_title(f"{args.model}: {len(rows)} trained tensors, re-quantised")
    fig.tight_layout()
    png = save_figure(fig, args.out, "lab-weight-formats.png")

    entry = catalogue.lookup(args.model)
    record = make_record(
        kind="lab.weight_formats",
        engine={"formats": formats, "dequantised_by": "kernels/blocks.py (C kernels)"},
        model={"id": args.model, "file": str(path), "sha256": entry.sha256},
        workload={"references": references, "tensors": [r["tensor"] for r in rows]},
        results={"rows": rows, "summary": summary, "figure": str(png)},
        seeds=[],
    )
    written = write_record(record, args.out)
    for f, s in summary.items():
        print(f"{f:>8}: {s['bits_per_weight']:5.2f} bits a weight, relative RMS error "
              f"{s['relative_rms']:.4f}, worst {s['worst']:.4f}")  # fmt: skip
    print(f"record {written}, figure {png}")


if __name__ == "__main__":
    main()
