"""`tokenworks bench throughput`: offline throughput of many requests, with peers, one record.

By default N requests of distinct P-token prompts, O output tokens each (greedy, EOS
ignored, all submitted at once); or any single-prompt
manifest (--manifest; text prompts are tokenised once, so every engine gets the same ids).
Our engine runs them through continuous batching (LLM.generate); peers run the same token
ids in their own venvs in the same run. The record also says how much KV memory the paged
pool actually used at its peak against what a contiguous cache (one max-length row per
sequence) would reserve.

With --rounds N every engine runs N times, one after the other in each round; the figures
are each engine's median, and the record keeps every round and each round's ratios. What
else the record says of an engine's run (our steps, batch sizes and preemptions, a peer's
elapsed time) comes from its median round (median_round). Rounds exist because on a
shared machine one engine's figure moves a lot between runs minutes apart.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from tokenworks.bench.latency import parse_peers, run_peer
from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.bench.workload import build_requests, load_manifest
from tokenworks.config import engine_kwargs

PEER_SCRIPTS = {
    "transformers": "transformers_throughput.py",
    "llama.cpp": "llamacpp_throughput.py",
    "vllm": "vllm_throughput.py",
}


def median_round(tok_s: list[float]) -> int:
    """The index of the round whose figure is the median (of an even count, the lower of
    the two middle ones): the round a record's other details of that engine come from."""
    order = sorted(range(len(tok_s)), key=tok_s.__getitem__)
    return order[(len(tok_s) - 1) // 2]


def default_manifest(args) -> dict:
    """The flags' workload: N distinct random prompts of P tokens, O output tokens each."""
    return {
        "kind": "random",
        "num_requests": args.num_prompts,
        "seed": getattr(args, "seed", 0),
        "input": {"dist": "fixed", "value": args.input_tokens},
        "output": {"dist": "fixed", "value": args.output_tokens},
        "ignore_eos": True,
    }


def run_throughput(args, peers: dict[str, str] | None = None, not_run: dict | None = None) -> Path:
    """Measure ours, then each peer ({name: its python}, default from --peer flags); peers
    in not_run ({name: reason}) are recorded as NOT_RUN."""
    from tokenworks import LLM, SamplingParams

    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        raise ValueError(f"rounds {rounds}: every engine runs at least once; give 1 or more")
    peers = parse_peers(args.peer, PEER_SCRIPTS) if peers is None else peers
    manifest = load_manifest(args.manifest) if getattr(args, "manifest", None) else None
    manifest = manifest or default_manifest(args)
    threads = args.threads or 2
    llm = LLM(args.model, **{**engine_kwargs(args), "threads": threads})
    engine = llm.engine
    requests = build_requests(manifest, engine.spec.vocab_size)
    if any(r.turns for r in requests):
        raise ValueError("offline throughput takes single-prompt workloads, not multi_turn")
    prompts = [
        r.prompt_ids if r.prompt_ids is not None else engine.tokenizer.encode(r.prompt)
        for r in requests
    ]  # every engine gets these very token ids
    max_tokens = [r.max_tokens for r in requests]
    ignore_eos = all(r.ignore_eos for r in requests)
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=r.ignore_eos)
        for n, r in zip(max_tokens, requests, strict=True)
    ]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    input_tokens = sum(map(len, prompts))

    def measure_ours() -> tuple[dict, list]:
        engine.blocks.reset_prefix_cache()  # the measured prompts must not hit earlier ones
        engine.stats.clear()
        t = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        run = {"elapsed_s": elapsed, "output_tokens": generated}
        return {**run, "output_tok_s": generated / elapsed}, list(engine.stats)

    peer_args = {
        "gguf": engine.loaded.file_path,
        "hf_dir": args.hf_dir or "",
        "prompts": prompts,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "threads": threads,
        "dtype": llm.config.resolved_dtype,
    }
    # Rounds: every engine once a round, in the same order, so that each round compares
    # engines a few minutes apart; the figures are each engine's median over the rounds.
    ours_runs: list[dict] = []
    ours_stats: list[list] = []  # each round's step stats
    peer_runs: dict[str, list[dict]] = {name: [] for name in peers}
    for r in range(rounds):
        run, stats = measure_ours()
        ours_runs.append(run)
        ours_stats.append(stats)
        for name, python in peers.items():
            print(f"measuring peer {name} with {python} (round {r + 1} of {rounds})")
            peer_runs[name].append(run_peer(name, python, peer_args, script=PEER_SCRIPTS[name]))
    elapsed = statistics.median(x["elapsed_s"] for x in ours_runs)
    mid = median_round([x["output_tok_s"] for x in ours_runs])
    generated, stats = ours_runs[mid]["output_tokens"], ours_stats[mid]
    block_bytes = engine.kv_bytes_per_token * engine.config.block_size
    peak_blocks = max(round(s.kv_usage * engine.blocks.num_blocks) for s in stats)
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens, strict=True))
    kv = {
        "paged_peak_bytes": peak_blocks * block_bytes,
        "paged_pool_bytes": engine.blocks.num_blocks * block_bytes,
        "contiguous_max_model_len_bytes": len(prompts)
        * engine.max_model_len
        * engine.kv_bytes_per_token,
        # a contiguous cache sized for this workload's longest request, one row per sequence
        "contiguous_exact_length_bytes": len(prompts) * longest * engine.kv_bytes_per_token,
        "bytes_per_token": engine.kv_bytes_per_token,
    }
    ours = {
        "elapsed_s": elapsed,  # the median over the rounds (ours_runs)
        "output_tokens": generated,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + input_tokens) / elapsed,
        "steps": len(stats),  # this and below: the median round's steps
        "max_batch_size": max(s.batch_size for s in stats),
        "preemptions": sum(s.preemptions for s in stats),
        "rounds": ours_runs,
    }
    if engine.routing_totals is not None:  # an MoE model: what its routers did
        ours["moe_experts_touched_mean"] = sum(s.moe_experts_touched for s in stats) / len(stats)
        ours["moe_imbalance_mean"] = sum(s.moe_imbalance for s in stats) / len(stats)
        ours["moe_tokens_per_expert"] = engine.routing_totals.tolist()  # all rounds
    peer_results = {name: {"status": "NOT_RUN", "reason": r} for name, r in (not_run or {}).items()}
    per_round = {}
    for name, runs in peer_runs.items():
        ok = [x for x in runs if x.get("status") == "OK"]
        if len(ok) < len(runs):  # a failed round fails the peer: its figures would be a subset
            peer_results[name] = next(x for x in runs if x.get("status") != "OK")
            continue
        tok_s = [x["output_tok_s"] for x in ok]
        median = statistics.median(tok_s)
        peer_results[name] = {**ok[median_round(tok_s)], "output_tok_s": median, "rounds": tok_s}
        per_round[name] = [o["output_tok_s"] / p for o, p in zip(ours_runs, tok_s, strict=True)]
    ratios = {
        name: ours["output_tok_s"] / r["output_tok_s"]
        for name, r in peer_results.items()
        if r.get("status") == "OK"
    }
    record = make_record(
        kind="throughput",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            **manifest,
            "threads": threads,
            "sampling": "greedy",
            "arrival": "offline",
            "rounds": rounds,
        },
        results={
            "tokenworks": ours,
            "kv_memory": kv,
            "ratio_tokenworks_to_peer_output_tok_s": ratios,  # of the medians
            "ratio_per_round": per_round,
            "steps": [s.__dict__ for s in stats],
        },
        seeds=[manifest.get("seed", 0)],
        peers=peer_results,
    )
    path = write_record(record, args.out)
    summary = {"tokenworks": ours, "kv_memory": kv, "ratios": ratios, "per_round": per_round}
    print(json.dumps(summary, indent=2))
    print(f"record: {path}")
    return path
