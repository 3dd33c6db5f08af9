"""Lab: static versus continuous batching on the real model.

Static batching (what a plain `model.generate` over a padded batch does) starts the next
batch only when every sequence of the current one has finished, so short answers wait for
the longest. Continuous batching refills a slot the step after it frees. Same requests,
same engine, same batch cap; only the admission rule differs.

    python labs/static_vs_continuous.py [--requests 32] [--batch 8]

Writes an evidence record and a PNG (batch occupancy per step, throughput) to --out.
"""

from __future__ import annotations

import argparse
import random
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402


def run(llm: LLM, prompts, params, batch: int, static: bool) -> dict:
    engine = llm.engine
    engine.stats.clear()
    t = time.perf_counter()
    if static:
        for i in range(0, len(prompts), batch):
            for p, sp in zip(prompts[i : i + batch], params[i : i + batch], strict=True):
                engine.add_request(prompt_token_ids=p, params=sp)
            while engine.has_unfinished():
                engine.step()
    else:
        for p, sp in zip(prompts, params, strict=True):
            engine.add_request(prompt_token_ids=p, params=sp)
        while engine.has_unfinished():
            engine.step()
    elapsed = time.perf_counter() - t
    stats = list(engine.stats)
    generated = sum(sp.max_tokens for sp in params)
    return {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "output_tok_s": generated / elapsed,
        "steps": len(stats),
        "batch_sizes": [s.batch_size for s in stats],
        "mean_batch_size": sum(s.batch_size for s in stats) / len(stats),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--min-output", type=int, default=8)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap, fast=dict(requests=6, batch=2, prompt_tokens=16, min_output=2, max_output=8)
    )

    llm = LLM(args.model, dtype="bfloat16", threads=args.threads, max_num_seqs=args.batch)
    vocab = llm.engine.spec.vocab_size
    rng = random.Random(0)
    prompts = [latency_prompt(args.prompt_tokens, vocab, seed=i) for i in range(args.requests)]
    lengths = [rng.randint(args.min_output, args.max_output) for _ in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    results = {
        "static": run(llm, prompts, params, args.batch, static=True),
        "continuous": run(llm, prompts, params, args.batch, static=False),
    }
    speedup = results["continuous"]["output_tok_s"] / results["static"]["output_tok_s"]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    for name, r in results.items():
        ax1.plot(r["batch_sizes"], label=f"{name} ({r['steps']} steps)", lw=1)
    ax1.set_xlabel("engine step")
    ax1.set_ylabel("sequences in the forward pass")
    ax1.set_title(f"{args.requests} requests, outputs {args.min_output}-{args.max_output} tokens")
    ax1.legend()
    names = list(results)
    ax2.bar(names, [results[n]["output_tok_s"] for n in names], color=["tab:gray", "tab:blue"])
    ax2.set_ylabel("output tokens / s")
    ax2.set_title(f"continuous / static = {speedup:.2f}x")
    fig.tight_layout()
    png = save_figure(fig, args.out, "lab-static-vs-continuous.png")

    loaded = llm.engine.loaded
    record = make_record(
        kind="lab.static_vs_continuous",
        engine=llm.config.to_dict(),
        model={"id": loaded.model_id, "sha256": loaded.file_sha256, "dtype": "bfloat16"},
        workload={
            "requests": args.requests,
            "batch": args.batch,
            "prompt_tokens": args.prompt_tokens,
            "output_lengths": lengths,
            "prompt_seeds": list(range(args.requests)),
            "eos": "ignored",
        },
        results={**results, "continuous_over_static": speedup, "figure": str(png)},
        seeds=[0],
    )
    path = write_record(record, args.out)
    print(
        f"static {results['static']['output_tok_s']:.1f} tok/s, continuous "
        f"{results['continuous']['output_tok_s']:.1f} tok/s ({speedup:.2f}x); {path}, {png}"
    )


if __name__ == "__main__":
    main()
