"""Decode attention by kind: MHA, GQA, MQA and MLA at one hidden size, batch and context.

How many keys and values a model keeps decides its cache, and a decode step reads the
whole cache: bytes per token set memory per request and (memory-bound) attention time.
For each kind this measures the cache bytes per token from the engine's own pool, the
time of one layer's decode attention over the paged pool (torch's path, which gathers the
context out of its blocks first, and the C kernel that reads the blocks in place, as the
C forward pass decodes), and sets beside them the plan's
figures: `shapes.kv_bytes_per_token` and a roofline time, max(bytes read / bandwidth,
FLOPs / peak) with this machine's probed rates. MLA is timed in both forms
(models/mla.py): absorbed, what the engine runs, and expanded, which rebuilds every
context token's keys and values each step.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tokenworks.bench.record import make_record, write_record
from tokenworks.engine.host_memory import keep_freed_memory
from tokenworks.engine.kv_pool import KVPool
from tokenworks.kernels.attention import latent_decode_attention, paged_decode_attention
from tokenworks.models.mla import LatentAttention
from tokenworks.models.spec import MLASpec, ModelSpec
from tokenworks.ops.attention import AttentionMetadata, attention_over_pool
from tokenworks.plan.probe import probe
from tokenworks.shapes import kv_bytes_per_token

HIDDEN, HEADS, HEAD_DIM = 2048, 16, 128
# DeepSeek-V2/V3's per-head sizes and latent, at this hidden size
MLA = MLASpec(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
KINDS = {"MHA": HEADS, "GQA": 4, "MQA": 1, "MLA": None}


def spec_for(kind: str) -> ModelSpec:
    mla = MLA if kind == "MLA" else None
    return ModelSpec(
        arch="deepseek_v3" if mla else "llama", vocab_size=1, hidden_size=HIDDEN, n_layers=1,
        n_heads=HEADS, n_kv_heads=KINDS[kind] or HEADS,
        head_dim=(MLA.qk_nope_head_dim + MLA.qk_rope_head_dim) if mla else HEAD_DIM,
        intermediate_size=1, max_position=1, norm_eps=1e-6, mla=mla,
    )  # fmt: skip


def decode_flops(kind: str, context: int) -> float:
    """FLOPs of one decode token's attention in one layer, in the form the engine runs."""
    if kind == "MLA":  # absorbed: the query into latent space, scores, values, back out
        r, rope, nope, v = (
            MLA.kv_lora_rank,
            MLA.qk_rope_head_dim,
            MLA.qk_nope_head_dim,
            MLA.v_head_dim,
        )
        return 2 * HEADS * (nope * r + (r + rope) * context + r * context + r * v)
    return 2 * HEADS * 2 * HEAD_DIM * context


def median_time(fn, repeats: int) -> float:
    """The median seconds of fn() over repeats calls, after one untimed."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(kind: str, batch: int, context: int, dtype, repeats: int, block_size: int = 16):
    spec = spec_for(kind)
    blocks_each = -(-(context + 1) // block_size)
    pool = KVPool.for_spec(spec, batch * blocks_each, block_size, dtype)
    g = torch.Generator().manual_seed(0)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch)]
    meta = AttentionMetadata.paged([1] * batch, [context] * batch, tables, block_size)
    out = {"kv_bytes_per_token": pool.nbytes / (pool.num_blocks * block_size)}
    with torch.inference_mode():
        if kind != "MLA":
            q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
            scale = HEAD_DIM**-0.5
            fn = lambda: attention_over_pool(q, meta, pool.k[0], pool.v[0], scale)  # noqa: E731
            out["seconds"] = median_time(fn, repeats)
            # the C kernel Llama-family models decode with: it reads the blocks in place
            tabs = torch.tensor(tables, dtype=torch.long)
            lens = torch.full((batch,), context + 1, dtype=torch.long)
            c = lambda: paged_decode_attention(  # noqa: E731
                q, pool.k[0], pool.v[0], tabs, lens, block_size, scale, None
            )
            if c() is not None:
                out["c_kernel_seconds"] = median_time(c, repeats)
            return out
        attn = LatentAttention(spec, 0)
        attn.kv_b.copy_(torch.randn(attn.kv_b.shape, generator=g) / MLA.kv_lora_rank**0.5)
        attn = attn.to(dtype)
        q = torch.randn(batch, HEADS, attn.dq, generator=g).to(dtype)
        dec = meta.decode
        out["seconds"] = median_time(lambda: attn._absorbed(q, pool.k[0], dec), repeats)
        tabs = torch.tensor(tables, dtype=torch.long)
        lens = torch.full((batch,), context + 1, dtype=torch.long)

        def c_kernel():  # the same absorbed form, its attention in C (csrc/latent_attention.h)
            o = latent_decode_attention(
                attn.latent_query(q), pool.k[0], tabs, lens, block_size, attn.scale,
                MLA.kv_lora_rank,
            )  # fmt: skip
            return None if o is None else attn.latent_output(o.to(dtype))

        if c_kernel() is not None:
            out["c_kernel_seconds"] = median_time(c_kernel, repeats)

        def expanded():
            for j in range(batch):
                index = dec.kv_index[j, : int(dec.context_lens[j])]
                attn.expanded(q[j : j + 1], pool.k[0][index, 0])

        out["expanded_seconds"] = median_time(expanded, max(1, repeats // 2))
    return out


def run_attention_bench(args) -> Path:
    torch.set_num_threads(args.threads or 2)
    keep_freed_memory()  # as the engine does: each call's buffers reuse the last call's pages
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    hw = probe(threads=torch.get_num_threads(), repeats=4)
    contexts = list(args.contexts)
    rows = {}
    for kind in tqdm(KINDS, desc="attention kinds"):
        shape = spec_for(kind).shape
        for context in contexts:
            got = measure(kind, args.batch, context, dtype, args.repeats)
            planned_bytes = kv_bytes_per_token(shape, name)
            read = planned_bytes * context * args.batch
            flops = decode_flops(kind, context) * args.batch
            rows[f"{kind}-ctx{context}"] = got | {
                "planned_kv_bytes_per_token": planned_bytes,
                "planned_seconds": max(read / hw.bandwidth, flops / hw.peak(name)),
                "planned_memory_seconds": read / hw.bandwidth,
                "planned_compute_seconds": flops / hw.peak(name),
            }
    record = make_record(
        kind="attention-kinds",
        engine={"dtype": args.dtype, "threads": torch.get_num_threads()},
        model={
            "hidden": HIDDEN,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "kv_heads": {k: v for k, v in KINDS.items() if v},
            "mla": MLA.__dict__,
            "weights": "random",
        },  # fmt: skip
        workload={"batch": args.batch, "contexts": contexts, "repeats": args.repeats},
        results={"rows": rows, "hardware_probe": hw.__dict__},
    )
    path = write_record(record, args.out)
    plot(rows, contexts, args, path.with_suffix(".png"))
    print(table(rows))
    print(f"record: {path}")
    return path


def table(rows: dict) -> str:
    out = [
        "| kind | context | KV bytes/token (pool) | plan | torch ms | C kernel ms | plan ms "
        "| MLA expanded ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        kind, ctx = key.split("-ctx")
        exp = f"{r['expanded_seconds'] * 1e3:.2f}" if "expanded_seconds" in r else ""
        c = f"{r['c_kernel_seconds'] * 1e3:.2f}" if "c_kernel_seconds" in r else ""
        out.append(
            f"| {kind} | {ctx} | {r['kv_bytes_per_token']:.0f} "
            f"| {r['planned_kv_bytes_per_token']:.0f} | {r['seconds'] * 1e3:.2f} | {c} "
            f"| {r['planned_seconds'] * 1e3:.2f} | {exp} |"
        )
    return "\n".join(out)


def plot(rows: dict, contexts: list[int], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    context = contexts[-1]
    kinds = list(KINDS)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    got = [rows[f"{k}-ctx{context}"] for k in kinds]
    x = range(len(kinds))
    a.bar([i - 0.2 for i in x], [r["kv_bytes_per_token"] for r in got], 0.4, label="engine pool")
    a.bar([i + 0.2 for i in x], [r["planned_kv_bytes_per_token"] for r in got], 0.4,
          label="plan")  # fmt: skip
    a.set(xticks=list(x), xticklabels=kinds, ylabel="KV bytes per token per layer",
          title=f"cache per token, hidden {HIDDEN}, {args.dtype}")  # fmt: skip
    a.legend()
    w = 0.27
    b.bar([i - w for i in x], [r["seconds"] * 1e3 for r in got], w, label="torch path")
    b.bar(list(x), [r.get("c_kernel_seconds", 0) * 1e3 for r in got], w,
          label="C kernel (in place)")  # fmt: skip
    b.bar([i + w for i in x], [r["planned_seconds"] * 1e3 for r in got], w,
          label="plan (roofline)")  # fmt: skip
    b.set(xticks=list(x), xticklabels=kinds, ylabel="ms per layer",
          title=f"decode attention, batch {args.batch}, context {context}")  # fmt: skip
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
