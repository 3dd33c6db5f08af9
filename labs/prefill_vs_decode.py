"""Lab: what a token costs in prefill and in decode, on the real model.

A forward pass reads every weight once, however many tokens it carries. Prefill carries a
whole prompt, so the weight read is shared by P tokens and the pass becomes bound by
arithmetic; a decode step of one sequence carries a single token and pays the whole
weight read for it. Batching decode (B sequences, one token each) shares the read the
same way, which is why continuous batching raises throughput. This lab times single
engine steps:

- prefill: one sequence, a P-token prompt (prefix caching off, so all P are computed);
- decode: B running sequences (64-token prompts), one new token each.

    python labs/prefill_vs_decode.py [--sizes 1,4,16,64,256] [--repeats 5]

Writes an evidence record and a PNG (milliseconds per token and tokens/s against the
tokens in the forward pass).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenworks import LLM  # noqa: E402
from tokenworks.bench.labs import parse_lab_args  # noqa: E402
from tokenworks.bench.latency import decode_step_times, prompt_steps  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402

CONTEXT = 64  # prompt tokens of each decoding sequence


def prefill_step_s(llm: LLM, n: int, seed: int) -> float:
    """Seconds of the single step that prefills an n-token prompt (and samples 1 token)."""
    prompt = latency_prompt(n, llm.engine.spec.vocab_size, seed=seed)
    steps = prompt_steps(llm.loop, prompt)
    assert len(steps) == 1 and steps[0].prefill_tokens == n, "prompt was split across steps"
    return steps[0].duration_s


def decode_step_s(llm: LLM, batch: int, steps: int, seed: int) -> list[float]:
    """Durations of pure decode steps with `batch` sequences in the pass."""
    vocab = llm.engine.spec.vocab_size
    prompts = [latency_prompt(CONTEXT, vocab, seed=seed * 1000 + i) for i in range(batch)]
    return decode_step_times(llm.loop, prompts, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", default="1,4,16,64,256", help="tokens per forward pass")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(sizes="1,16", repeats=1, decode_steps=2))
    sizes = [int(s) for s in args.sizes.split(",")]

    llm = LLM(
        args.model,
        dtype=args.dtype,
        threads=2,
        max_num_seqs=max(sizes),
        max_num_batched_tokens=max(2048, max(sizes)),
        enable_prefix_caching=False,  # every prompt token is computed
        kv_cache_memory=2.0,
    )
    prefill_step_s(llm, 16, seed=99)  # warm-up
    rows = []
    for n in sizes:
        pre = [prefill_step_s(llm, n, seed=r) for r in range(args.repeats)]
        dec = decode_step_s(llm, n, args.decode_steps, seed=n)
        row = {
            "tokens": n,
            "prefill_step_s": pre,
            "decode_step_s": dec,
            "prefill_ms_per_token": 1000 * statistics.median(pre) / n,
            "decode_ms_per_token": 1000 * statistics.median(dec) / n,
        }
        row["prefill_tok_s"] = 1000 / row["prefill_ms_per_token"]
        row["decode_tok_s"] = 1000 / row["decode_ms_per_token"]
        rows.append(row)
        print(
            f"{n:5d} tokens/pass: prefill {row['prefill_ms_per_token']:7.3f} ms/token "
            f"({row['prefill_tok_s']:7.0f} tok/s), decode {row['decode_ms_per_token']:7.3f} "
            f"ms/token ({row['decode_tok_s']:7.0f} tok/s)"
        )
    one, big = rows[0], rows[-1]
    summary = {
        "single_token_step_ms": 1000 * statistics.median(one["decode_step_s"]),
        "prefill_per_token_saving_at_largest": one["decode_ms_per_token"]
        / big["prefill_ms_per_token"],
        "decode_batch_speedup_at_largest": big["decode_tok_s"] / one["decode_tok_s"],
    }
    print(summary)
    record = make_record(
        kind="lab-prefill-vs-decode",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "sizes": sizes,
            "repeats": args.repeats,
            "decode_steps": args.decode_steps,
            "decode_context": CONTEXT,
            "prompts": "latency_prompt(n, vocab, seed)",
        },
        results={"rows": rows, "summary": summary},
        seeds=list(range(args.repeats)),
    )
    path = write_record(record, args.out)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["tokens"] for r in rows]
    for key, label in (("prefill", "prefill: 1 sequence, P tokens"), ("decode", "decode: B seqs")):
        ax1.plot(xs, [r[f"{key}_ms_per_token"] for r in rows], "o-", label=label)
        ax2.plot(xs, [r[f"{key}_tok_s"] for r in rows], "o-", label=label)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens in the forward pass (P or B)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    ax1.set_ylabel("ms per token")
    ax2.set_ylabel("tokens/s")
    fig.suptitle(f"prefill versus decode: {llm.engine.loaded.model_id}, {args.dtype}, 2 threads")
    fig.tight_layout()
    png = Path(args.out) / "lab-prefill-vs-decode.png"
    fig.savefig(png, dpi=100)
    print(f"record: {path}\nplot: {png}")


if __name__ == "__main__":
    main()
