"""Lab: speculative decoding, where its guesses pay and where they do not.

Prompt lookup (`--speculative method=ngram`) guesses the next k tokens from the text
already in the context, and the target checks the guesses in one pass. Two workloads of
chat requests run one at a time (batch 1, where decode is memory-bound and a pass of k + 1
rows costs about what a pass of one does):

- copy: edits of given code and text, whose answers repeat much of the prompt;
- free: open-ended stories, with little to copy.

Each runs without speculation and with it, greedy (the tokens are the same: the test suite
holds that); the lab measures generated tokens a second and the acceptance rate, and sets
beside them what `tokenworks plan spec` predicts from that acceptance rate (a draft that
costs nothing: prompt lookup is a search, not a model).

    python labs/speculation.py [--k 4] [--requests 6] [--max-tokens 96]

Writes an evidence record and a PNG (speed-up and acceptance per workload).
"""

from __future__ import annotations

import argparse
import copy
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.bench.speculative_prompts import WORKLOADS  # noqa: E402
from tokenworks.models import load  # noqa: E402
from tokenworks.plan.speculative import speedup  # noqa: E402


def run(llm: LLM, prompts: list[str], max_tokens: int) -> dict:
    """The prompts one at a time: seconds, tokens, and the speculator's counts."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    spec = llm.engine.speculator
    before = copy.deepcopy(spec.metrics) if spec else None
    tokens, seconds = [], 0.0
    for prompt in prompts:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - t0
        tokens.append(out.outputs[0].token_ids)
    row = {"seconds": seconds, "generated_tokens": sum(map(len, tokens)), "tokens": tokens}
    row["tok_s"] = row["generated_tokens"] / seconds
    if spec:  # this run's counts: the running totals less those before it
        m = spec.metrics
        drafts = m.num_draft_tokens - before.num_draft_tokens
        accepted = m.num_accepted_tokens - before.num_accepted_tokens
        proposals = m.num_drafts - before.num_drafts
        emitted = m.num_emitted_tokens - before.num_emitted_tokens
        row["draft_tokens"] = drafts
        row["acceptance_rate"] = accepted / drafts if drafts else None
        row["mean_accepted_length"] = emitted / proposals if proposals else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=4, help="tokens guessed a step")
    ap.add_argument("--requests", type=int, default=6, help="of each workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(requests=1, max_tokens=16))

    loaded = load(args.model)
    common = dict(loaded=loaded, dtype="bfloat16", threads=args.threads, max_num_seqs=1)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config={"method": "ngram", "num_speculative_tokens":
               args.k, "adaptive": False}, **common)  # fmt: skip
    rows = {}
    for name, workload in WORKLOADS.items():
        prompts = [plain.render_chat(c) for c in workload()[: args.requests]]
        off, on = run(plain, prompts, args.max_tokens), run(spec, prompts, args.max_tokens)
        same = off.pop("tokens") == on.pop("tokens")
        alpha = on.get("acceptance_rate") or 0.0
        rows[name] = {
            "without": off, "with": on, "same_tokens": same,
            "speedup": on["tok_s"] / off["tok_s"],
            "plan_speedup": speedup(alpha, args.k, 0.0),
        }  # fmt: skip
    model = model_record(plain)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.5))
    names = list(rows)
    ax1.bar([i - 0.2 for i in range(len(names))], [rows[n]["speedup"] for n in names], 0.4,
            label="measured")  # fmt: skip
    ax1.bar([i + 0.2 for i in range(len(names))], [rows[n]["plan_speedup"] for n in names], 0.4,
            label="plan spec (a ceiling)")  # fmt: skip
    ax1.axhline(1, color="grey", lw=0.8)
    ax1.set_xticks(range(len(names)), names)
    ax1.set_title(f"speed-up with k = {args.k}")
    ax1.legend(fontsize=8)
    ax2.bar(names, [rows[n]["with"].get("acceptance_rate") or 0 for n in names])
    ax2.set_title("acceptance rate")
    fig.tight_layout()
    png = save_figure(fig, args.out, "lab-speculation.png")

    record = make_record(
        kind="lab.speculation",
        engine={"dtype": "bfloat16", "threads": args.threads, "max_num_seqs": 1,
                "speculative": {"method": "ngram", "num_speculative_tokens": args.k}},
        model=model,
        workload={"workloads": names, "requests": args.requests, "max_tokens": args.max_tokens,
                  "temperature": 0},
        results={"rows": rows, "figure": str(png)},
        seeds=[0],
    )  # fmt: skip
    path = write_record(record, args.out)
    for name, r in rows.items():
        print(f"{name}: {r['without']['tok_s']:.1f} -> {r['with']['tok_s']:.1f} tok/s "
              f"({r['speedup']:.2f}x; plan spec says at most {r['plan_speedup']:.2f}x), "
              f"acceptance {r['with'].get('acceptance_rate') or 0:.2f}, "
              f"same tokens: {r['same_tokens']}")  # fmt: skip
    print(f"record {path}, figure {png}")


if __name__ == "__main__":
    main()
