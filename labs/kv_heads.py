"""Lab: what sharing keys and values between query heads saves, and what it costs.

Three measurements:

- caches: the KV bytes a token adds to each cached catalogue model's cache, beside what
  the same model would keep with a key and value head for every query head (MHA);
- kernels: one layer's decode attention for B sequences over L tokens with 32 query heads
  and 8 KV heads, three ways. Naive: K and V copied out to one head per query head, then
  attention as for MHA, which reads (and first writes) as many bytes as MHA would;
  grouped: each KV head read once for the query heads that share it; and the C paged
  kernel, which reads each KV row once in place. MHA's own cache is timed beside them;
- converting: a model's KV heads averaged into one (the conversion the GQA paper starts
  from, here without the training that follows it), its perplexity on a text beside the
  model as it was, and the bytes a token then adds.

    python labs/kv_heads.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--context 2048]

Writes an evidence record and a PNG (the kernels' milliseconds; perplexity before and after).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks import LLM  # noqa: E402
from tokenworks.bench.attention_kinds import median_time  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.eval.perplexity import perplexity  # noqa: E402
from tokenworks.kernels.attention import paged_decode_attention  # noqa: E402
from tokenworks.kernels.block_linear import dense  # noqa: E402
from tokenworks.models import catalogue, load  # noqa: E402
from tokenworks.shapes import kv_bytes_per_token  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64  # the kernels' layer (Llama 3.2 1B's attention)
# the text the perplexities are taken on: English prose that ships with the checkout
TEXT = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def caches() -> dict:
    """KV bytes per token (bfloat16) of each cached catalogue model, as kept and as MHA."""
    out = {}
    for name, entry in catalogue.CATALOGUE.items():
        if not catalogue.cached_path(entry).is_file():
            continue
        spec = load(name, weights=False).spec
        mha = dataclasses.replace(spec, n_kv_heads=spec.n_heads)
        out[name] = {
            "query_heads": spec.n_heads,
            "kv_heads": spec.n_kv_heads,
            "bytes_per_token": kv_bytes_per_token(spec.shape),
            "mha_bytes_per_token": kv_bytes_per_token(mha.shape),
        }
    return out


def kernels(batch: int, context: int, repeats: int) -> dict:
    """Milliseconds of one layer's decode attention, and the K/V bytes each way reads."""
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    group = HEADS // KV_HEADS
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(bf)
    k, v = (torch.randn(batch, context, KV_HEADS, HEAD_DIM, generator=g).to(bf) for _ in "kv")
    k_mha, v_mha = (torch.randn(batch, context, HEADS, HEAD_DIM, generator=g).to(bf) for _ in "kv")
    scale = HEAD_DIM**-0.5

    def mha(keys=k_mha, values=v_mha):  # one KV head for every query head
        s = torch.einsum("bhd,blhd->bhl", q, keys).float() * scale
        return torch.einsum("bhl,blhd->bhd", s.softmax(-1).to(bf), values)

    def naive():  # the shared heads copied out to every query head first
        return mha(k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2))

    def grouped():  # each KV head read once for its group of query heads
        qg = q.view(batch, KV_HEADS, group, HEAD_DIM)
        s = torch.einsum("bkgd,blkd->bkgl", qg, k).float() * scale
        return torch.einsum("bkgl,blkd->bkgd", s.softmax(-1).to(bf), v).reshape(q.shape)

    block = 16
    blocks = -(-context // block)
    pool_k = k.reshape(batch * context, KV_HEADS, HEAD_DIM)  # each sequence's own blocks
    pool_v = v.reshape(batch * context, KV_HEADS, HEAD_DIM)
    tables = torch.arange(batch * blocks).view(batch, blocks) if context % block == 0 else None
    lens = torch.full((batch,), context)

    def c_kernel():
        return paged_decode_attention(q, pool_k, pool_v, tables, lens, block, scale, None)

    kv_bytes = 2 * batch * context * HEAD_DIM * 2  # K and V of one head, bfloat16
    timed = {"mha": (mha, HEADS), "naive_gqa": (naive, HEADS), "grouped_gqa": (grouped, KV_HEADS)}
    out = {
        way: {"ms": 1000 * median_time(fn, repeats), "kv_bytes_read": kv_bytes * heads}
        for way, (fn, heads) in timed.items()
    }
    if tables is not None and c_kernel() is not None:
        out["c_kernel_gqa"] = {
            "ms": 1000 * median_time(c_kernel, repeats),
            "kv_bytes_read": kv_bytes * KV_HEADS,
        }
    torch.testing.assert_close(naive().float(), grouped().float(), atol=2e-2, rtol=2e-2)
    return out


def kv_heads_averaged(loaded, heads: int):
    """loaded with each layer's KV heads averaged in groups down to `heads`: the K and V
    projections (and their biases) mean-pooled over each group, the spec saying `heads`.
    Query head j keeps reading the group its own KV head fell into."""
    spec, w = loaded.spec, dict(loaded.weights)
    d, group = spec.head_dim, spec.n_kv_heads // heads
    for i in range(spec.n_layers):
        for part in ("k_proj", "v_proj"):
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{part}.{kind}"
                if name in w:
                    t = dense(w[name]).float()
                    w[name] = t.view(heads, group, d, *t.shape[1:]).mean(1).flatten(0, 1)
    spec = dataclasses.replace(spec, n_kv_heads=heads)
    return dataclasses.replace(loaded, spec=spec, weights=w)


def converting(model: str, ids_of, context: int, threads: int) -> dict:
    loaded = load(model)
    out = {}
    ways = {
        "as_trained": loaded,
        # the same averaging over groups of one: a check that the conversion keeps the
        # heads' layout (its perplexity must be the model's own)
        "averaged_by_one": kv_heads_averaged(loaded, loaded.spec.n_kv_heads),
        "one_kv_head": kv_heads_averaged(loaded, 1),
    }
    for way, source in ways.items():
        # every way dequantised alike (the averaged K and V are dense): a file's blocks
        # against dense weights would differ by more than the check allows
        llm = LLM(model, loaded=source, threads=threads, warmup=False, max_model_len=context,
                  quantization="none")  # fmt: skip
        ids = ids_of(llm.tokenizer)
        ppl = perplexity(llm.engine, ids, context, context)
        out[way] = {
            "kv_heads": source.spec.n_kv_heads,
            "perplexity": ppl["perplexity"],
            "tokens": ppl["tokens"],
            "bytes_per_token": kv_bytes_per_token(source.spec.shape),
        }
    out["perplexity_ratio"] = out["one_kv_head"]["perplexity"] / out["as_trained"]["perplexity"]
    same = out["averaged_by_one"]["perplexity"] / out["as_trained"]["perplexity"]
    if abs(same - 1) > 1e-3:
        raise SystemExit(f"{model}: averaging groups of one head changed the perplexity {same}x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048, help="tokens each sequence attends to")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-context", type=int, default=512)
    ap.add_argument("--text", default=str(TEXT), help="the text perplexity is taken on")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap, fast=dict(models="smollm2-135m", batch=2, context=256, repeats=1, ppl_tokens=256,
                      ppl_context=128),
    )  # fmt: skip
    torch.set_num_threads(args.threads)
    text = Path(args.text).read_text(encoding="utf-8")

    cache = caches()
    for name, c in cache.items():
        kept, mha = c["bytes_per_token"], c["mha_bytes_per_token"]
        print(f"{name:20s} {c['kv_heads']} KV heads for {c['query_heads']} query heads: "
              f"{kept:,.0f} bytes a token (MHA: {mha:,.0f})")  # fmt: skip
    timed = kernels(args.batch, args.context, args.repeats)
    for way, r in timed.items():
        print(f"{way:14s} {r['ms']:8.2f} ms, {r['kv_bytes_read'] / 2**20:7.1f} MiB of K and V")
    converted = {}
    for model in tqdm(args.models.split(","), desc="converting", unit="model"):
        converted[model] = got = converting(
            model, lambda tok: tok.encode(text)[: args.ppl_tokens], args.ppl_context, args.threads
        )
        print(f"{model:20s} perplexity {got['as_trained']['perplexity']:.2f} with "
              f"{got['as_trained']['kv_heads']} KV heads, {got['one_kv_head']['perplexity']:.2f} "
              f"averaged into one ({got['perplexity_ratio']:.2f}x)")  # fmt: skip
    record = make_record(
        kind="lab.kv_heads",
        engine={"threads": args.threads, "dtype": "bfloat16"},
        model={"ids": args.models.split(",")},
        workload={
            "batch": args.batch,
            "context": args.context,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "repeats": args.repeats,
            "ppl_tokens": args.ppl_tokens,
            "ppl_context": args.ppl_context,
            "text": os.path.relpath(args.text),
        },  # fmt: skip
        results={"caches": cache, "kernels": timed, "converting": converted},
        seeds=[0],
    )
    path = write_record(record, args.out)

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(list(timed), [r["ms"] for r in timed.values()], color="#4477aa")
    a.set(ylabel="ms (median)", title=f"decode attention: {args.batch} x {args.context} tokens, "
          f"{HEADS} query / {KV_HEADS} KV heads")  # fmt: skip
    a.tick_params(axis="x", labelsize=8)
    names = list(converted)
    xs = range(len(names))
    b.bar([x - 0.2 for x in xs], [converted[n]["as_trained"]["perplexity"] for n in names], 0.4,
          label="as trained")  # fmt: skip
    b.bar([x + 0.2 for x in xs], [converted[n]["one_kv_head"]["perplexity"] for n in names], 0.4,
          label="KV heads averaged into one")  # fmt: skip
    b.set(xticks=list(xs), xticklabels=names, ylabel="perplexity", yscale="log")
    b.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
