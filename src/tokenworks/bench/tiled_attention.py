"""Naive against tiled attention, prompt and decode, time and peak memory, by context.

Prompt attention of one sequence at the default model's head shape (9 query heads on 3
KV heads of 64), float32, causal, for each context: the naive form (every score of the
L x L matrix built, then the softmax: ops/attention.explicit_attention's shape of
work), torch's SDPA, and the tiled online softmax (ops/tiled_attention.py). Peak memory is
the growth of this process's resident high-water mark (VmHWM, reset before each call
through /proc/self/clear_refs) over what it held before the call; the naive form runs only
where its score matrices fit --naive-gib.

Decode attention of --batch sequences over a bfloat16 paged pool: torch's path (gather,
SDPA), the tiled torch path, and the C kernel with whole score rows and with its online
softmax (csrc attend_online), which is what decides abi.ONLINE_FROM.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from tokenworks.bench.attention_kinds import median_time
from tokenworks.bench.record import make_record, write_record
from tokenworks.engine.kv_pool import KVPool
from tokenworks.kernels.abi import ONLINE_TILE
from tokenworks.kernels.attention import paged_decode_attention
from tokenworks.ops.attention import AttentionMetadata, attention_over_pool, sequence_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's
MiB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith(key))


def peak_growth(fn) -> tuple[float, int]:
    """(seconds, bytes the resident high-water mark rose above the resident set) of one
    call of fn."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark back to the current resident set
    before = _status("VmRSS")
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    return seconds, max(0, _status("VmHWM") - before)


def naive(q, keys, values, scale):
    """Causal attention with every score of the sequence held at once: q [n, H, D]."""
    n, h, _ = q.shape
    group = h // keys.shape[0]
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [H, n, L]
    scores.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), -torch.inf)
    return torch.matmul(scores.softmax(-1), v).transpose(0, 1).reshape(n, -1)


def prompt_row(n: int, tile: int, naive_gib: float, repeats: int) -> dict:
    """One prompt of n tokens: each form's best time and largest peak growth."""
    scale = HEAD_DIM**-0.5
    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    keys = torch.randn(KV_HEADS, n, HEAD_DIM, generator=g)
    values = torch.randn(KV_HEADS, n, HEAD_DIM, generator=g)
    kinds = {
        "sdpa": lambda: sequence_attention(q, keys, values, scale, None),
        "tiled": lambda: sequence_attention(q, keys, values, scale, None, tile=tile),
    }
    score_bytes = HEADS * n * n * 4
    if 2 * score_bytes <= naive_gib * 2**30:  # the scores and their softmax
        kinds["naive"] = lambda: naive(q, keys, values, scale)
    row = {"naive_score_bytes": score_bytes}
    with torch.inference_mode():
        for kind, fn in kinds.items():
            times, peaks = zip(*(peak_growth(fn) for _ in range(repeats)), strict=True)
            row[f"{kind}_seconds"] = min(times)
            row[f"{kind}_peak_bytes"] = max(peaks)
    return row


def decode_row(n: int, batch: int, tile: int, repeats: int, block_size: int = 16) -> dict:
    """batch decode queries over contexts of n keys in a bfloat16 pool: each path's
    median time."""
    scale = HEAD_DIM**-0.5
    each = -(-n // block_size)
    pool = KVPool(1, batch * each, block_size, KV_HEADS, HEAD_DIM, torch.bfloat16)
    g = torch.Generator().manual_seed(n)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    order = torch.randperm(batch * each, generator=g)  # blocks scattered through the pool
    tables = [order[i * each : (i + 1) * each].tolist() for i in range(batch)]
    meta = AttentionMetadata.paged([1] * batch, [n - 1] * batch, tables, block_size)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).bfloat16()
    tabs, lens = torch.tensor(tables), torch.full((batch,), n)
    k, v = pool.k[0], pool.v[0]
    kinds = {
        "torch": lambda: attention_over_pool(q, meta, k, v, scale),
        "tiled": lambda: attention_over_pool(q, meta, k, v, scale, tile=tile),
        "c_rows": lambda: paged_decode_attention(
            q, k, v, tabs, lens, block_size, scale, None, online=(ONLINE_TILE, 0)
        ),
        "c_online": lambda: paged_decode_attention(
            q, k, v, tabs, lens, block_size, scale, None, online=(ONLINE_TILE, 1)
        ),
    }
    row = {"kv_bytes": 2 * batch * n * KV_HEADS * HEAD_DIM * 2}
    with torch.inference_mode():
        for kind, fn in kinds.items():
            row[f"{kind}_seconds"] = median_time(fn, repeats)
    return row


def run_tiled_attention_bench(args) -> Path:
    torch.set_num_threads(args.threads or 2)
    contexts = list(args.contexts)
    prompts = [c for c in contexts if c <= args.max_prompt]
    rows = {}
    for n in tqdm(prompts, desc="prompt attention"):
        rows[f"prompt-{n}"] = prompt_row(n, args.tile, args.naive_gib, args.prompt_repeats)
    for n in tqdm(contexts, desc="decode attention"):
        rows[f"decode-{n}"] = decode_row(n, args.batch, args.tile, args.repeats)
    record = make_record(
        kind="tiled-attention",
        engine={"threads": torch.get_num_threads(), "tile": args.tile},
        model={"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "weights": "random"},
        workload={
            "contexts": contexts, "prompt_contexts": prompts, "decode_batch": args.batch,
            "prompt_dtype": "float32", "decode_kv_dtype": "bfloat16",
            "naive_gib": args.naive_gib, "repeats": args.repeats,
        },
        results={"rows": rows},
    )  # fmt: skip
    path = write_record(record, args.out)
    plot(rows, prompts, contexts, path.with_suffix(".png"))
    print(table(rows))
    print(f"record: {path}")
    return path


def table(rows: dict) -> str:
    out = ["| rows | naive ms / MiB | SDPA ms / MiB | tiled ms / MiB |", "|---|---|---|---|"]
    for name, r in rows.items():
        if name.startswith("prompt"):
            cells = [
                f"{r[k + '_seconds'] * 1e3:.1f} / {r[k + '_peak_bytes'] / MiB:.0f}"
                if k + "_seconds" in r else "(does not fit)"
                for k in ("naive", "sdpa", "tiled")
            ]  # fmt: skip
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| decode | torch ms | tiled ms | C rows ms | C online ms |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if name.startswith("decode"):
            cells = [
                f"{r[k + '_seconds'] * 1e3:.2f}" for k in ("torch", "tiled", "c_rows", "c_online")
            ]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows: dict, prompts, contexts, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for kind in ("naive", "sdpa", "tiled"):
        xs = [n for n in prompts if f"{kind}_seconds" in rows[f"prompt-{n}"]]
        a.plot(xs, [rows[f"prompt-{n}"][f"{kind}_seconds"] for n in xs], "o-", label=kind)
        b.plot(xs, [rows[f"prompt-{n}"][f"{kind}_peak_bytes"] / MiB for n in xs], "o-", label=kind)
    for kind in ("torch", "tiled", "c_rows", "c_online"):
        c.plot(contexts, [rows[f"decode-{n}"][f"{kind}_seconds"] * 1e3 for n in contexts], "o-",
               label=kind)  # fmt: skip
    for ax, title, unit in (
        (a, "prompt attention", "s"), (b, "prompt attention peak memory", "MiB"),
        (c, "decode attention (bfloat16 pool)", "ms"),
    ):  # fmt: skip
        ax.set(xlabel="context", ylabel=unit, title=title)
        if any(len(line.get_xdata()) for line in ax.lines):
            ax.set(xscale="log", yscale="symlog" if unit == "MiB" else "log")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path)
