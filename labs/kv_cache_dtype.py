"""Lab: an 8-bit KV cache against the model's dtype, in the same memory.

Each catalogue model gets the same KV budget four ways: bfloat16 with the C kernels (the
default engine), bfloat16 on the torch attention, and int8 and fp8 e4m3 (on the C
kernels too, which read and write the 8-bit rows in place). R requests of P prompt
tokens and G generated tokens run offline together, as many at a time as the pool holds:
the most sequences that ran at once is what the budget held, and generated tokens a
second is the throughput: the median of R rounds, the setups taking turns within each
round, so that a slow minute on a shared machine falls on every setup alike.

    python labs/kv_cache_dtype.py [--models smollm2-135m] [--budget-gib 0.025]

Writes an evidence record and a PNG (sequences held and throughput, per model and format).
"""

from __future__ import annotations

import argparse
import statistics
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

SETUPS = {  # name -> engine options
    "bf16-c": {"kv_cache_dtype": "auto"},
    "bf16-torch": {"kv_cache_dtype": "auto", "kernels": "torch"},
    "int8": {"kv_cache_dtype": "int8"},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
}


def run(llm: LLM, prompts: list[list[int]], generate: int) -> dict:
    """One round of the workload on one engine."""
    engine = llm.engine
    params = SamplingParams(max_tokens=generate, temperature=0, ignore_eos=True)
    preempted = engine.totals["preemptions"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "pool_blocks": engine.blocks.num_blocks,
        "block_bytes": engine.block_bytes,
        "pool_bytes": engine.pool.nbytes,
        "most_running": max(s.num_running for s in engine.stats),
        "preemptions": engine.totals["preemptions"] - preempted,
        "generated_tokens": generated,
        "seconds": seconds,
        "tok_s": generated / seconds,
        "kernels": engine.kernels(),
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    ap.add_argument("--budget-gib", type=float, default=0.025)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--generate", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="the setups take turns R times")
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap, fast=dict(models="smollm2-135m", requests=4, prompt_tokens=32, generate=4, rounds=1)
    )

    rows = {}
    for name in tqdm(args.models.split(","), desc="models"):
        loaded = load(name)
        prompts = [latency_prompt(args.prompt_tokens, loaded.spec.vocab_size, seed=i)
                   for i in range(args.requests)]  # fmt: skip
        # every setup's engine, each warmed up (the first touch of the weights untimed);
        # no prefix cache, or a pool that kept a round's prompts would skip the next's
        llms = {
            setup: LLM(
                name,
                loaded=loaded,
                dtype="bfloat16",
                threads=args.threads,
                kv_cache_memory=args.budget_gib,
                max_num_seqs=args.requests,
                enable_prefix_caching=False,
                **options,
            )
            for setup, options in SETUPS.items()
        }
        rounds = {setup: [] for setup in SETUPS}
        for _ in range(args.rounds):
            for setup, llm in llms.items():
                rounds[setup].append(run(llm, prompts, args.generate))
        rows[name] = {}
        bf16_c = statistics.median(x["tok_s"] for x in rounds["bf16-c"])
        for setup, options in SETUPS.items():
            rows[name][setup] = r = rounds[setup][0]
            r["tok_s_rounds"] = [x["tok_s"] for x in rounds[setup]]
            r["tok_s"] = statistics.median(r["tok_s_rounds"])
            # beside it, what `tokenworks plan kv --kv-dtype` counts a token (no scales)
            kind = {"auto": "bf16", "int8": "int8", "fp8_e4m3": "fp8"}[options["kv_cache_dtype"]]
            r["plan_kv_bytes_per_token"] = kv_bytes_per_token(loaded.spec.shape, kind)
            r["pool_bytes_per_token"] = r["pool_bytes"] / (
                r["pool_blocks"] * llms[setup].engine.blocks.block_size
            )
            r["tok_s_vs_bf16_c"] = r["tok_s"] / bf16_c
        del llms
        base = rows[name]["bf16-torch"]["tokens"]
        for r in rows[name].values():  # greedy tokens equal to bfloat16's, position by position
            same = sum(a == b for x, y in zip(base, r.pop("tokens"), strict=True)
                       for a, b in zip(x, y, strict=True))  # fmt: skip
            r["tokens_as_bf16"] = same / (args.requests * args.generate)
        del loaded

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names, width = list(rows), 0.2
    for i, setup in enumerate(SETUPS):
        xs = [j + (i - 1.5) * width for j in range(len(names))]
        ax1.bar(xs, [rows[n][setup]["most_running"] for n in names], width, label=setup)
        ax2.bar(xs, [rows[n][setup]["tok_s"] for n in names], width, label=setup)
    for ax, title in ((ax1, "sequences running at once"), (ax2, "generated tokens / s")):
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_title(title)
    ax1.legend(fontsize=8)
    fig.suptitle(f"the same {args.budget_gib} GiB of KV cache; {args.requests} requests of "
                 f"{args.prompt_tokens} + {args.generate} tokens")  # fmt: skip
    fig.tight_layout()
    png = save_figure(fig, args.out, "lab-kv-cache-dtype.png")

    record = make_record(
        kind="lab.kv_cache_dtype",
        engine={
            "dtype": "bfloat16",
            "prefix_caching": False,
            "threads": args.threads,
            "kv_cache_memory": args.budget_gib,
            "setups": SETUPS,
        },  # fmt: skip
        model={"names": names},
        workload={k: getattr(args, k) for k in ("requests", "prompt_tokens", "generate", "rounds")},
        results={"rows": rows, "figure": str(png)},
        seeds=[0],
    )
    path = write_record(record, args.out)
    for name, by in rows.items():
        for setup, r in by.items():
            print(f"{name} {setup}: {r['most_running']} at once, {r['tok_s']:.1f} tok/s "
                  f"({r['tok_s_vs_bf16_c']:.2f}x bf16-c), "
                  f"{100 * r['tokens_as_bf16']:.0f}% of tokens as bf16")  # fmt: skip
    print(f"record {path}, figure {png}")


if __name__ == "__main__":
    main()
