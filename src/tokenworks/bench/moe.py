"""One mixture-of-experts layer measured: what a batch makes it read and what each way of
running it costs.

For each batch size: the distinct experts the batch's tokens were routed to, beside
`plan.roofline.expected_experts` (uniform routing); the time of the layer run each way
(models/moe.py: loop, grouped, dense) and which one `auto` picks. Then the same with a
router skewed on purpose (a few experts popular, as trained routers often are): the
busiest expert's share and what it does to the step.

The layer has random weights. A random router sends tokens near uniformly, which no
trained router does; the skewed run shows the other end.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tokenworks.bench.record import make_record, write_record
from tokenworks.engine.host_memory import keep_freed_memory
from tokenworks.models.moe import STRATEGIES, MoE
from tokenworks.models.spec import ModelSpec, MoESpec
from tokenworks.plan.roofline import expected_experts
from tokenworks.shapes import ModelShape

# layer shapes of real models (their config.json numbers), small enough for one CPU layer
SHAPES = {
    "qwen3-30b-a3b": dict(hidden=2048, n_experts=128, top_k=8, intermediate=768),
    "mixtral-8x7b": dict(hidden=4096, n_experts=8, top_k=2, intermediate=14336),
    "qwen1.5-moe-a2.7b": dict(hidden=2048, n_experts=60, top_k=4, intermediate=1408),
}


def layer(shape: str, dtype: torch.dtype, seed: int = 0) -> MoE:
    s = SHAPES[shape]
    spec = ModelSpec(
        arch="qwen3_moe", vocab_size=1, hidden_size=s["hidden"], n_layers=1, n_heads=1,
        n_kv_heads=1, head_dim=1, intermediate_size=s["intermediate"], max_position=1,
        norm_eps=1e-6,
        moe=MoESpec(n_experts=s["n_experts"], top_k=s["top_k"], intermediate=s["intermediate"]),
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    moe = MoE(spec, 0)
    h, inter = s["hidden"], s["intermediate"]
    with torch.no_grad():
        moe.router.copy_(torch.randn(moe.router.shape, generator=g) / h**0.5)
        moe.gate_up.copy_(torch.randn(moe.gate_up.shape, generator=g) / h**0.5)
        moe.down.copy_(torch.randn(moe.down.shape, generator=g) / inter**0.5)
    return moe.to(dtype).requires_grad_(False)


def tokens(moe: MoE, n: int, skew: float, seed: int) -> torch.Tensor:
    """n hidden states; skew > 0 gives expert e a router logit offset of -skew * log(1 + e)
    (a Zipf-like popularity) through a direction every token shares."""
    g = torch.Generator().manual_seed(seed)
    h = moe.router.shape[1]
    x = torch.randn(n, h, generator=g)
    if skew:
        u = torch.zeros(h)
        u[0] = 1.0  # the shared direction; the router's column 0 carries the offsets
        x = x + 4.0 * u
        offsets = -skew * torch.log1p(torch.arange(moe.m.n_experts, dtype=torch.float32))
        with torch.no_grad():
            moe.router[:, 0] = (offsets / 4.0).to(moe.router.dtype)
    return x.to(moe.router.dtype)


def time_layer(moe: MoE, x: torch.Tensor, strategy: str, repeats: int) -> float:
    moe.strategy = strategy
    with torch.inference_mode():
        moe(x)  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            moe(x)
            times.append(time.perf_counter() - t)
    moe.strategy = "auto"
    return statistics.median(times)


def routing(moe: MoE, x: torch.Tensor, repeats: int) -> dict:
    """Where the batch's tokens go, and the busiest expert's own time: under expert
    parallelism, the device holding it sets the step."""
    with torch.inference_mode():
        _, ids = moe.route(x)
        counts = torch.bincount(ids.reshape(-1), minlength=moe.m.n_experts)
        busiest = int(counts.argmax())
        rows = x[(ids == busiest).any(dim=1)]
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            moe._expert(rows, busiest)
            times.append(time.perf_counter() - t)
    picked = moe.pick(counts)
    counts = counts.float()
    return {
        "picked": picked,
        "busiest_expert_seconds": statistics.median(times[1:]),
        "experts_touched": int((counts > 0).sum()),
        "busiest_expert_tokens": int(counts.max()),
        "mean_expert_tokens": float(counts.mean()),
        "imbalance": float(counts.max() / counts.mean()),
    }


def run_moe_bench(args) -> Path:
    torch.set_num_threads(args.threads or 2)
    keep_freed_memory()  # as the engine does: each call's buffers reuse the last call's pages
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    batches = list(args.batches)
    moe = layer(args.shape, dtype)
    s = SHAPES[args.shape]
    plan_shape = ModelShape(
        name=args.shape, n_layers=1, hidden=s["hidden"], n_heads=1, n_kv_heads=1, head_dim=1,
        intermediate=s["intermediate"], vocab=1, n_experts=s["n_experts"],
        experts_per_token=s["top_k"], moe_intermediate=s["intermediate"],
    )  # fmt: skip
    rows = {}
    work = [(skew, b) for skew in (0.0, args.skew) for b in batches]
    for skew, b in tqdm(work, desc=f"MoE layer {args.shape}"):
        x = tokens(moe, b, skew, seed=b)
        row = routing(moe, x, args.repeats) | {
            "expected_experts_uniform": expected_experts(plan_shape, b)
        }
        row["seconds"] = {
            name: time_layer(moe, x, name, args.repeats) for name in STRATEGIES if name != "auto"
        }
        row["fastest"] = min(row["seconds"], key=row["seconds"].get)
        rows[f"{'skewed' if skew else 'uniform'}-b{b}"] = row
    record = make_record(
        kind="moe-layer",
        engine={"dtype": args.dtype, "threads": torch.get_num_threads(), "strategies": STRATEGIES},
        model={"shape": args.shape, **s, "weights": "random (seed 0)"},
        workload={"batches": batches, "skew": args.skew, "repeats": args.repeats},
        results={"rows": rows},
    )
    path = write_record(record, args.out)
    plot(rows, batches, args, path.with_suffix(".png"))
    print(table(rows))
    print(f"record: {path}")
    return path


def table(rows: dict) -> str:
    head = (
        "| batch | router | experts touched | uniform expectation | busiest / mean "
        "| busiest expert ms | loop ms | grouped ms | dense ms | fastest | auto picks |"
    )
    out = [head, "|" + "---|" * 11]
    for key, r in rows.items():
        router, b = key.rsplit("-b", 1)
        ms = {k: f"{v * 1e3:.2f}" for k, v in r["seconds"].items()}
        out.append(
            f"| {b} | {router} | {r['experts_touched']} | {r['expected_experts_uniform']:.1f} "
            f"| {r['imbalance']:.2f} | {r['busiest_expert_seconds'] * 1e3:.2f} "
            f"| {ms['loop']} | {ms['grouped']} | {ms['dense']} "
            f"| {r['fastest']} | {r['picked']} |"
        )
    return "\n".join(out)


def plot(rows: dict, batches: list[int], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    uni = [rows[f"uniform-b{n}"] for n in batches]
    a.plot(batches, [r["experts_touched"] for r in uni], "o-", label="measured, random router")
    skew = [rows[f"skewed-b{n}"] for n in batches if f"skewed-b{n}" in rows]
    if skew:
        a.plot(batches, [r["experts_touched"] for r in skew], "s-", label="measured, skewed router")
    a.plot(batches, [r["expected_experts_uniform"] for r in uni], "k--", label="plan: uniform")
    a.set(xscale="log", xlabel="tokens in the batch", ylabel="distinct experts touched",
          title=f"{args.shape}: experts a batch reads")  # fmt: skip
    a.legend()
    for name in ("loop", "grouped", "dense"):
        b.plot(batches, [r["seconds"][name] * 1e3 for r in uni], "o-", label=name)
    b.set(xscale="log", yscale="log", xlabel="tokens in the batch", ylabel="ms per layer",
          title=f"one MoE layer, {args.dtype}, random router")  # fmt: skip
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
