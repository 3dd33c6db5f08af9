"""Lab: one GPT-2 forward pass written out by hand, checked against transformers, and
counted component by component: parameters, FLOPs and time.

The pass is plain NumPy (float32), one line per component, each line timed; transformers'
GPT2LMHeadModel runs the same weights as the oracle. The weights are drawn at random from
GPT-2 small's configuration (no GPT-2 checkpoint ships with any package here; the counts
and times depend on the shapes, not on the values). Biases and LayerNorm gains are drawn
too, so a term left out shows up in the check.

    python labs/transformer_anatomy.py [--lengths 64,256,1024] [--repeats 3]

Writes an evidence record and a PNG (each component's share of the FLOPs beside its share
of the time, and the GFLOP/s each reaches).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.models.reference import layer_norm, softmax  # noqa: E402
from tokenworks.shapes import from_hf_config  # noqa: E402

COMPONENTS = [
    "embedding", "layer_norm", "qkv_proj", "scores", "softmax", "weighted_values",
    "attn_out_proj", "mlp_up", "gelu", "mlp_down", "residual", "lm_head",
]  # fmt: skip
# elementwise FLOPs an element costs, by the operations the lines below spell out
LN_FLOPS, SOFTMAX_FLOPS, GELU_FLOPS = 8, 5, 8


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GPT-2's GELU kept in x's dtype: the float64 oracle's line (a NumPy float64 constant,
    x**3) would turn a float32 pass into float64 from here on, and pow is slow."""
    c = x.dtype.type(np.sqrt(2 / np.pi))
    return 0.5 * x * (1 + np.tanh(c * (x + x.dtype.type(0.044715) * x * x * x)))


def gpt2(layers: int, hidden: int, heads: int, vocab: int, positions: int, seed: int):
    """transformers' GPT-2 with every parameter drawn at random, and its config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                     n_positions=positions, bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                     attn_implementation="eager")  # fmt: skip
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                p.normal_(1, 0.1)
    return model, cfg


def params(w: dict, layers: int) -> dict[str, int]:
    """Parameters by component, from the weights themselves (the LM head reuses wte)."""
    per = defaultdict(int)
    for name, t in w.items():
        if name.startswith(("wte", "wpe")):
            per["embedding"] += t.size
        elif ".ln_" in name or name.startswith("ln_f"):
            per["layer_norm"] += t.size
        elif "attn.c_attn" in name:
            per["qkv_proj"] += t.size
        elif "attn.c_proj" in name:
            per["attn_out_proj"] += t.size
        elif "mlp.c_fc" in name:
            per["mlp_up"] += t.size
        elif "mlp.c_proj" in name:
            per["mlp_down"] += t.size
        else:
            raise SystemExit(f"a weight no component holds: {name}")
    per["lm_head"] = 0  # tied to the token embedding
    return dict(per)


def forward(ids: np.ndarray, w: dict, layers: int, heads: int, eps: float, clock) -> np.ndarray:
    """GPT-2's logits [n, vocab] for ids [n], each component's line inside clock(name)."""
    n = len(ids)
    with clock("embedding"):
        x = w["wte.weight"][ids] + w["wpe.weight"][:n]
    h = x.shape[1]
    d = h // heads
    causal = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    for i in range(layers):
        p = f"h.{i}."
        with clock("layer_norm"):
            a = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        with clock("qkv_proj"):
            qkv = a @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]  # Conv1D [h, 3h]
        q, k, v = (t.reshape(n, heads, d).transpose(1, 0, 2) for t in np.split(qkv, 3, axis=1))
        with clock("scores"):
            kt = np.ascontiguousarray(k.transpose(0, 2, 1))  # a strided operand skips BLAS
            s = q @ kt * np.float32(d**-0.5) + causal  # [heads, n, n]
        with clock("softmax"):
            s = softmax(s)
        with clock("weighted_values"):
            a = (s @ v).transpose(1, 0, 2).reshape(n, h)
        with clock("attn_out_proj"):
            a = a @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        with clock("residual"):
            x = x + a
        with clock("layer_norm"):
            a = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        with clock("mlp_up"):
            a = a @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]
        with clock("gelu"):
            a = gelu_tanh(a)
        with clock("mlp_down"):
            a = a @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
        with clock("residual"):
            x = x + a
    with clock("layer_norm"):
        x = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps)
    with clock("lm_head"):
        return x @ w["wte.weight"].T


def flops(n: int, layers: int, hidden: int, heads: int, vocab: int) -> dict[str, float]:
    """FLOPs of each component for n tokens, counted from the lines of `forward`: a
    product [m, k] x [k, p] is 2mkp, a bias add mp. The score matrix is computed whole,
    its masked half included, as the line computes it."""
    h, L = hidden, layers

    def product(m, k, p, bias=True):
        return 2.0 * m * k * p + (m * p if bias else 0)

    return {
        "embedding": float(n * h),
        "layer_norm": LN_FLOPS * n * h * (2 * L + 1.0),
        "qkv_proj": L * product(n, h, 3 * h),
        "scores": L * (2.0 * n * n * h + 2.0 * n * n * heads),  # q.k, then the scale and mask
        "softmax": L * SOFTMAX_FLOPS * float(n * n) * heads,
        "weighted_values": L * 2.0 * n * n * h,
        "attn_out_proj": L * product(n, h, h),
        "mlp_up": L * product(n, h, 4 * h),
        "gelu": L * GELU_FLOPS * 4.0 * n * h,
        "mlp_down": L * product(n, 4 * h, h),
        "residual": L * 2.0 * n * h,
        "lm_head": product(n, h, vocab, bias=False),
    }


class Clock:
    """Seconds spent inside each `with clock(name)`, summed over the pass."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def __call__(self, name: str):
        clock = self

        class Span:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                clock.seconds[name] += time.perf_counter() - self.t0

        return Span()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="64,256,1024", help="prompt lengths, in tokens")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3, help="passes per length; the median counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap, fast=dict(lengths="16,64", layers=2, hidden=128, heads=2, vocab=1000, positions=64,
                      repeats=1),
    )  # fmt: skip
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) > args.positions:
        raise SystemExit(f"--lengths go up to {max(lengths)}; GPT-2 here has {args.positions} "
                         "positions (raise --positions)")  # fmt: skip
    model, cfg = gpt2(args.layers, args.hidden, args.heads, args.vocab, args.positions, args.seed)
    w = {
        k.removeprefix("transformer."): v.detach().numpy().astype(np.float32)
        for k, v in model.state_dict().items()
        if not k.endswith(".attn.bias") and not k.startswith("lm_head")  # masks; tied head
    }
    counted = params(w, args.layers)
    total = sum(counted.values())
    library = sum(p.numel() for p in model.parameters())
    shaped = from_hf_config(cfg.to_dict()).params()
    print(f"parameters: {total:,} counted here, {library:,} in transformers, "
          f"{shaped:,} from the shapes alone")  # fmt: skip
    if total != library:
        raise SystemExit(f"the count ({total:,}) is not transformers' ({library:,})")

    rng = np.random.default_rng(args.seed)
    by_length = {}
    for n in tqdm(lengths, desc="lengths", unit="length"):
        ids = rng.integers(0, args.vocab, n)
        forward(ids, w, args.layers, args.heads, cfg.layer_norm_epsilon, Clock())  # warm-up
        runs = []
        for _ in range(args.repeats):
            clock = Clock()
            t0 = time.perf_counter()
            logits = forward(ids, w, args.layers, args.heads, cfg.layer_norm_epsilon, clock)
            runs.append((time.perf_counter() - t0, dict(clock.seconds)))
        lib_s = []
        with torch.no_grad():
            model(torch.from_numpy(ids)[None])  # warm-up
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                expected = model(torch.from_numpy(ids)[None]).logits[0].numpy()
                lib_s.append(time.perf_counter() - t0)
        wall = float(np.median([r[0] for r in runs]))
        counts = flops(n, args.layers, args.hidden, args.heads, args.vocab)
        parts = {}
        for c in COMPONENTS:
            s = float(np.median([r[1][c] for r in runs]))
            parts[c] = {"flops": counts[c], "ms": 1000 * s, "gflops_per_s": counts[c] / s / 1e9}
        if logits.dtype != np.float32:
            raise SystemExit(f"the pass left float32: its logits are {logits.dtype}")
        diff = float(np.abs(logits - expected).max())
        agree = float((logits.argmax(-1) == expected.argmax(-1)).mean())
        if diff > 1e-2 * float(np.abs(expected).max()) or agree < 1:
            raise SystemExit(f"{n} tokens: the hand-written pass is off transformers' by {diff}")
        for part in parts.values():
            part["flops_share"] = part["flops"] / sum(counts.values())
            part["time_share"] = part["ms"] / sum(p["ms"] for p in parts.values())
        by_length[str(n)] = {
            "components": parts,
            "ms": 1000 * wall,
            "components_ms": sum(p["ms"] for p in parts.values()),
            "flops": sum(counts.values()),
            "transformers_ms": 1000 * float(np.median(lib_s)),
            "max_abs_diff": diff,
            "argmax_agreement": agree,
        }
        top = max(parts, key=lambda c: parts[c]["ms"])
        print(f"{n:5d} tokens: {1000 * wall:8.1f} ms by hand, "
              f"{by_length[str(n)]['transformers_ms']:8.1f} ms in transformers; "
              f"{sum(counts.values()) / 1e9:7.2f} GFLOPs; most time in {top}; "
              f"max |diff| {diff:.1e}")  # fmt: skip

    record = make_record(
        kind="lab.transformer_anatomy",
        engine={"threads": args.threads, "dtype": "float32", "numpy": np.__version__},
        model={
            "id": "gpt2-shaped, random weights",
            "config": {
                "layers": args.layers,
                "hidden": args.hidden,
                "heads": args.heads,
                "vocab": args.vocab,
                "positions": args.positions,
            },
        },  # fmt: skip
        workload={"lengths": lengths, "repeats": args.repeats},
        results={
            "params": {**counted, "total": total, "transformers": library, "from_shapes": shaped},
            "lengths": by_length,
        },  # fmt: skip
        seeds=[args.seed],
    )
    path = write_record(record, args.out)

    longest = by_length[str(max(lengths))]["components"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ys = np.arange(len(COMPONENTS))
    a.barh(ys - 0.2, [100 * longest[c]["flops_share"] for c in COMPONENTS], 0.4,
           label="share of FLOPs")  # fmt: skip
    a.barh(ys + 0.2, [100 * longest[c]["time_share"] for c in COMPONENTS], 0.4,
           label="share of time")  # fmt: skip
    a.set(yticks=ys, yticklabels=COMPONENTS, xlabel="%", title=f"{max(lengths)} tokens")
    a.invert_yaxis()
    a.legend(fontsize=8)
    for n in lengths:
        parts = by_length[str(n)]["components"]
        b.plot([parts[c]["gflops_per_s"] for c in COMPONENTS], ys, "o-", label=f"{n} tokens")
    b.set(yticks=ys, yticklabels=COMPONENTS, xscale="log", xlabel="GFLOP/s",
          title="rate each component reaches")  # fmt: skip
    b.invert_yaxis()
    b.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
