"""Prefill / decode disaggregation against colocation, on the same cores in the same run.

Two engine cores of --threads each in both setups: "colocated", two replicas each taking
prompts and decoding (least-loaded routing); "disaggregated", one prefill engine and one
decode engine (front/disaggregated.py). The workload: --streams decode streams running
throughout, and meanwhile --long prompts of --prompt tokens arriving one every
--interval seconds, each generating --long-tokens. Measured: the streams' inter-token
latency while the long prompts arrive (p50, p99, max), the long prompts' time to first
token, and, disaggregated, each handoff's blocks, bytes and seconds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from tokenworks.bench.compiled import prompt_of
from tokenworks.bench.metrics import percentile
from tokenworks.bench.record import make_record, write_record
from tokenworks.front.interface import Submission

SETUPS = ("colocated", "disaggregated")


def _config(name: str, args):
    from tokenworks.config import EngineConfig

    return EngineConfig(model=name, threads=args.threads, max_num_seqs=args.streams + args.long,
                        warmup=True)  # fmt: skip


def _front(setup: str, config):
    from tokenworks.front.core_client import CoreClient
    from tokenworks.front.disaggregated import DisaggregatedRouter
    from tokenworks.front.replicas import ReplicaRouter

    cores = [CoreClient(config, startup_timeout_s=900) for _ in range(2)]
    if setup == "colocated":
        return ReplicaRouter(cores, "least_loaded")
    return DisaggregatedRouter(cores[:1], cores[1:])


async def _workload(front, vocab: int, args) -> dict:
    from tokenworks.engine.request import SamplingParams

    steady = SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True)
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]

    async def stream(i: int):
        prompt = prompt_of(args.stream_prompt, vocab, 100 + i)
        async for _ in front.generate(Submission(steady, prompt)):
            arrivals[i].append(time.perf_counter())

    async def long_one(i: int) -> float:
        params = SamplingParams(max_tokens=args.long_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        ttft = None
        prompt = prompt_of(args.prompt, vocab, 1000 + i)
        async for _ in front.generate(Submission(params, prompt, request_id=f"long-{i}")):
            ttft = ttft if ttft is not None else time.perf_counter() - t0
        return ttft

    streams = [asyncio.create_task(stream(i)) for i in range(args.streams)]
    while min(len(a) for a in arrivals) < 4:  # every stream decoding
        await asyncio.sleep(0.05)
    start = time.perf_counter()
    longs = []
    for i in range(args.long):
        longs.append(asyncio.create_task(long_one(i)))
        await asyncio.sleep(args.interval)
    ttfts = await asyncio.gather(*longs)
    end = time.perf_counter()
    for t in streams:
        t.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False)
            if a >= start and b <= end]  # fmt: skip
    return {
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "itl_max_s": max(gaps),
        "stream_tokens_s": len(gaps) / (end - start),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts),
        "ttft_s": ttfts,
        "window_s": end - start,
    }


def measure(name: str, setup: str, args) -> dict:
    front = _front(setup, _config(name, args))
    front.start()
    try:
        row = asyncio.run(_workload(front, front.engine.spec.vocab_size, args))
        # the long prompts' handoffs (the streams' short prompts are handed off too)
        transfers = [t for t in getattr(front, "transfers", []) if t.request_id.startswith("long")]
        if transfers:
            row["transfers"] = {
                "count": len(transfers),
                "blocks_per_request": statistics.mean(t.blocks for t in transfers),
                "bytes_per_request": statistics.mean(t.nbytes for t in transfers),
                "write_s_per_request": statistics.mean(t.write_s for t in transfers),
                "handoff_s_per_request": statistics.mean(t.handoff_s for t in transfers),
            }
        return row
    finally:
        front.shutdown()


def run_disaggregation_bench(args) -> Path:
    rows = {}
    names = list(args.models)
    for name in names:
        for setup in tqdm(SETUPS, desc=name):
            rows.setdefault(name, {})[setup] = measure(name, setup, args)
    record = make_record(
        kind="disaggregation",
        engine={"cores": 2, "config": _config("MODEL", args).to_dict(), "setups": SETUPS},
        model={"names": names},
        workload={
            "streams": args.streams,
            "stream_prompt": args.stream_prompt,
            "long_prompts": args.long,
            "long_prompt_tokens": args.prompt,
            "long_generated_tokens": args.long_tokens,
            "interval_s": args.interval,
            "threads_per_core": args.threads,
            "sampling": "greedy",
        },
        results={"rows": rows},
    )
    path = write_record(record, args.out)
    print(table(rows))
    print(f"record: {path}")
    return path


def table(rows: dict) -> str:
    out = ["| model / setup | stream ITL p50 ms | p99 ms | max ms | long TTFT p50 s | max s | "
           "handoff ms | MB moved |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, setups in rows.items():
        for setup, r in setups.items():
            t = r.get("transfers")
            moved = (f"{t['handoff_s_per_request'] * 1e3:.1f} | "
                     f"{t['bytes_per_request'] / 1e6:.1f}") if t else "- | -"  # fmt: skip
            out.append(
                f"| {name} {setup} | {r['itl_p50_s'] * 1e3:.1f} | {r['itl_p99_s'] * 1e3:.1f} | "
                f"{r['itl_max_s'] * 1e3:.1f} | {r['ttft_p50_s']:.2f} | {r['ttft_max_s']:.2f} | "
                f"{moved} |"
            )
    return "\n".join(out)
