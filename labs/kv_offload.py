"""Lab: multi-turn chats that outgrow the KV pool, with and without the host tier.

C conversations, each a system prompt of its own and T turns; every turn's prompt is the
whole conversation so far (system prompt, the earlier questions and the answers the model
gave) and a new question. The turns go round the conversations, so by the time one comes
back the others have filled the pool. The pool holds about two conversations; without the
host tier an evicted conversation's prefix is computed again, with it (--kv-offload-gib)
the evicted blocks are copied back from host memory. Both runs are in one process, one
request at a time, on each model.

    python labs/kv_offload.py [--models smollm2-135m] [--conversations 8] [--turns 4]

Writes an evidence record and a PNG (time to first token of the later turns, both ways).
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
from tokenworks.engine.kv_budget import GiB  # noqa: E402
from tokenworks.models import load  # noqa: E402


def chat(llm: LLM, args, vocab: int) -> dict:
    """Every turn of every conversation, round by round: each turn's TTFT, and what the
    engine computed and found."""
    engine, loop = llm.engine, llm.loop
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    history = [latency_prompt(args.system_tokens, vocab, seed=100 + c)
               for c in range(args.conversations)]  # fmt: skip
    ttft: dict[int, list[float]] = {}
    t_all = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.conversations):
            question = latency_prompt(args.question_tokens, vocab, seed=1000 * c + turn)
            prompt = history[c] + question
            t0 = time.perf_counter()
            seq = loop.add_request(prompt, params=params)
            while not seq.output_ids:
                loop.step()
            ttft.setdefault(turn, []).append(time.perf_counter() - t0)
            loop.run_while(engine.has_unfinished)
            history[c] = prompt + seq.output_ids
    host, prefix = engine.blocks.host, engine.blocks.prefix
    return {
        "seconds": time.perf_counter() - t_all,
        "ttft_s_by_turn": {t: statistics.mean(v) for t, v in ttft.items()},
        "ttft_s_later_turns": statistics.mean(x for t, v in ttft.items() if t for x in v),
        "prefill_tokens": engine.totals["prefill_tokens"],
        "prompt_tokens": prefix.queried_tokens,
        "hit_tokens": prefix.hit_tokens,
        "misses": dict(prefix.misses),
        "pool_blocks": engine.blocks.num_blocks,
        "block_bytes": engine.block_bytes,
        "offloaded_blocks": host.offloaded if host else 0,
        "restored_blocks": host.restored if host else 0,
        "host_bytes": host.nbytes if host else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=192)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap,
        fast=dict(
            models="smollm2-135m",
            conversations=3,
            turns=2,
            system_tokens=64,
            question_tokens=8,
            answer_tokens=4,
        ),
    )

    last = args.system_tokens + args.turns * (args.question_tokens + args.answer_tokens)
    rows = {}
    for name in tqdm(args.models.split(","), desc="models"):
        loaded = load(name)
        # one sequence of twice the longest conversation: a pool of about two of them
        kw = dict(loaded=loaded, threads=args.threads, max_num_seqs=1, max_model_len=2 * last,
                  warmup=False)  # fmt: skip
        off = LLM(name, **kw)
        rows[name] = {"without": chat(off, args, loaded.spec.vocab_size)}
        # a tier with room for every conversation's blocks (in every layer group), and a
        # quarter more
        groups = len(off.engine.kv_layout.groups)
        blocks = args.conversations * groups * -(-last // off.engine.config.block_size)
        tier_gib = 1.25 * blocks * off.engine.block_bytes / GiB
        del off
        on = LLM(name, kv_offload_gib=tier_gib, **kw)
        rows[name]["with"] = chat(on, args, loaded.spec.vocab_size)
        rows[name]["kv_offload_gib"] = tier_gib
        del on, loaded

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(rows)
    width = 0.38
    for i, (mode, color) in enumerate((("without", "tab:red"), ("with", "tab:blue"))):
        ax.bar([j + (i - 0.5) * width for j in range(len(names))],
               [1000 * rows[n][mode]["ttft_s_later_turns"] for n in names], width,
               label=f"{mode} the host tier", color=color)  # fmt: skip
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("mean time to first token, turns 2+ (ms)")
    ax.set_title(f"{args.conversations} chats of {args.turns} turns, a pool of about two")
    ax.legend()
    fig.tight_layout()
    png = save_figure(fig, args.out, "lab-kv-offload.png")

    record = make_record(
        kind="lab.kv_offload",
        engine={"threads": args.threads, "max_num_seqs": 1, "max_model_len": 2 * last},
        model={"names": names},
        workload={
            k: getattr(args, k)
            for k in ("conversations", "turns", "system_tokens", "question_tokens", "answer_tokens")
        },  # fmt: skip
        results={"rows": rows, "figure": str(png)},
        seeds=[0],
    )
    path = write_record(record, args.out)
    for name, r in rows.items():
        a, b = r["without"], r["with"]
        print(
            f"{name}: TTFT turns 2+ {1000 * a['ttft_s_later_turns']:.0f} -> "
            f"{1000 * b['ttft_s_later_turns']:.0f} ms; prefill {a['prefill_tokens']} -> "
            f"{b['prefill_tokens']} tokens; restored {b['restored_blocks']} blocks"
        )
    print(f"record {path}, figure {png}")


if __name__ == "__main__":
    main()
