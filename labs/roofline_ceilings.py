"""Lab: a roofline with three ceilings, held against measured operations and then against
a batched decode it gets wrong.

The ceilings come from this machine, measured here:

- compute: float32 square products (`plan.probe`), FLOP/s;
- memory: summing a 512 MiB float32 vector, bytes read a second;
- cache: the same sum over vectors of 0.25 to 16 MiB, the best rate; the largest of those
  sizes still read at over twice the memory rate is where the cache ceiling ends.

Each operation (matrix-vector and matrix products of many shapes, elementwise adds and
multiply-adds, softmax, decode-shaped and prompt-shaped attention, all float32 in torch)
gets the roofline's time, max(bytes / bandwidth, FLOPs / peak), with its bytes the
compulsory ones (each input read once, each output written once) and its bandwidth the
cache's where those bytes fit in the cache's reach, the memory's otherwise; then it is
timed. Last, the engine's decode step at batch 1 to 64 (SmolLM2-135M as its GGUF stores
it, the default kernels) beside `plan.roofline.decode`'s prediction, and beside the
bfloat16 products of those steps timed alone at their own shapes.

    python labs/roofline_ceilings.py [--batches 1,4,16,64] [--threads 2]

Writes an evidence record and a PNG (the operations on the roofline; the decode steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks import LLM  # noqa: E402
from tokenworks.bench.attention_kinds import median_time  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.latency import decode_step_times  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402
from tokenworks.kernels.block_linear import BLOCK_ROWS  # noqa: E402
from tokenworks.plan.models import get_model  # noqa: E402
from tokenworks.plan.probe import best_time, probe  # noqa: E402
from tokenworks.plan.quant import parse_scheme  # noqa: E402
from tokenworks.plan.roofline import decode  # noqa: E402
from tokenworks.units import MiB  # noqa: E402

F32 = 4  # bytes


def read_rate(mib: float, repeats: int) -> float:
    """Bytes/s of summing a float32 vector of `mib` MiB: one add an element, so it streams
    as fast as the level holding the vector delivers (timed back to back: a vector that
    fits stays in the cache). The fastest of the calls: a ceiling is the best the machine
    does, and a shared machine's slow calls are its neighbours'."""
    x = torch.randn(int(mib * MiB / F32))
    return x.numel() * F32 / best_time(lambda: x.sum(), 4 * repeats)


def ceilings(hw, sizes_mib: list[float], memory_mib: float, repeats: int) -> dict:
    rates = {str(s): read_rate(s, repeats) for s in sizes_mib}
    memory = read_rate(memory_mib, repeats)
    reach = max((s for s in sizes_mib if rates[str(s)] > 2 * memory), default=min(sizes_mib))
    return {
        "compute_flops": hw.measured["matmul_flops_fp32"],
        "memory_bandwidth": memory,
        "cache_bandwidth": max(rates.values()),
        "cache_reach_bytes": reach * MiB,
        "read_rates_by_mib": rates,
        "probe": hw.measured,  # the planner's: its bandwidth is a matrix-vector product's
    }


def operations(fast: bool) -> list[tuple[str, str, float, float, object]]:
    """(kind, name, FLOPs, compulsory bytes, fn) for each operation to time."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    ops = []
    for n in (256, 1024, 4096) if fast else (256, 512, 1024, 2048, 4096, 8192):
        w, x, o = r(n, n), r(n), r(n)
        ops.append(("matvec", f"mv {n}x{n}", 2.0 * n * n, F32 * (n * n + 2 * n),
                    lambda w=w, x=x, o=o: torch.mv(w, x, out=o)))  # fmt: skip
    k = 512 if fast else 2048
    b = r(k, k)
    for m in (1, 16, 256) if fast else (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        a, o = r(m, k), r(m, k)
        ops.append(("matmul", f"mm {m}x{k}x{k}", 2.0 * m * k * k, F32 * (m * k + k * k + m * k),
                    lambda a=a, o=o: torch.mm(a, b, out=o)))  # fmt: skip
    for n in (1 << 14, 1 << 22) if fast else (1 << 14, 1 << 18, 1 << 22, 1 << 25):
        x, y, z, o = r(n), r(n), r(n), r(n)
        ops.append(("elementwise", f"add {n}", float(n), F32 * 3.0 * n,
                    lambda x=x, y=y, o=o: torch.add(x, y, out=o)))  # fmt: skip
        ops.append(("elementwise", f"fma {n}", 2.0 * n, F32 * 4.0 * n,
                    lambda x=x, y=y, z=z, o=o: torch.addcmul(z, x, y, out=o)))  # fmt: skip
    for rows in (16, 4096) if fast else (16, 256, 4096):  # larger: a fresh output a call
        s = r(rows, 1024)
        ops.append(("softmax", f"softmax {rows}x1024", 5.0 * s.numel(), F32 * 2.0 * s.numel(),
                    lambda s=s: s.softmax(-1)))  # fmt: skip
    heads, d = 16, 64
    for length in (256, 4096) if fast else (256, 1024, 4096, 16384):
        q, kk, v = r(1, heads, 1, d), r(1, heads, length, d), r(1, heads, length, d)
        ops.append(("attention", f"decode attention {length}", 4.0 * heads * length * d,
                    F32 * (2 * heads * length * d + 2 * heads * d),
                    lambda q=q, kk=kk, v=v: F.scaled_dot_product_attention(q, kk, v)))  # fmt: skip
    for length in (128, 512) if fast else (128, 512, 2048):
        q, kk, v = (r(1, 8, length, d) for _ in "qkv")
        ops.append(("attention", f"prompt attention {length}", 4.0 * 8 * length * length * d / 2,
                    F32 * 4 * 8 * length * d,
                    lambda q=q, kk=kk, v=v: F.scaled_dot_product_attention(
                        q, kk, v, is_causal=True)))  # fmt: skip
    return ops


def on_the_roofline(ops, ceil: dict, repeats: int) -> list[dict]:
    rows = []
    for kind, name, flops, moved, fn in tqdm(ops, desc="operations", unit="op"):
        in_cache = moved <= ceil["cache_reach_bytes"]
        bandwidth = ceil["cache_bandwidth"] if in_cache else ceil["memory_bandwidth"]
        t_memory, t_compute = moved / bandwidth, flops / ceil["compute_flops"]
        seconds = median_time(fn, repeats if moved > 16 * MiB else 10 * repeats)
        rows.append({
            "kind": kind, "name": name, "flops": flops, "bytes": moved,
            "intensity": flops / moved, "level": "cache" if in_cache else "memory",
            "bound": "compute" if t_compute >= t_memory else "bandwidth",
            "predicted_s": max(t_memory, t_compute), "measured_s": seconds,
            "flops_per_s": flops / seconds,
            "attained": max(t_memory, t_compute) / seconds,  # of the roofline; 1 is on it
        })  # fmt: skip
    return rows


def layer_products(spec, rows: int, repeats: int) -> float:
    """Seconds of one decode step's bfloat16 products at `rows` rows, each timed alone at
    its shape: a layer's QKV, output, gate-and-up and down products times the layers, and
    the LM head."""
    h, q = spec.hidden_size, spec.n_heads * spec.head_dim
    kv = spec.n_kv_heads * spec.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * spec.intermediate_size), (spec.intermediate_size, h)]
    bf = torch.bfloat16
    total = 0.0
    for k, n in shapes:
        x, w = torch.randn(rows, k).to(bf), torch.randn(k, n).to(bf)
        total += spec.n_layers * median_time(lambda x=x, w=w: x @ w, repeats)
    x, w = torch.randn(rows, h).to(bf), torch.randn(h, spec.vocab_size).to(bf)
    return total + median_time(lambda: x @ w, repeats)


def batched_decode(hw, model: str, scheme: str, batches: list[int], prompt: int, steps: int,
                   threads: int, repeats: int) -> tuple[dict, dict]:  # fmt: skip
    """The engine's decode steps beside the roofline's, and (above BLOCK_ROWS rows, where
    the engine's products are torch's bfloat16 ones on dequantised weights) beside those
    products timed alone."""
    llm = LLM(model, threads=threads, max_num_seqs=max(batches), enable_prefix_caching=False)
    shape, scheme = get_model(model), parse_scheme(scheme)
    out = {}
    for b in tqdm(batches, desc="decode batches", unit="batch"):
        vocab = llm.engine.spec.vocab_size
        prompts = [latency_prompt(prompt, vocab, seed=50 + i) for i in range(b)]
        measured = statistics.median(decode_step_times(llm.loop, prompts, steps))
        context = prompt + steps // 2
        by_peak = {
            dt: decode(shape, hw, scheme, batch=b, context=context, compute_dtype=dt)
            for dt in ("bf16", "fp32")
        }
        out[str(b)] = {
            "measured_s": measured,
            "predicted_s": by_peak["bf16"].step_time_s,
            "bound": by_peak["bf16"].bound,
            "predicted_fp32_peak_s": by_peak["fp32"].step_time_s,
            "memory_time_s": by_peak["bf16"].memory_time_s,
            "flops": by_peak["bf16"].flops,
            "products_alone_s": (
                layer_products(llm.engine.spec, b, repeats) if b > BLOCK_ROWS else None
            ),
            "measured_over_predicted": measured / by_peak["bf16"].step_time_s,
        }
    for small, big in zip(batches, batches[1:], strict=False):  # what one more row costs
        row = (out[str(big)]["measured_s"] - out[str(small)]["measured_s"]) / (big - small)
        out[str(big)]["marginal_row_s"] = row
        out[str(big)]["marginal_flops_per_s"] = out[str(big)]["flops"] / big / row
    return out, {"llm": model_record(llm), "engine": llm.config.to_dict(), "scheme": scheme.name}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--scheme",
        default="q4_1",
        help="how the model's file stores a weight (SmolLM2's GGUF: Q4_1)",
    )
    ap.add_argument("--batches", default="1,4,16,64", help="decode batch sizes")
    ap.add_argument("--prompt", type=int, default=128, help="tokens of each decoding sequence")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per batch")
    ap.add_argument("--cache-sizes", default="0.25,0.5,1,2,4,8,16", help="MiB")
    ap.add_argument("--memory-size", type=float, default=512, help="MiB: well past any cache")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap,
        fast=dict(
            batches=f"1,{BLOCK_ROWS + 1}",
            prompt=16,
            steps=2,
            cache_sizes="0.25,1,16",
            memory_size=256,
            repeats=1,
        ),
    )
    torch.set_num_threads(args.threads)
    hw = probe()
    sizes = [float(s) for s in args.cache_sizes.split(",")]
    ceil = ceilings(hw, sizes, args.memory_size, args.repeats)
    print(f"ceilings: compute {ceil['compute_flops'] / 1e9:.0f} GFLOP/s, cache "
          f"{ceil['cache_bandwidth'] / 1e9:.0f} GB/s up to {ceil['cache_reach_bytes'] / MiB:g} "
          f"MiB, memory {ceil['memory_bandwidth'] / 1e9:.0f} GB/s")  # fmt: skip
    rows = on_the_roofline(operations(args.fast), ceil, args.repeats)
    for r in rows:
        print(f"{r['name']:26s} {r['level']:6s} {r['bound']:9s} predicted "
              f"{r['predicted_s'] * 1e6:9.1f} us, measured {r['measured_s'] * 1e6:9.1f} us: "
              f"{100 * r['attained']:5.1f}% of the roofline")  # fmt: skip
    kinds = sorted({r["kind"] for r in rows})
    by_kind = {k: statistics.median(r["attained"] for r in rows if r["kind"] == k) for k in kinds}
    summary = {
        "operations": len(rows),
        "within_2x": sum(0.5 <= r["attained"] <= 1.0 for r in rows),
        "above_roofline": sum(r["attained"] > 1.0 for r in rows),
        "median_attained_by_kind": by_kind,
    }
    batches = [int(b) for b in args.batches.split(",")]
    # the planner's machine with the memory ceiling measured here (its probe's bandwidth is
    # a bfloat16 matrix-vector product's, which is torch's kernel's rate, not the memory's)
    hw = dataclasses.replace(hw, bandwidth=ceil["memory_bandwidth"])
    steps, about = batched_decode(
        hw, args.model, args.scheme, batches, args.prompt, args.steps, args.threads, args.repeats
    )
    for b, s in steps.items():
        alone = s["products_alone_s"]
        print(f"decode batch {b:>3s}: measured {s['measured_s'] * 1e3:7.2f} ms, roofline "
              f"{s['predicted_s'] * 1e3:7.2f} ms ({s['bound']}-bound)"
              + (f", its products alone {alone * 1e3:7.2f} ms" if alone else ""))  # fmt: skip
    record = make_record(
        kind="lab.roofline_ceilings",
        engine={**about["engine"], "threads": args.threads, "operations_dtype": "float32"},
        model=about["llm"],
        workload={
            "batches": batches,
            "prompt": args.prompt,
            "steps": args.steps,
            "repeats": args.repeats,
            "scheme": about["scheme"],
        },  # fmt: skip
        results={
            "ceilings": ceil,
            "operations": rows,
            "summary": summary,
            "batched_decode": steps,
        },  # fmt: skip
        seeds=[0],
    )
    path = write_record(record, args.out)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [2.0**e for e in range(-4, 12)]
    for level, style in (("cache", "--"), ("memory", "-")):
        bw = ceil[f"{level}_bandwidth"]
        a.plot(xs, [min(ceil["compute_flops"], x * bw) / 1e9 for x in xs], "k" + style,
               lw=1, label=f"{level} ceiling")  # fmt: skip
    for k, marker in zip(kinds, "osv^Dp", strict=False):
        pts = [r for r in rows if r["kind"] == k]
        a.scatter([r["intensity"] for r in pts], [r["flops_per_s"] / 1e9 for r in pts],
                  marker=marker, label=k, s=22)  # fmt: skip
    a.set(xscale="log", yscale="log", xlabel="FLOPs per compulsory byte", ylabel="GFLOP/s",
          title="float32 operations on the roofline")  # fmt: skip
    a.legend(fontsize=7)
    bs = list(steps)
    x = range(len(bs))
    for off, key, label in ((-0.27, "predicted_s", "roofline (bf16 peak)"),
                            (0, "products_alone_s", "its products alone"),
                            (0.27, "measured_s", "engine, measured")):  # fmt: skip
        b.bar([i + off for i in x], [(steps[k][key] or 0) * 1e3 for k in bs], 0.27, label=label)
    b.set(xticks=list(x), xticklabels=bs, xlabel="sequences in the decode step", ylabel="ms",
          yscale="log", title=f"{args.model} decode step")  # fmt: skip
    b.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
