"""Lab: prefix-cache hit rate versus cache size and tenant isolation on the real model.

G groups of requests each share a system prompt of L tokens (different per group); each
request adds its own short question. Requests arrive in a random order, a few at a time.
With room for every group's prefix the cache serves almost every prompt token after the
first request of each group; as the pool shrinks below G x L tokens, LRU eviction throws
prefixes out before their group comes back and the hit rate falls.

Isolation: each request also belongs to one of T tenants, and with a salt per tenant (what
the server does per API key) a tenant finds only the blocks its own requests left. The
same requests run isolated at some of the pool sizes: each group's prefix must now be
computed, and kept, once per tenant.

    python labs/prefix_cache_size.py [--groups 8] [--prefix-tokens 256]

Writes an evidence record and a PNG (hit rate and computed prefill tokens versus pool size).
"""

from __future__ import annotations

import argparse
import random
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402
from tokenworks.models import load  # noqa: E402
from tokenworks.shapes import kv_bytes_per_token  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], concurrency: int, salts=None) -> dict:
    """salts: each request's cache salt (None: one cache shared by all)."""
    engine, loop = llm.engine, llm.loop
    params = SamplingParams(max_tokens=1, temperature=0)
    salts = salts or [None] * len(prompts)
    t = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        for p, salt in zip(prompts[i : i + concurrency], salts[i : i + concurrency], strict=True):
            loop.add_request(p, params=params, cache_salt=salt)
        loop.run_while(engine.has_unfinished)
    prefix = engine.blocks.prefix
    return {
        "elapsed_s": time.perf_counter() - t,
        "hit_rate": prefix.hit_rate,
        "hit_tokens": prefix.hit_tokens,
        "queried_tokens": prefix.queried_tokens,
        "prefill_tokens": engine.totals["prefill_tokens"],
        "evictions": prefix.evictions,
        "misses": dict(prefix.misses),  # requests, by why their prompt first missed
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tenants", type=int, default=4, help="tenants of the isolated runs")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap, fast=dict(groups=2, prefix_tokens=32, requests=8, concurrency=2, tenants=2)
    )

    loaded = load(args.model)
    vocab = loaded.spec.vocab_size
    rng = random.Random(0)
    prefixes = [latency_prompt(args.prefix_tokens, vocab, seed=100 + g) for g in range(args.groups)]
    groups = [rng.randrange(args.groups) for _ in range(args.requests)]
    prompts = [
        prefixes[g] + latency_prompt(args.suffix_tokens, vocab, seed=10_000 + i)
        for i, g in enumerate(groups)
    ]
    bs = args.block_size
    prefix_blocks = args.prefix_tokens // bs
    need_all = args.groups * prefix_blocks
    # the smallest pool must hold one whole request plus the concurrent ones' tails
    floor = (args.prefix_tokens + args.suffix_tokens) // bs + 2 * args.concurrency
    sizes = sorted({max(floor, int(need_all * f)) for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)})
    spec = loaded.spec
    block_bytes = bs * int(kv_bytes_per_token(spec.shape, "bfloat16"))
    salts = [f"tenant-{rng.randrange(args.tenants)}" for _ in prompts]
    results, isolated = [], []
    for n_blocks in tqdm(sizes, desc="pool sizes"):
        # the shared cache at every size; isolated tenants at the sizes that hold all
        # prefixes once or more (below that the shared cache already thrashes)
        for salted in (False, True) if n_blocks >= need_all else (False,):
            llm = LLM(
                args.model,
                dtype="bfloat16",
                loaded=loaded,
                threads=args.threads,
                block_size=bs,
                kv_cache_memory=n_blocks * block_bytes / 1024**3,
            )
            r = run(llm, prompts, args.concurrency, salts if salted else None)
            r.update(num_blocks=llm.engine.blocks.num_blocks,
                     pool_mib=n_blocks * block_bytes / 2**20)  # fmt: skip
            (isolated if salted else results).append(r)
    no_cache_prefill = sum(len(p) for p in prompts)

    record = make_record(
        kind="lab.prefix_cache_size",
        engine={"dtype": "bfloat16", "block_size": bs, "threads": args.threads},
        model={"id": loaded.model_id, "sha256": loaded.file_sha256, "dtype": "bfloat16"},
        workload={
            "groups": args.groups,
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "request_groups": groups,
            "tenants": args.tenants,
            "request_salts": salts,
            "max_tokens": 1,
        },
        results={
            "by_pool_size": results,
            "isolated_by_pool_size": isolated,
            "prefill_tokens_without_cache": no_cache_prefill,
            "blocks_for_all_prefixes": need_all,
        },
        seeds=[0],
    )
    path = write_record(record, args.out)
    fig, ax1 = plt.subplots(figsize=(7, 4))
    xs = [r["num_blocks"] for r in results]
    ax1.plot(xs, [100 * r["hit_rate"] for r in results], "o-", color="tab:blue",
             label="one cache shared")  # fmt: skip
    ax1.plot([r["num_blocks"] for r in isolated], [100 * r["hit_rate"] for r in isolated], "^:",
             color="tab:blue", label=f"a salt per tenant ({args.tenants} tenants)")  # fmt: skip
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_xlabel(f"KV pool size (blocks of {bs} tokens)")
    ax1.set_ylabel("prefix-cache hit rate (% of prompt tokens)", color="tab:blue")
    ax1.axvline(need_all, color="gray", ls="--", lw=1)
    ax1.text(need_all, 5, " all prefixes fit", color="gray")
    ax2 = ax1.twinx()
    ax2.plot(xs, [r["prefill_tokens"] / no_cache_prefill for r in results], "s--", color="tab:red")
    ax2.set_ylabel("prefill tokens computed / without cache", color="tab:red")
    ax1.set_title(
        f"{args.groups} system prompts of {args.prefix_tokens} tokens, {args.requests} requests"
    )
    fig.tight_layout()
    png = save_figure(fig, args.out, path.with_suffix(".png").name)

    for way, rows in (("shared", results), ("isolated", isolated)):
        for r in rows:
            print(
                f"{way:8s} {r['num_blocks']:5d} blocks: hit rate {100 * r['hit_rate']:5.1f}%, "
                f"prefill {r['prefill_tokens']} tokens, evictions {r['evictions']}, misses "
                + ", ".join(f"{why} {n}" for why, n in r["misses"].items() if n)
            )
    print(f"record {path}, figure {png}")


if __name__ == "__main__":
    main()
