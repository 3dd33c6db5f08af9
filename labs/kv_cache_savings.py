"""Lab: what the KV cache saves, and what it costs, on the real model.

Without a cache, every new token needs a forward pass over the whole sequence so far (the
keys and values of earlier tokens are recomputed), so the n-th token costs a prefill of
the context and generating N tokens costs a sum that grows with the square of N. With the
cache, a decode step computes only the new token and reads the stored keys and values: its
cost hardly grows with the context. The price is memory: bytes per token of context, per
sequence.

- with the cache: one sequence decodes from a short prompt; every step is timed with the
  context it ran at;
- without: the same contexts prefilled from scratch (prefix caching off), which is what
  each token would cost with nothing kept.

    python labs/kv_cache_savings.py [--prompt 32] [--tokens 480]

Writes an evidence record and a PNG (ms per generated token against the context, and the
cumulative time to generate N tokens).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args  # noqa: E402
from tokenworks.bench.latency import prompt_steps  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402


def decode_with_cache(llm: LLM, prompt: list[int], n: int) -> list[tuple[int, float]]:
    """(context, seconds) of each decode step as one sequence generates n tokens."""
    engine, loop = llm.engine, llm.loop
    engine.stats.clear()
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    loop.add_request(prompt, params=params)
    loop.run_while(engine.has_unfinished)
    steps = list(engine.stats)
    assert steps[0].prefill_tokens == len(prompt)
    # step k (k >= 1) computes token k + 1 over a context of len(prompt) + k tokens
    return [(len(prompt) + k, s.duration_s) for k, s in enumerate(steps[1:], start=1)]


def recompute_s(llm: LLM, prompt: list[int], repeats: int) -> float:
    """Median seconds of one forward pass over the whole prompt: a token without a cache."""
    times = [sum(s.duration_s for s in prompt_steps(llm.loop, prompt)) for _ in range(repeats)]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=480, help="tokens to generate")
    ap.add_argument("--points", type=int, default=12, help="contexts timed without a cache")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(prompt=16, tokens=32, points=3, repeats=1))

    llm = LLM(
        args.model,
        dtype=args.dtype,
        threads=2,
        max_num_seqs=1,
        enable_prefix_caching=False,  # "without a cache" must recompute everything
    )
    engine = llm.engine
    full = latency_prompt(args.prompt + args.tokens, engine.spec.vocab_size, seed=7)
    recompute_s(llm, full[:16], 1)  # warm-up
    cached = decode_with_cache(llm, full[: args.prompt], args.tokens)
    contexts = np.linspace(args.prompt, args.prompt + args.tokens - 1, args.points).astype(int)
    uncached = [(int(c), recompute_s(llm, full[:c], args.repeats)) for c in contexts]

    # cumulative time to generate N tokens: the cached steps as measured; without a cache,
    # each token's pass over its context, interpolated between the measured contexts
    ctx = np.array([c for c, _ in cached])
    with_cache = np.cumsum([t for _, t in cached])
    without = np.cumsum(np.interp(ctx, [c for c, _ in uncached], [t for _, t in uncached]))
    per_token_bytes = engine.kv_bytes_per_token
    last_ctx = int(ctx[-1])
    summary = {
        "tokens_generated": len(ctx),
        "with_cache_total_s": float(with_cache[-1]),
        "without_cache_total_s": float(without[-1]),
        "speedup_total": float(without[-1] / with_cache[-1]),
        "cached_step_ms_at_first": 1000 * float(np.median([t for _, t in cached[:16]])),
        "cached_step_ms_at_last": 1000 * float(np.median([t for _, t in cached[-16:]])),
        "uncached_token_ms_at_last": 1000 * uncached[-1][1],
        "kv_bytes_per_token": per_token_bytes,
        "kv_bytes_at_last_context": per_token_bytes * last_ctx,
        "last_context": last_ctx,
    }
    for k, v in summary.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    record = make_record(
        kind="lab-kv-cache-savings",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "prompt_tokens": args.prompt,
            "generated_tokens": args.tokens,
            "uncached_contexts": [int(c) for c in contexts],
            "repeats": args.repeats,
            "prompt_ids": "latency_prompt(prompt + tokens, vocab, seed=7)",
        },
        results={
            "cached_steps": [{"context": c, "s": t} for c, t in cached],
            "uncached": [{"context": c, "s": t} for c, t in uncached],
            "summary": summary,
        },
        seeds=[7],
    )
    path = write_record(record, args.out)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(ctx, [1000 * t for _, t in cached], ".", ms=3, alpha=0.5, label="with KV cache")
    ax1.plot([c for c, _ in uncached], [1000 * t for _, t in uncached], "o-", label="recomputed")
    ax1.set_xlabel("context (tokens)")
    ax1.set_ylabel("ms per generated token")
    ax1.legend()
    ax1.grid(alpha=0.3)
    n = np.arange(1, len(ctx) + 1)
    ax2.plot(n, with_cache, label="with KV cache")
    ax2.plot(n, without, label="recomputed (interpolated)")
    ax2.set_xlabel("tokens generated")
    ax2.set_ylabel("cumulative seconds")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(
        f"what the KV cache saves: {summary['speedup_total']:.1f}x over {len(ctx)} tokens, "
        f"for {per_token_bytes * last_ctx / 2**20:.1f} MiB of cache at {last_ctx} tokens"
    )
    fig.tight_layout()
    png = Path(args.out) / "lab-kv-cache-savings.png"
    fig.savefig(png, dpi=100)
    print(f"record: {path}\nplot: {png}")


if __name__ == "__main__":
    main()
