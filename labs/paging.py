"""Lab: what block tables buy. The same KV memory, handed out two ways.

R requests whose lengths (prompt + output) are drawn between MIN and MAX tokens run
offline in one KV budget, twice:

- paged: blocks of 16 tokens, taken as a sequence grows (the engine's default);
- contiguous: one block of MAX tokens a sequence (--block-size MAX), which is what an
  allocator without block tables must reserve for a sequence that may grow to MAX.

Measured after every step: the sequences running (their mean over the run), and the share
of the slots in their blocks that hold a token; and over the run, preemptions and generated
tokens a second. Beside them, `tokenworks plan paging` on the same lengths says how many
more sequences paging should fit (the ratio of the bytes each way reserves). The engine
admits a sequence when its prompt fits, as vLLM does, so a paged pool can run out as its
sequences grow: it then preempts one, to be computed again later, which costs throughput.

    python labs/paging.py [--requests 48] [--min-len 32] [--max-len 256] [--budget-tokens 4096]

Writes an evidence record and a PNG (sequences held and throughput, each way).
"""

from __future__ import annotations

import argparse
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402
from tokenworks.engine.loop import LocalInbox  # noqa: E402
from tokenworks.models import load  # noqa: E402
from tokenworks.plan.batching import compare_paging, lengths  # noqa: E402
from tokenworks.shapes import kv_bytes_per_token  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> dict:
    """Every request at once, stepped to the end; after each step, the sequences running
    and the share of the slots in their blocks that hold a token."""
    engine, loop = llm.engine, llm.loop
    for prompt, n in zip(prompts, outputs, strict=True):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        loop.add_request(prompt, params=params)
    running, held, slots = [], 0, 0
    preempted = engine.totals["preemptions"]
    t0 = time.perf_counter()
    for _ in loop.turns(LocalInbox(), engine.has_unfinished):
        live = engine.scheduler.running
        running.append(len(live))
        held += sum(seq.num_tokens for seq in live)
        slots += (engine.blocks.num_blocks - engine.blocks.num_free) * engine.blocks.block_size
    seconds = time.perf_counter() - t0
    generated = sum(outputs)
    return {
        "block_size": engine.blocks.block_size,
        "pool_blocks": engine.blocks.num_blocks,
        "pool_tokens": engine.blocks.num_blocks * engine.blocks.block_size,
        "most_running": max(running),
        "mean_running": sum(running) / len(running),
        "slots_used": held / slots if slots else None,  # tokens held / slots in their blocks
        "steps": len(running),
        "preemptions": engine.totals["preemptions"] - preempted,
        "generated_tokens": generated,
        "seconds": seconds,
        "tok_s": generated / seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=32, help="shortest prompt + output")
    ap.add_argument("--max-len", type=int, default=256, help="longest: the contiguous reserve")
    ap.add_argument("--budget-tokens", type=int, default=4096, help="the pool, in tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(requests=8, min_len=16, max_len=64, budget_tokens=256))

    loaded = load(args.model)
    totals = lengths(args.requests, args.min_len, args.max_len, args.seed)
    # a quarter of each sequence is its prompt, the rest generated (at least one token)
    prompt_lens = [max(1, n // 4) for n in totals]
    outputs = [n - p for n, p in zip(totals, prompt_lens, strict=True)]
    prompts = [latency_prompt(p, loaded.spec.vocab_size, seed=i) for i, p in enumerate(prompt_lens)]
    per_token = kv_bytes_per_token(loaded.spec.shape, "bf16")
    budget_gib = args.budget_tokens * per_token / 2**30
    ways = {"paged": 16, "contiguous": args.max_len}
    rows = {}
    for way, block in ways.items():
        llm = LLM(args.model, loaded=loaded, dtype="bfloat16", threads=args.threads,
                  block_size=block, max_model_len=args.max_len, kv_cache_memory=budget_gib,
                  max_num_seqs=args.requests, enable_prefix_caching=False)  # fmt: skip
        rows[way] = run(llm, prompts, outputs)
        model = model_record(llm)
        del llm
    plan = compare_paging(totals, args.max_len, 16, per_token)
    measured = rows["paged"]["mean_running"] / rows["contiguous"]["mean_running"]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.5))
    ax1.bar(list(rows), [r["mean_running"] for r in rows.values()], color=["C0", "C1"])
    ax1.set_title("sequences running, mean over steps")
    ax2.bar(list(rows), [r["tok_s"] for r in rows.values()], color=["C0", "C1"])
    ax2.set_title("generated tokens / s")
    fig.suptitle(f"{args.model}: {args.budget_tokens} tokens of KV, {args.requests} requests of "
                 f"{args.min_len} to {args.max_len} tokens")  # fmt: skip
    fig.tight_layout()
    png = save_figure(fig, args.out, "lab-paging.png")

    record = make_record(
        kind="lab.paging",
        engine={"dtype": "bfloat16", "threads": args.threads, "budget_tokens": args.budget_tokens,
                "block_sizes": ways, "max_model_len": args.max_len, "prefix_caching": False},
        model=model,
        workload={k: getattr(args, k) for k in ("requests", "min_len", "max_len", "seed")},
        results={"rows": rows, "plan": plan, "sequences_ratio": measured, "figure": str(png)},
        seeds=[args.seed],
    )  # fmt: skip
    path = write_record(record, args.out)
    for way, r in rows.items():
        print(f"{way} (blocks of {r['block_size']}): {r['mean_running']:.1f} sequences running "
              f"(at most {r['most_running']}), {100 * r['slots_used']:.0f}% of their slots "
              f"used, {r['tok_s']:.1f} tok/s, {r['preemptions']} preemptions")  # fmt: skip
    print(f"paged runs {measured:.2f}x the sequences; plan paging predicts "
          f"{plan['sequences_ratio']:.2f}x")  # fmt: skip
    print(f"record {path}, figure {png}")


if __name__ == "__main__":
    main()
