"""Lab: the roofline's prediction beside the engine's measured speed, on this machine.

`tokenworks.plan.probe` measures this CPU (a weight-streaming bf16 matrix-vector product
for bandwidth, square products for FLOP/s); `plan.roofline` turns that and SmolLM2-135M's
shape into ceilings; then the engine runs the same three cases in the same process:

- single-stream decode (batch 1, a 16-token prompt and 128 new tokens): memory-bound,
  every weight read once per token;
- prefill of a 512-token prompt: compute-bound;
- batched decode (64 sequences of 128-token prompts, one token each per step).

The record holds the probe, the ceilings and the measured figures; the efficiency is
measured / ceiling. Peers' figures from the newest latency record are put beside them.

    python labs/plan_vs_measured.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenworks import LLM  # noqa: E402
from tokenworks.bench.labs import parse_lab_args  # noqa: E402
from tokenworks.bench.latency import decode_step_times, measure_tokenworks  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402
from tokenworks.plan.models import get_model  # noqa: E402
from tokenworks.plan.probe import probe  # noqa: E402
from tokenworks.plan.quant import parse_scheme  # noqa: E402
from tokenworks.plan.roofline import decode, prefill  # noqa: E402

PROMPT, SHORT, BATCH = 512, 16, 64


def batched_decode_tok_s(llm: LLM, batch_prompt: int, steps: int = 12) -> float:
    """Tokens/s of pure decode steps with BATCH sequences of batch_prompt tokens."""
    vocab = llm.engine.spec.vocab_size
    prompts = [latency_prompt(batch_prompt, vocab, seed=50 + i) for i in range(BATCH)]
    return BATCH / statistics.median(decode_step_times(llm.loop, prompts, steps))


def newest_peer_latency(results: Path) -> tuple[str | None, dict]:
    records = sorted(results.glob("latency-*.json"))
    for path in reversed(records):
        r = json.loads(path.read_text())
        s = r.get("results", {}).get("summary_median", {})
        if len(s) > 1:
            return path.name, {k: v for k, v in s.items() if k != "tokenworks"}
    return None, {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128, help="of the batch-1 decode")
    ap.add_argument("--batch-prompt", type=int, default=128, help="tokens of each of 64")
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(repeats=1, decode_tokens=16, batch_prompt=16))
    new, batch_prompt = args.decode_tokens, args.batch_prompt

    hw = probe(threads=args.threads)
    shape, bf16 = get_model(args.model), parse_scheme("bf16")
    ceilings = {
        "decode_1": decode(shape, hw, bf16, batch=1, context=SHORT + new // 2),
        "prefill_512": prefill(shape, hw, bf16, prompt=PROMPT),
        "decode_64": decode(shape, hw, bf16, batch=BATCH, context=batch_prompt + 6),
    }
    llm = LLM(
        args.model,
        dtype="bfloat16",
        threads=args.threads,
        enable_prefix_caching=False,
        max_num_seqs=BATCH,
    )
    prompt = latency_prompt(PROMPT, llm.engine.spec.vocab_size)
    ours = measure_tokenworks(llm, prompt, prompt[:SHORT], new, args.repeats)
    measured = {
        "decode_1": statistics.median(ours["decode_tok_s"]),
        "prefill_512": statistics.median(ours["prefill_tok_s"]),
        "decode_64": batched_decode_tok_s(llm, batch_prompt),
    }
    rows = {}
    for case, c in ceilings.items():
        rows[case] = {
            "ceiling_tok_s": c.tokens_per_s,
            "bound": c.bound,
            "measured_tok_s": measured[case],
            "efficiency": measured[case] / c.tokens_per_s,
            "ceiling": c.to_dict(),
        }
        print(
            f"{case:12s} ceiling {c.tokens_per_s:8.0f} tok/s ({c.bound}-bound), measured "
            f"{measured[case]:8.1f} tok/s: {100 * measured[case] / c.tokens_per_s:5.1f}%"
        )
    peer_record, peers = newest_peer_latency(Path(args.out))
    record = make_record(
        kind="lab-plan-vs-measured",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "prompt_tokens": PROMPT,
            "short_prompt_tokens": SHORT,
            "decode_tokens": new,
            "batch": BATCH,
            "batch_prompt_tokens": batch_prompt,
            "threads": args.threads,
        },
        results={
            "probe": {**hw.measured, "bandwidth_used": hw.bandwidth, "flops": hw.flops},
            "cases": rows,
            "peers_from_record": {"record": peer_record, "summary_median": peers},
        },
        seeds=[0],
    )
    path = write_record(record, args.out)

    fig, ax = plt.subplots(figsize=(8, 4))
    cases = list(rows)
    x = range(len(cases))
    ax.bar([i - 0.2 for i in x], [rows[c]["ceiling_tok_s"] for c in cases], 0.4,
           label="roofline ceiling (probe)")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [rows[c]["measured_tok_s"] for c in cases], 0.4,
           label="tokenworks, measured")  # fmt: skip
    for i, c in enumerate(cases):
        ax.annotate(f"{100 * rows[c]['efficiency']:.0f}%", (i + 0.2, rows[c]["measured_tok_s"]),
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(list(x), [f"{c}\n({rows[c]['bound']}-bound)" for c in cases])
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    ax.set_title(f"prediction vs measurement: {shape.name}, bf16, {args.threads} threads")
    fig.tight_layout()
    png = Path(args.out) / "lab-plan-vs-measured.png"
    fig.savefig(png, dpi=100)
    print(f"record: {path}\nplot: {png}")


if __name__ == "__main__":
    main()
