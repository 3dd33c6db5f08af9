"""Lab: what chunked prefill and the queue's order do to fairness, on the real model.

Two experiments on SmolLM2-135M, stepping the engine in process:

- chunked prefill: eight short requests are decoding when one long prompt (2,048 tokens)
  arrives. With the whole prompt in one step, every decoding stream waits for it; with
  the prompt cut into chunks of a token budget (`--max-num-batched-tokens`), the streams
  go on between chunks. For each way: the decoding streams' longest gap between two
  tokens and their median gap, and the long request's time to its first token;
- the queue's order: requests arrive at random (Poisson, seeded) past what two running
  slots can serve, three short ones (64 prompt tokens, 16 new) to one long (512, 96).
  First come, first served against priority to the short ones (`--scheduling-policy
  priority`). Per kind, the slowdown (time in the system over the time alone) at its
  median and worst, and Jain's fairness index over every request's slowdown (1: all slowed
  alike).

    python labs/prefill_fairness.py [--chunks 0,512,128] [--requests 40]

Writes an evidence record and a PNG (the stall by chunk size; slowdowns by policy).
"""

from __future__ import annotations

import argparse
import random
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
from tokenworks.models import load as load_model  # noqa: E402

KINDS = {"short": (64, 16, 3), "long": (512, 96, 1)}  # prompt, new tokens, weight


def stall(model: str, loaded, chunk: int, decoders: int, long_prompt: int, threads: int) -> dict:
    """`decoders` short requests decoding when a long prompt arrives; chunk 0: whole."""
    budget = chunk or long_prompt + decoders
    llm = LLM(model, loaded=loaded, threads=threads, enable_prefix_caching=False,
              enable_chunked_prefill=bool(chunk), max_num_batched_tokens=budget,
              max_num_seqs=decoders + 1)  # fmt: skip
    engine, loop, vocab = llm.engine, llm.loop, llm.engine.spec.vocab_size
    short = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    seqs = [loop.add_request(latency_prompt(32, vocab, seed=i), params=short)
            for i in range(decoders)]  # fmt: skip
    for _ in range(8):  # every short one prefilled and decoding
        loop.step()
    times: dict[int, list[float]] = {i: [] for i in range(decoders)}
    counts = [len(s.output_ids) for s in seqs]
    arrived = time.perf_counter()
    long = loop.add_request(
        latency_prompt(long_prompt, vocab, seed=99),
        params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
    )
    first = None
    while not long.finished:
        loop.step()
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            if len(s.output_ids) > counts[i]:
                counts[i] = len(s.output_ids)
                times[i].append(now)
        if first is None and long.output_ids:
            first = now - arrived
    gaps = [b - a for t in times.values() for a, b in zip([arrived, *t], t, strict=False)]
    for s in seqs:
        loop.abort(s.request_id)
    loop.run_while(engine.has_unfinished)
    return {
        "chunk": chunk or "whole",
        "longest_gap_ms": 1000 * max(gaps),
        "median_gap_ms": 1000 * statistics.median(gaps),
        "long_first_token_ms": 1000 * first,
    }


def alone(llm: LLM, vocab: int) -> dict[str, float]:
    """Each kind's seconds with nothing else running."""
    out = {}
    for kind, (prompt, new, _) in KINDS.items():
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        runs = []
        for i in range(3):
            t0 = time.perf_counter()
            llm.generate([latency_prompt(prompt, vocab, seed=500 + i)], params, use_tqdm=False)
            runs.append(time.perf_counter() - t0)
        out[kind] = statistics.median(runs[1:])
    return out


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def queue_order(
    model: str, loaded, policy: str, n: int, load: float, threads: int, seed: int
) -> dict:
    llm = LLM(model, loaded=loaded, threads=threads, enable_prefix_caching=False,
              max_num_seqs=2, scheduling_policy=policy)  # fmt: skip
    engine, loop, vocab = llm.engine, llm.loop, llm.engine.spec.vocab_size
    service = alone(llm, vocab)
    weights = [k[2] for k in KINDS.values()]
    mean = sum(service[k] * KINDS[k][2] for k in KINDS) / sum(weights)
    rng = random.Random(seed)
    plan, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(load * 2 / mean)  # two slots: capacity about 2 / mean
        plan.append((t, rng.choices(list(KINDS), weights)[0], i))
    seqs, done = {}, {}
    start = time.perf_counter()
    pending = list(plan)
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, kind, i = pending.pop(0)
            prompt, new, _ = KINDS[kind]
            seqs[i] = (at, kind, loop.add_request(latency_prompt(prompt, vocab, seed=i),
                params=SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
                priority=0 if kind == "short" else 1))  # fmt: skip
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        loop.step()
        now = time.perf_counter() - start
        for i, (at, kind, seq) in seqs.items():
            if i not in done and seq.finished:
                done[i] = (kind, (now - at) / service[kind])
    by_kind = {}
    for kind in KINDS:
        slow = sorted(s for k, s in done.values() if k == kind)
        by_kind[kind] = {"median_slowdown": statistics.median(slow), "worst_slowdown": slow[-1],
                         "requests": len(slow)}  # fmt: skip
    return {"policy": policy, "service_s": service, "by_kind": by_kind,
            "jain_fairness": jain([s for _, s in done.values()])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", default="0,512,128", help="token budgets (0: the whole prompt)")
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--load", type=float, default=1.2, help="offered load (1: two slots' worth)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(chunks="0,64", decoders=2, long_prompt=128, requests=6))
    loaded = load_model(args.model)
    chunks = [int(c) for c in args.chunks.split(",")]
    stalls = {}
    for c in tqdm(chunks, desc="chunk sizes", unit="size"):
        stalls[str(c)] = r = stall(
            args.model, loaded, c, args.decoders, args.long_prompt, args.threads
        )
        print(f"prefill {r['chunk']}: decoding streams' longest gap {r['longest_gap_ms']:.0f} ms "
              f"(median {r['median_gap_ms']:.1f}), the long prompt's first token "
              f"{r['long_first_token_ms']:.0f} ms")  # fmt: skip
    orders = {}
    for policy in tqdm(("fcfs", "priority"), desc="queue order", unit="policy"):
        orders[policy] = r = queue_order(
            args.model, loaded, policy, args.requests, args.load, args.threads, args.seed
        )
        print(f"{policy:8s} " + ", ".join(
            f"{k}: median slowdown {v['median_slowdown']:.1f}, worst {v['worst_slowdown']:.1f}"
            for k, v in r["by_kind"].items()) + f"; Jain {r['jain_fairness']:.2f}")  # fmt: skip
    record = make_record(
        kind="lab.prefill_fairness",
        engine={"threads": args.threads, "model": args.model, "prefix_caching": False},
        model={"id": args.model},
        workload={
            "chunks": chunks,
            "decoders": args.decoders,
            "long_prompt": args.long_prompt,
            "kinds": KINDS,
            "requests": args.requests,
            "load": args.load,
            "slots": 2,
            "arrivals": "Poisson",
        },  # fmt: skip
        results={"chunked_prefill": stalls, "queue_order": orders},
        seeds=[args.seed],
    )
    path = write_record(record, args.out)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [str(stalls[c]["chunk"]) for c in stalls]
    xs = range(len(names))
    a.bar([x - 0.2 for x in xs], [stalls[c]["longest_gap_ms"] for c in stalls], 0.4,
          label="decoding streams' longest gap")  # fmt: skip
    a.bar([x + 0.2 for x in xs], [stalls[c]["long_first_token_ms"] for c in stalls], 0.4,
          label="the long prompt's first token")  # fmt: skip
    a.set(xticks=list(xs), xticklabels=[f"prefill: {n}" for n in names], ylabel="ms",
          title=f"a {args.long_prompt}-token prompt among {args.decoders} decoding")  # fmt: skip
    a.legend(fontsize=7)
    for i, r in enumerate(orders.values()):
        for j, kind in enumerate(KINDS):
            v = r["by_kind"][kind]
            b.bar(i * 3 + j, v["median_slowdown"], color=f"C{j}", label=kind if i == 0 else None)
            b.plot([i * 3 + j] * 2, [v["median_slowdown"], v["worst_slowdown"]], "k-")
    b.set(xticks=[0.5, 3.5], xticklabels=list(orders), ylabel="slowdown (median; line: worst)",
          yscale="log", title=f"two slots at {args.load}x their capacity")  # fmt: skip
    b.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
