"""Lab: static versus continuous batching on the real model.

Static batching (what a plain `model.generate` over a padded batch does) starts the next
batch only when every sequence of the current one has finished, so short answers wait for
the longest. Continuous batching refills a slot the step after it frees. Same requests,
same engine, same batch cap; only the admission rule differs. Two experiments:

- offline: every request there at the start; output tokens a second, and the batch's
  occupancy step by step;
- under load: the requests arrive one by one (a Poisson process, seeded) at four offered
  loads, a quarter of to all of what continuous batching completes offline. Per request,
  the time to its first token and to its end; goodput, the requests a second whose first
  token came within --slo-ttft-s; and wasted work, the seat-steps a batch left empty
  while a request that had arrived waited for it.

    python labs/static_vs_continuous.py [--requests 32] [--batch 8]

Writes an evidence record and a PNG (batch occupancy per step, throughput, and latency,
goodput and empty seats against the offered load) to --out.
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
    engine, loop = llm.engine, llm.loop
    engine.stats.clear()
    t = time.perf_counter()
    if static:
        for i in range(0, len(prompts), batch):
            for p, sp in zip(prompts[i : i + batch], params[i : i + batch], strict=True):
                loop.add_request(p, params=sp)
            loop.run_while(engine.has_unfinished)
    else:
        for p, sp in zip(prompts, params, strict=True):
            loop.add_request(p, params=sp)
        loop.run_while(engine.has_unfinished)
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


def under_load(llm: LLM, prompts, params, batch: int, static: bool, rate: float) -> dict:
    """The requests arriving at `rate` a second (Poisson, seeded): each one's seconds to
    its first token and to its end, and the empty seat-steps while one waited."""
    engine, loop = llm.engine, llm.loop
    rng = random.Random(1)
    arrivals, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(rate)
        arrivals.append(t)
    pending = list(range(len(prompts)))  # arrived or not, not yet given to the engine
    seqs, first, done, empty = {}, {}, {}, 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        arrived = [i for i in pending if arrivals[i] <= now]
        if arrived and (not static or not engine.has_unfinished()):
            for i in arrived[:batch] if static else arrived:
                seqs[i] = loop.add_request(prompts[i], params=params[i])
                pending.remove(i)
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(arrivals[i] for i in pending) - now))
            continue
        loop.step()
        s = engine.stats[-1]
        waiting = len([i for i in pending if arrivals[i] <= now]) + s.num_waiting  # at its start
        now = time.perf_counter() - start
        empty += min(batch - s.batch_size, waiting)
        for i, seq in seqs.items():
            if i not in first and seq.output_ids:
                first[i] = now - arrivals[i]
            if i not in done and seq.finished:
                done[i] = now - arrivals[i]
    ttft, e2e = [first[i] for i in sorted(first)], [done[i] for i in sorted(done)]
    span = max(arrivals[i] + done[i] for i in done)
    return {"ttft_s": ttft, "e2e_s": e2e, "empty_seat_steps": empty, "span_s": span}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--min-output", type=int, default=8)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--loads", default="0.25,0.5,0.75,1.0",
                    help="offered loads, as fractions of the offline continuous rate")  # fmt: skip
    ap.add_argument("--slo-ttft-s", type=float, default=0.5, help="goodput's bound on TTFT")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap, fast=dict(requests=6, batch=2, prompt_tokens=16, min_output=2, max_output=8,
                      loads="0.5,1.0"),
    )  # fmt: skip

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
    capacity = args.requests / results["continuous"]["elapsed_s"]  # requests a second
    loads = {}
    for fraction in [float(x) for x in args.loads.split(",")]:
        row = loads[f"load_{fraction:g}"] = {"fraction": fraction, "rate": fraction * capacity}
        for name in ("static", "continuous"):
            got = under_load(llm, prompts, params, args.batch, name == "static", row["rate"])
            met = sum(x <= args.slo_ttft_s for x in got["ttft_s"])
            row[name] = got | {
                "mean_ttft_s": sum(got["ttft_s"]) / len(got["ttft_s"]),
                "mean_e2e_s": sum(got["e2e_s"]) / len(got["e2e_s"]),
                "goodput_req_s": met / got["span_s"],
                "slo_met": met / len(got["ttft_s"]),
            }
        said = [
            f"{n} TTFT {r['mean_ttft_s']:.2f} s, end {r['mean_e2e_s']:.2f} s, "
            f"{r['slo_met']:.0%} within the SLO, {r['empty_seat_steps']} empty seat-steps"
            for n, r in ((n, row[n]) for n in ("static", "continuous"))
        ]
        print(f"load {fraction:4.2f} ({row['rate']:.1f} req/s): " + "; ".join(said))

    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(11, 7.5),
                                                 gridspec_kw={"width_ratios": [3, 2]})  # fmt: skip
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
    fractions = [r["fraction"] for r in loads.values()]
    for name, colour in (("static", "tab:gray"), ("continuous", "tab:blue")):
        ax3.plot(fractions, [r[name]["mean_ttft_s"] for r in loads.values()], "o-", color=colour,
                 label=f"{name}: time to first token")  # fmt: skip
        ax3.plot(fractions, [r[name]["mean_e2e_s"] for r in loads.values()], "s--", color=colour,
                 label=f"{name}: time to the end")  # fmt: skip
        ax4.plot(fractions, [r[name]["goodput_req_s"] for r in loads.values()], "o-",
                 color=colour, label=name)  # fmt: skip
    ax3.set(xlabel="offered load (of the offline continuous rate)", ylabel="seconds (mean)",
            title="latency under load")  # fmt: skip
    ax3.legend(fontsize=7)
    ax4.set(xlabel="offered load", ylabel="requests/s within the TTFT bound",
            title=f"goodput (TTFT <= {args.slo_ttft_s:g} s)")  # fmt: skip
    ax4.legend(fontsize=8)
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
            "loads": args.loads,
            "arrivals": "Poisson, random.Random(1)",
            "slo_ttft_s": args.slo_ttft_s,
        },
        results={
            **results,
            "continuous_over_static": speedup,
            "capacity_req_s": capacity,
            "under_load": loads,
            "figure": str(png),
        },  # fmt: skip
        seeds=[0],
    )
    path = write_record(record, args.out)
    print(
        f"static {results['static']['output_tok_s']:.1f} tok/s, continuous "
        f"{results['continuous']['output_tok_s']:.1f} tok/s ({speedup:.2f}x); {path}, {png}"
    )


if __name__ == "__main__":
    main()
